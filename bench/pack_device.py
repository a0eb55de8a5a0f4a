"""Pack what a GPU run needs into .gpu/ (git-ignored) to carry to the device machine: the wheels
to install there, and compiled artifact folders.

    python bench/pack_device.py wheels                        # .gpu/wheels/ (about 3 MB)
    python bench/pack_device.py artifacts tiny-sm_80 demo-sm_80 expected.json   # .gpu/artifacts.zip
    # carry [".gpu/wheels", ".gpu/artifacts.zip"], then on the device:
    bash bench/on_device.sh python3 bench/gpu_check.py run --json $OUT/gpu_check.json

The device has Python 3.12, torch (with numpy and jinja2), safetensors, tokenizers and pip, no
IREE, and no package index. `wheels` writes three wheels that `pip install --no-deps --target
/tmp/site` installs there (bench/on_device.sh does it): dflash_iree, built here from this checkout
(`pip wheel --no-deps`), and the cp312 manylinux x86_64 wheels of iree-base-runtime 3.13.0 and
ml_dtypes (bf16 arrays for the runtime), downloaded here (`pip download --only-binary :all:`) into
.whl/ once, or taken from `--from DIR`. What travels with a command is capped at 64 MiB with the
tracked tree (about 46 MB), so the runtime wheel (15 MB) is rewritten without its tracy-instrumented
copy of the libraries and without the command-line tools but iree-benchmark-module (bench/topk_bench.py
runs it): still a wheel, its RECORD listing what is left, 2.3 MB. A module's PTX is text: an
8B vmfb of 7.5 MB deflates to 1.4 MB in artifacts.zip.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".gpu"
CACHE = ROOT / ".whl"
IREE_RUNTIME = "iree-base-runtime==3.13.0"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
# In the runtime wheel: the tracy-instrumented copy, and the tools; iree-benchmark-module stays.
LEAVE_OUT = ("iree/_runtime_libs_tracy/", "iree/_runtime_libs/iree-")
KEEP = ("iree/_runtime_libs/iree-benchmark-module",)
# What the dflash_iree wheel is built from (pyproject's packages and readme), copied apart so that
# nothing left in an in-tree build/ folder can end up in it.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "dflash_iree", "export", "kernels", "runtime")
SOURCE_SUMS = "sources.sha256"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build_wheel(out: Path) -> Path:
    """The dflash_iree wheel of this working tree, built into `out`; returns its path. With setuptools
    in this environment the build uses it; without, pip fetches it into an isolated build."""
    try:
        import setuptools  # noqa: F401

        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in WHEEL_SOURCES:
            if (ROOT / name).is_dir():
                shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(ROOT / name, src / name)
        _pip("wheel", "--quiet", "--no-deps", *isolation, "-w", tmp, str(src))
        (built,) = Path(tmp).glob("dflash_iree-*.whl")
        write_source_sums(out / SOURCE_SUMS)
        return Path(shutil.copy2(built, out / built.name))


def write_source_sums(path: Path) -> None:
    """`sha256sum` lines of the Python files the wheel is built from, relative to the repository root:
    bench/on_device.sh checks them against the tree it runs in (`sha256sum --check`, and the list of
    files against the tree's, sorted bytewise), so a wheel built before an edit (a kernel's reference.py, say) cannot be what the device imports unnoticed."""
    files = sorted((f for name in WHEEL_SOURCES if (ROOT / name).is_dir() for f in (ROOT / name).rglob("*.py")
                    if "__pycache__" not in f.parts), key=lambda f: str(f.relative_to(ROOT)).encode())
    path.write_text("".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.relative_to(ROOT)}\n" for f in files))


def download(requirements: list[str], into: Path) -> list[Path]:
    """cp312 manylinux x86_64 binary wheels of `requirements` in `into` (downloaded when missing)."""
    into.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    _pip("download", "--quiet", "--no-deps", "--only-binary", ":all:", "--python-version", "3.12", *platforms,
         "-d", str(into), *requirements)
    return [_find(into, r) for r in requirements]


def _find(folder: Path, requirement: str) -> Path:
    name, _, version = requirement.partition("==")
    found = sorted(folder.glob(f"{name.replace('-', '_')}-{version or '*'}-*.whl"))
    if not found:
        raise SystemExit(f"no wheel of {requirement} in {folder}: put its cp312 manylinux x86_64 wheel there")
    return found[-1]


def trim(wheel: Path, out: Path) -> Path:
    """`wheel` rewritten into `out` without LEAVE_OUT (but KEEP), its RECORD listing what is left."""
    dst_path = out / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(dst_path, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {n for n in src.namelist() if n.startswith(LEAVE_OUT) and n not in KEEP}
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(l for l in lines if l.split(",", 1)[0] not in dropped).encode()
            dst.writestr(info, data)
    return dst_path


def pack_wheels(out: Path, source: Path | None) -> list[Path]:
    """The three wheels of the device install in `out` (emptied first)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    reqs = [IREE_RUNTIME, f"ml_dtypes=={metadata.version('ml_dtypes')}"]
    runtime, ml_dtypes = [_find(source, r) for r in reqs] if source else download(reqs, CACHE)
    return [build_wheel(out), trim(runtime, out), Path(shutil.copy2(ml_dtypes, out / ml_dtypes.name))]


def pack_artifacts(names: list[str], out: Path) -> Path:
    """The files under .gpu/NAME for each name in one zip (paths relative to .gpu)."""
    missing = [n for n in names if not (WORK / n).exists()]
    if missing:
        raise SystemExit(f"not in {WORK}: {', '.join(missing)}")
    tmp = out.with_suffix(".partial")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in names:
            path = WORK / name
            for f in sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]:
                dst.write(f, f.relative_to(WORK))
    tmp.rename(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wheels", help="the wheels to install on the device")
    w.add_argument("--out", type=Path, default=WORK / "wheels")
    w.add_argument("--from", dest="source", type=Path, help="take the runtime and ml_dtypes wheels from here")
    a = sub.add_parser("artifacts", help="folders (or files) of .gpu/ in one zip")
    a.add_argument("names", nargs="+")
    a.add_argument("--out", type=Path, default=WORK / "artifacts.zip")
    args = ap.parse_args()
    if args.cmd == "wheels":
        for path in pack_wheels(args.out, args.source):
            print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {path.stat().st_size / 2**20:.1f} MiB")
    else:
        out = pack_artifacts(args.names, args.out)
        print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
