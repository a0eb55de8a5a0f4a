"""Build variants of the skinny GEMM's CUDA object (kernels/gemm/gemm_gpu.cu) that may stream faster at
M = 1 without changing any sum (issue #24: decode runs on the verify kernel since row invariance, at
0.70-0.79 of copy bandwidth where IREE's matvec ran 0.96).

    .venv/bin/python experiments/2026-12-03-gemm-m1-variants/build.py      # here: .gpu/gemm-variants/
    bash bench/on_device.sh python3 bench/gemm_bench.py run --ptx .gpu/gemm-variants --ms 1,16 \
        --shapes 6144x4096,4096x4096,24576x4096,4096x12288,151936x4096 --json OUT   # there (CuPy)

Every variant changes only what the numerics contract leaves free (gemm_body.h): workgroups resident
per SM (GM_MINB: the register cap) and chunks loaded per round (GM_U). Each is timed at the splits
the production plan gives the decode step's weights (kernels/gemm/dispatch.py `gemm_plan`, sm_80), so
its sums are the committed kernel's; the bench's parity and row checks say so on the device.
The decode step's weights appear as single weights of the same bytes and column blocks: q+k+v as
6144x4096 (2 splits), o_proj 4096x4096 (4), gate+up 24576x4096 (1 split, 1 or 2 passes), down
4096x12288 (3), lm_head 151936x4096 (1).
"""

import json
import subprocess
from pathlib import Path

from dflash_iree.kernels.build import CLANG, targets

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".gpu" / "gemm-variants"
VARIANTS = {  # name -> extra -D flags (the committed object: 4 warps, 8 chunks a round, 4 workgroups an SM)
    "base": [],
    "b6": ["-DGM_MINB=6"],
    "b8": ["-DGM_MINB=8"],
    "u16": ["-DGM_U=16"],
    "u4b8": ["-DGM_U=4", "-DGM_MINB=8"],
}
SPLITS = {"6144x4096": [2], "4096x4096": [4], "24576x4096": [1], "4096x12288": [3], "151936x4096": [1],
          "1024x4096": [16], "12288x4096": [1]}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    arch, folder, args = targets()["gemm_sm_80.ptx"]
    listed = []
    for name, extra in VARIANTS.items():
        out = OUT / f"gemm_{name}.ptx"
        subprocess.run([CLANG, *args[:-1], *extra, args[-1], "-o", str(out)], cwd=ROOT / "kernels" / folder, check=True)
        listed.append({"name": name, "file": out.name, "threads": 128, "bn": 32, "round": 32, "ms": [1, 16],
                       "splits": SPLITS, "passes": [1, 2] if name == "base" else [1], "flags": extra})
    (OUT / "variants.json").write_text(json.dumps(listed, indent=1) + "\n")
    print(f"{len(listed)} variants in {OUT}")


if __name__ == "__main__":
    main()
