"""The Gated DeltaNet step: one GDN layer's token-by-token gated delta rule, its state slots written in place.

- gdn_body.h, gdn_gpu.cu: the kernel and its GPU layer (every GPU arch);
- dispatch.py: the MLIR of the spliceable dispatch (`gdn_dispatch`) and a standalone module;
- reference.py: the NumPy reference, float32 in the kernel's order (its bits are the kernel's).
"""

from .dispatch import (ARCHS, COLUMNS, CUDA_ARCHS, DTYPES, EPS, HIP_ARCHS, MAX_DK, MAX_T, THREADS, GdnDispatch,
                       gdn_dispatch, object_file, standalone_module, why_unsupported)

__all__ = ["ARCHS", "COLUMNS", "CUDA_ARCHS", "DTYPES", "EPS", "HIP_ARCHS", "MAX_DK", "MAX_T", "THREADS", "GdnDispatch",
           "gdn_dispatch", "object_file", "standalone_module", "why_unsupported"]
