"""dflash-iree: ahead-of-time compiled DFlash speculative decoding on IREE.

The pipeline shows in the folders: `export/` (PyTorch target and drafter, the eager reference,
export to MLIR) -> `compiled/` (what `dflash-iree compile` writes per arch) -> `runtime/` (loads
the artifacts and decodes). This package holds what all three share without torch: config and
checkpoint reading, the acceptance rule, errors, and the CLI. It is imported one way everywhere:
installed (`pip install -e .` here; on the GPU machine the built wheel, bench/pack_device.py).
"""

__version__ = "0.1.0"
