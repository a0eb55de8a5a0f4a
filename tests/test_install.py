"""The package as the GPU machine gets it: the built wheel installed with `pip install --no-deps
--target DIR` (bench/pack_device.py builds it, bench/on_device.sh installs it) resolves every
subpackage from DIR, with no path set up by the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installed_with_target_imports_from_there(tmp_path):
    pytest.importorskip("setuptools")  # the wheel is built without an index (no build isolation)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    src = tmp_path / "src"  # what the wheel is built from, apart from the checkout (no build/ left in it)
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("dflash_iree", "export", "kernels", "runtime"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(pip + ["wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
                   check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("dflash_iree-*.whl")
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--quiet", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, cwd=tmp_path)
    code = ("import dflash_iree, dflash_iree.runtime.engine as e, dflash_iree.export, dflash_iree.kernels; "
            "print(dflash_iree.__file__, e.__file__, dflash_iree.export.__file__, dflash_iree.kernels.__file__)")
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    files = [Path(f) for f in r.stdout.split()]
    assert len(files) == 4 and all(f.is_relative_to(site) for f in files), r.stdout
