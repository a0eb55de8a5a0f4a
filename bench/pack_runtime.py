"""Pack iree.runtime (and ml_dtypes) for the GPU machine into one small zip, .gpu/site.zip; and
compiled artifact folders of .gpu/ into another, .gpu/artifacts.zip.

    python bench/pack_runtime.py [--wheels .whl] [--out .gpu/site.zip]
    # on the device:  python3 -m zipfile -e .gpu/site.zip /tmp/site && export PYTHONPATH=/tmp/site:.
    python bench/pack_runtime.py --artifacts 8b-b16-sm_80 tiny-sm_80 ...
    # on the device:  python3 -m zipfile -e .gpu/artifacts.zip .gpu   (then carry only the two zips)

The device has Python 3.12 and no IREE, and what travels with a command is capped (64 MiB with the
tracked tree). The iree-base-runtime wheel (cp312) is 15 MB of which the Python bindings need the
`_runtime_libs` library; its tracy-instrumented copy and the command-line tools are left out,
which takes the pair of wheels from 20 MB to about 6. A module's PTX is text: an 8B vmfb of 7.5 MB
deflates to 1.4.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEAVE_OUT = ("iree/_runtime_libs_tracy/", "iree/_runtime_libs/iree-")


def pack(wheels: Path, out: Path) -> int:
    """Write every file of the wheels in `wheels` except LEAVE_OUT into `out`; returns its size in bytes."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"no .whl in {wheels}: download iree-base-runtime and ml_dtypes wheels for cp312 there")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for wheel in found:
            with zipfile.ZipFile(wheel) as src:
                for info in src.infolist():
                    if not info.filename.startswith(LEAVE_OUT):
                        dst.writestr(info, src.read(info))
    tmp.rename(out)
    return out.stat().st_size


def pack_artifacts(names: list[str], out: Path) -> int:
    """Write the files under .gpu/NAME for each name into `out` (paths relative to .gpu); returns its size."""
    work = ROOT / ".gpu"
    missing = [n for n in names if not (work / n).exists()]
    if missing:
        raise SystemExit(f"not in {work}: {', '.join(missing)}")
    tmp = out.with_suffix(".partial")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in names:
            files = sorted(f for f in (work / name).rglob("*") if f.is_file()) if (work / name).is_dir() else [work / name]
            for f in files:
                dst.write(f, f.relative_to(work))
    tmp.rename(out)
    return out.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--artifacts", nargs="+", help="folders (or files) of .gpu/ to pack instead of the wheels")
    args = ap.parse_args()
    if args.artifacts:
        out = args.out or ROOT / ".gpu" / "artifacts.zip"
        print(f"{out}: {pack_artifacts(args.artifacts, out) / 2**20:.1f} MiB")
    else:
        out = args.out or ROOT / ".gpu" / "site.zip"
        print(f"{out}: {pack(args.wheels, out) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
