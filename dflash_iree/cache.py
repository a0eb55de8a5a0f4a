"""Where dflash-iree keeps what it can make again: exported MLIR (export/compile.py) and the tensors
quantized on load (runtime/quantize_on_load.py). Torch-free: the runtime reads it too."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path | None:
    """$DFLASH_IREE_CACHE, else ~/.cache/dflash-iree ($XDG_CACHE_HOME honoured); None when
    $DFLASH_IREE_CACHE is "off"."""
    env = os.environ.get("DFLASH_IREE_CACHE")
    if env == "off":
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-iree"
