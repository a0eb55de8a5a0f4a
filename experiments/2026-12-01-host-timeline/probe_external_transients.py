"""Probe: can the pinned compiler give a step's transients to the caller, so the step's call returns
before its work is done? (docs/architecture.md, "Where a step's time goes".)

On the pinned CUDA HAL a step's `$async` call blocks the host twice: its queue allocation waits on
the host for the call's wait fence, and the deallocation of its transients at the end waits for the
step's work. `--iree-torch-externalize-transients` makes every function take its transients as one
more argument (a buffer the caller keeps), which removes both, so plain decoding could queue step
i + 1 while step i runs. This builds a minimal module shaped like ours (a weight, a cache as a
mutable module global written in place, a token written into a caller's buffer) with one and with two
entry points, compiles each for the host CPU with and without the flag, and counts the queue
allocations left in each `$async` function's VM code.

    python experiments/2026-12-01-host-timeline/probe_external_transients.py [--json OUT]

Runs on the CPU in about a minute; needs the compile extra (torch, iree-turbine, iree-base-compiler).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAG = "--iree-torch-externalize-transients"
HOST = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=host"]


def export(names: list[str], path: Path) -> None:
    """A module with entry points `names` ("a", "b"): both write row `start` of the same cache global
    and their argmax token into the caller's `out`, as export/aot.py's steps do."""
    import iree.turbine.aot as aot
    import torch
    from torch import nn

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))
            self.register_buffer("cache", torch.zeros(128, 64), persistent=False)

        def forward(self, x, start, out):
            h = torch.softmax(torch.relu(x @ self.w.t()) @ self.w, -1)
            self.cache.index_copy_(0, start.reshape(1), h)
            out.copy_((self.cache[:8].sum(0, keepdim=True) + h).argmax(-1, keepdim=True))
            return ()  # the importer refuses None

    def a(m, x, start, out):
        return m(x, start, out)

    def b(m, x, start, out):
        return m(x * 2, start, out)

    fxb = aot.FxProgramsBuilder(Step())
    example = (torch.randn(1, 64), torch.tensor(3), torch.zeros(1, 1, dtype=torch.int64))
    for name in names:
        fxb.export_program({"a": a, "b": b}[name], name=name, args=example, strict=False)
    aot.export(fxb, module_name="probe").save_mlir(str(path))


def queue_ops(vm_text: str, function: str) -> dict:
    """hal.device.queue.* calls in one VM function of `--compile-to=vm` output."""
    start = vm_text.index(f"vm.func private @{function}(")
    end = vm_text.find("\n    vm.func ", start + 1)
    body = vm_text[start:end if end > 0 else len(vm_text)]
    return {op: len(re.findall(rf"@hal\.device\.queue\.{op}(\.indirect)?\(", body)) for op in ("alloca", "dealloca", "execute")}


def probe(names: list[str], flag: bool, work: Path) -> dict:
    mlir = work / f"{'_'.join(names)}.mlir"
    if not mlir.exists():
        export(names, mlir)
    cmd = [str(Path(sys.executable).parent / "iree-compile"), str(mlir), *HOST, *([FLAG] if flag else []),
           "--compile-to=vm", "-o", str(work / "out.mlir")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = {"entry_points": names, "flag": flag, "compiled": r.returncode == 0}
    if r.returncode:
        error = next((line for line in r.stderr.splitlines() if "error:" in line), r.stderr[:200])
        out["error"] = error.replace(str(work) + "/", "")
    else:
        text = (work / "out.mlir").read_text()
        out["queue_ops"] = {f"{n}$async": queue_ops(text, f"{n}$async") for n in names}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(Path(__file__).with_name("probe_external_transients.json")))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [probe(names, flag, Path(tmp)) for names in (["a"], ["a", "b"]) for flag in (False, True)]
    import iree.compiler

    result = {"compiler": iree.compiler.version.VERSION if hasattr(iree.compiler, "version") else None,
              "flag": FLAG, "cases": rows}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("| entry points | flag | compiles | queue alloca / dealloca / execute per $async |")
    print("|---|---|---|---|")
    for r in rows:
        ops = "; ".join(f"{k}: {v['alloca']} / {v['dealloca']} / {v['execute']}" for k, v in r.get("queue_ops", {}).items())
        print(f"| {', '.join(r['entry_points'])} | {'yes' if r['flag'] else 'no'} | "
              f"{'yes' if r['compiled'] else 'no: ' + r['error'].strip()[:90]} | {ops} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
