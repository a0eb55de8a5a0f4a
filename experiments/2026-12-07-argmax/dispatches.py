"""What IREE makes of the graph's argmax over a [1, T, 151936] row, one level against two
(export/sampling.py `argmax`), for sm_80, gfx1151 and the host: the dispatches and, on the host,
microseconds a call (IREE's local-task driver, this machine). It imports export/sampling.py's `argmax`
and `_argmax_flat`: `dispatches_c1187.txt` was written with argmax.patch applied (chunks of 1187),
`dispatches.txt` with the padded form the product took (chunks of 4096).

    .venv/bin/python experiments/2026-12-07-argmax/dispatches.py > experiments/2026-12-07-argmax/dispatches.txt
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_iree.arch import compile_flags, resolve_arch  # noqa: E402
from dflash_iree.export.iree_tool import iree_compile_tool  # noqa: E402
from dflash_iree.export.sampling import _argmax_flat, argmax  # noqa: E402

V = 151936


class Choose(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, logits):
        return self.fn(logits.float())


def main() -> None:
    from iree.turbine import aot
    import iree.runtime as rt

    tmp = Path(tempfile.mkdtemp())
    for arch in ("sm_80", "gfx1151", "host"):
        for T in (1, 16):
            for form, fn in (("one level", _argmax_flat), ("two levels", argmax)):
                dtype = torch.float32 if arch == "host" else torch.bfloat16
                mlir, vmfb, dump = tmp / "m.mlir", tmp / f"{arch}{T}{form[0]}.vmfb", tmp / f"d{arch}{T}{form[0]}"
                aot.export(Choose(fn), args=(torch.zeros(1, T, V, dtype=dtype),)).save_mlir(mlir)
                subprocess.run([iree_compile_tool(), str(mlir), "-o", str(vmfb), *compile_flags(resolve_arch(arch)[0]),
                                f"--iree-hal-dump-executable-files-to={dump}"], check=True)
                names = [re.search(r"func.func @main\$async_dispatch_\d+_(\S*?)\(", p.read_text()).group(1)
                         for p in sorted(dump.glob("module_main$async_dispatch_*.mlir"))
                         if not p.name.endswith("benchmark.mlir")]
                line = f"{arch:8} T={T:<3} {form:10} {len(names)} dispatches: {', '.join(names)}"
                if arch == "host":
                    cfg = rt.Config("local-task")
                    ctx = rt.SystemContext(config=cfg)
                    ctx.add_vm_module(rt.VmModule.mmap(cfg.vm_instance, str(vmfb)))
                    f = ctx.modules.module["main"]
                    x = np.random.default_rng(0).standard_normal((1, T, V)).astype(np.float32)
                    assert np.array_equal(np.asarray(f(x)), _argmax_flat(torch.from_numpy(x)).numpy())
                    for _ in range(5):
                        f(x)
                    t = time.perf_counter()
                    for _ in range(50):
                        np.asarray(f(x))
                    line += f"; {(time.perf_counter() - t) / 50 * 1e6:.0f} us a call"
                print(line, flush=True)


if __name__ == "__main__":
    main()
