"""Here: the builds the H200 run needs (README.md in this folder).

    .venv/bin/python experiments/2026-12-03-gpu-row-invariance/prepare.py [demo] [rows] [8b]   # default all

- .gpu/demo-ri-sm_80: the demo pair with the row-invariant lowerings (bench/row_invariance_check.py's
  "row-invariant" build) beside .gpu/demo-sm_80 (the default lowerings);
- .gpu/rows-sm_80/: bench/row_invariance_check.py prepare (demo and 8B, three builds each);
- .gpu/8b-b8-ri-sm_80: bench/speed_8b.py prepare --blocks 8 --variant -ri --row-invariant.
"""

import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def main() -> None:
    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_artifacts

    splices = dict(splice.LOWERINGS)
    splices["gemm"] = functools.partial(splice.lower_linear, row_invariant=True)
    splices["attention"] = functools.partial(splice.lower_attention, min_rows=1)
    only = sys.argv[1:]  # steps to run: demo rows 8b (default all)
    for name, sp in (("demo-ri-sm_80", splices), ("demo-sm_80", None)) if not only or "demo" in only else ():
        compile_artifacts("sm_80", ROOT / "models/demo/target", ROOT / "models/demo/drafter", ROOT / ".gpu" / name,
                          splices=sp)
        print(f"built .gpu/{name}", flush=True)
    if not only or "rows" in only:
        subprocess.run([PY, "bench/row_invariance_check.py", "prepare", "--models", "demo", "8b"], cwd=ROOT, check=True)
    if not only or "8b" in only:
        subprocess.run([PY, "bench/speed_8b.py", "prepare", "--arch", "sm_80", "--blocks", "8", "--variant=-ri",
                    "--row-invariant"], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
