"""The greedy argmax over a [T, 151936] row of logits in several forms, each alone in an IREE module,
timed on a CUDA GPU by its kernels (CUPTI): which form IREE 3.13 compiles into fast reductions.

    .venv/bin/python experiments/2026-12-07-argmax/forms.py build            # here: .gpu/argmax-forms/
    bash bench/on_device.sh python3 experiments/2026-12-07-argmax/forms.py run --json OUT.json   # there

Forms (the index is the first index of the row's maximum in each):
- flat: the product's (export/sampling.py `_argmax_flat`): one workgroup walks a row;
- cC: argmax.patch's two levels with chunks of C that divide 151936 (1187 = 151936 / 128, a prime; 128);
- pC: the row padded with -inf to a multiple of C, then two levels of chunks of C (1024, 2048, 4096).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".gpu" / "argmax-forms"
V = 151936
FORMS = ["flat", "c1187", "c128", "p1024", "p2048", "p4096"]
ROWS = [1, 16]


def two_level(x, c: int):
    import torch

    Vx = x.shape[-1]
    n = Vx // c
    xc = x.reshape(*x.shape[:-1], n, c)
    m = xc.amax(-1)
    rev = c - torch.arange(c, dtype=torch.int32)
    local = c - torch.where(xc == m[..., None], rev, torch.zeros_like(rev)).amax(-1)
    reverse = Vx - (torch.arange(n, dtype=torch.int32) * c + local)
    best = torch.where(m == m.amax(-1, keepdim=True), reverse, torch.zeros_like(reverse)).amax(-1)
    return (Vx - best).to(torch.int64)


def form_fn(form: str):
    import torch

    def flat(x):
        reverse = x.shape[-1] - torch.arange(x.shape[-1], dtype=torch.int32)
        best = torch.where(x == x.amax(-1, keepdim=True), reverse, torch.zeros_like(reverse)).amax(-1)
        return (x.shape[-1] - best).to(torch.int64)

    if form == "flat":
        return flat
    c = int(form[1:])
    if form[0] == "c":
        return lambda x: two_level(x, c)
    pad = math.ceil(V / c) * c - V
    return lambda x: two_level(torch.nn.functional.pad(x, (0, pad), value=float("-inf")), c)


def build() -> None:
    import torch
    from iree.turbine import aot

    OUT.mkdir(parents=True, exist_ok=True)
    for form in FORMS:
        fn = form_fn(form)

        class M(torch.nn.Module):
            def forward(self, x):
                return fn(x.float())

        for T in ROWS:
            x = torch.randn(T, V).to(torch.bfloat16)
            assert torch.equal(M()(x), x.float().argmax(-1)), form  # eager: the same index
            mlir = OUT / f"{form}_{T}.mlir"
            aot.export(M(), args=(torch.zeros(T, V, dtype=torch.bfloat16),)).save_mlir(str(mlir))
            t = time.time()
            subprocess.run([str(ROOT / ".venv/bin/iree-compile"), str(mlir), "-o", str(OUT / f"{form}_{T}.vmfb"),
                            "--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80",
                            "--iree-global-optimization-opt-level=O3"], check=True)
            mlir.unlink()
            print(f"{form} T={T}: {time.time() - t:.1f} s", flush=True)


def run(out_json: Path) -> None:
    import iree.runtime as rt
    import ml_dtypes
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from common import cuda_profile

    config = rt.Config("cuda")
    rows = []
    for T in ROWS:
        x = torch.randn(T, V).to(torch.bfloat16)
        want = x.float().argmax(-1).numpy()
        bits = x.view(torch.int16).numpy()
        for form in FORMS:
            ctx = rt.SystemContext(config=config)
            ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(OUT / f"{form}_{T}.vmfb")))
            f = ctx.modules.module.main
            dx = rt.asdevicearray(config.device, bits.view(ml_dtypes.bfloat16))
            got = np.asarray(f(dx).to_host()).reshape(-1)
            wall = []
            for _ in range(50):
                t = time.perf_counter()
                f(dx).to_host()
                wall.append((time.perf_counter() - t) * 1e3)
            prof = cuda_profile(lambda: f(dx).to_host(), statistics.median(wall), n=20)
            row = {"form": form, "T": T, "equal": bool((got == want).all()), "wall_ms": statistics.median(wall),
                   "kernels": prof}
            rows.append(row)
            ks = ", ".join(f"{k['kernel'].split('_dispatch_')[-1]} {1e3 * k['ms']:.1f}" for k in prof["top"])
            print(f"{form:6s} T={T:2d} equal {row['equal']}, wall {row['wall_ms']:.3f} ms, busy "
                  f"{1e3 * prof['busy_ms']:.1f} us: {ks}", flush=True)
    out_json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build()
    else:
        run(Path(sys.argv[sys.argv.index("--json") + 1]))
