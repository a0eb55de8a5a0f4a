"""Inline command buffers on CUDA: a measured lever that did not pay (kept to reproduce it).

    python experiments/2026-12-01-inline-command-buffers/probe_inline_execution.py --blocks 16    # here: .gpu/8b-b16inl-sm_80
    # on the H200, side by side with the normal build:
    python3 bench/speed_8b.py run --no-peers --blocks 16 --json A.json
    python3 bench/speed_8b.py run --no-peers --blocks 16 --variant inl \\
        --runtime-flag=--cuda_allow_inline_execution=true --json B.json

IREE records a step's command buffer whole and only then submits it ("deferred"); a command buffer
marked `AllowInlineExecution` lets the CUDA driver (with `--cuda_allow_inline_execution=true`)
launch each dispatch as the VM records it, so the GPU starts while the host is still recording.
IREE marks one inline only when its execution waits on nothing, and ours wait on the step's
transient allocations. This probe compiles the 8B pair through the HAL phase, marks the command
buffers whose execution waits only on those allocations' fences, submits them with no wait (the HAL
refuses an inline command buffer with one), and compiles the rest. That is sound on the pinned
CUDA HAL only because its `queue_alloca` blocks the host until the allocation's own waits hold
(runtime/src/iree/hal/drivers/cuda/cuda_device.c); on the local-task HAL, whose allocations are
asynchronous, the same module fails ("transient buffer has not been committed").

Result (docs/architecture.md, "Host time of a step"; speed_8b_h200_inline*.json beside it): the
tiny and demo pairs stay exact on the H200, and nothing got faster: the host's time a step, which
is what bounds it, did not change.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def allow_inline_execution(hal_ir: str) -> tuple[str, int]:
    """Mark the one-shot command buffers of a HAL-phase module (text) inline where their execution
    waits only on the function's `hal.device.queue.alloca` fences, and submit those with no wait.
    Returns (the module text, the number of command buffers marked)."""
    out, marked, names = [], 0, itertools.count()
    for func in re.split(r"(?=\n  util\.(?:func|initializer)\b)", hal_ir):
        allocs = set(re.findall(r"hal\.device\.queue\.alloca<[^\n]*? signal\((%[\w]+)\)", func))
        joins = {name: [f.strip() for f in parts.split(",")]
                 for name, parts in re.findall(r"(%[\w]+) = hal\.fence\.join at\(\[([^\]]*)\]\)", func)}
        waits = re.findall(r"hal\.device\.queue\.execute<[^\n]*? wait\((%[\w]+)\)", func)
        creates = func.count("mode(OneShot)")
        if creates and len(waits) == creates and allocs and all(set(joins.get(w, [w])) <= allocs for w in waits):
            func = func.replace("mode(OneShot)", 'mode("OneShot|AllowInlineExecution")')

            def no_wait(m):
                name = f"%__no_wait_{next(names)}"
                return f"\n{m[2]}{name} = util.null : !hal.fence{m[1]}{name})"

            func = re.sub(r"(\n(\s*)hal\.device\.queue\.execute<[^\n]*? wait\()%[\w]+\)", no_wait, func)
            marked += creates
        out.append(func)
    return "".join(out), marked


def main() -> int:
    from dflash_iree.checkpoint import sha256_file
    from dflash_iree.export import compile as cc
    from speed_8b import DRAFTER, TARGET, artifact_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[16])
    args = ap.parse_args()
    plain = cc.run_iree_compile

    def through_hal(mlir, vmfb, flags, stats, extra=()):
        hal = Path(vmfb).with_name("hal.mlir")
        plain(mlir, hal, flags, stats, [*extra, "--compile-to=hal"])
        text, marked = allow_inline_execution(hal.read_text())
        hal.write_text(text)
        print(f"inline command buffers: {marked}", flush=True)
        cmd = [cc.iree_compile_tool(), str(hal), *flags, *[e for e in extra if "dump-compilation" not in e],
               "--compile-from=hal", "-o", str(vmfb)]
        import subprocess
        subprocess.run(cmd, check=True)
        hal.unlink()

    cc.run_iree_compile = through_hal
    for block in args.blocks:
        out = artifact_dir("sm_80", block, "inl")
        cc.compile_artifacts("sm_80", TARGET, DRAFTER, out, block_size=block, dtype="bf16")
        m = json.loads((out / "manifest.json").read_text())
        m["runtime_flags"] = ["--cuda_allow_inline_execution=true"]  # what speed_8b.py run must be given
        (out / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
        assert m["files"]["dflash.vmfb"] == sha256_file(out / "dflash.vmfb")
    return 0


if __name__ == "__main__":
    sys.exit(main())
