"""dflash-iree: ahead-of-time compiled DFlash speculative decoding on IREE.

The pipeline shows in the folders: `export/` (PyTorch target and drafter, the eager reference,
export to MLIR) -> `compiled/` (what `dflash-iree compile` writes per arch) -> `runtime/` (loads
the artifacts and decodes). This package holds what all three share without torch: config and
checkpoint reading, the acceptance rule, errors, and the CLI.
"""

__version__ = "0.1.0"
