"""dflash-iree: ahead-of-time compiled DFlash speculative decoding on IREE.

The pipeline shows in the folders: `export/` (PyTorch target and drafter, the eager reference,
export to MLIR) -> `compiled/` (what `dflash-iree compile` writes per arch) -> `runtime/` (loads
the artifacts and decodes). This package holds what all three share without torch: config and
checkpoint reading, the acceptance rule, errors, and the CLI.
"""

__version__ = "0.1.0"

# In a bare checkout (no install: the device machines), let `dflash_iree.export`, `.runtime` and
# `.kernels` resolve to the root folders, as pyproject's package-dir does for an install.
from pathlib import Path as _Path

_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "runtime" / "__init__.py").is_file():
    __path__.append(str(_root))
