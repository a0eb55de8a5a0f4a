"""Session fixtures: tiny random checkpoints on disk, made once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_drafter, make_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def target_dir(tiny_dir) -> Path:
    """Untied float32 tiny Qwen3 (4 layers, vocab 512, no eos)."""
    return make_target(tiny_dir / "target")


@pytest.fixture(scope="session")
def tied_target_dir(tiny_dir) -> Path:
    """Tied-embedding float32 tiny Qwen3."""
    return make_target(tiny_dir / "target-tied", tie=True, seed=1)


@pytest.fixture(scope="session")
def drafter_dir(tiny_dir, target_dir) -> Path:
    """Random float32 DFlash drafter for target_dir: block 8, 2 layers, taps (0, 2), mask id 511."""
    return make_drafter(tiny_dir / "drafter", target_dir)


@pytest.fixture(scope="session")
def host_artifacts(tmp_path_factory, target_dir, drafter_dir) -> Path:
    """The tiny pair compiled for the host CPU (block 8, max_context 256, float32), once per session."""
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = tmp_path_factory.mktemp("compiled") / "host"
    compile_artifacts("host", target_dir, drafter_dir, out, max_context=256, log=Progress(open(os.devnull, "w")))
    return out
