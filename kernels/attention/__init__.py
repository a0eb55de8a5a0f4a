"""The block attention of the verify step over the KV cache, read in place (flash decoding in one dispatch).

- attention_body.h, attention_gpu.cu: the kernel and its GPU layer (every GPU arch; the gated
  entry points are objects of their own);
- dispatch.py: the MLIR of the spliceable dispatch (`attention_dispatch`) and a standalone module;
- reference.py: the float64 NumPy reference.
"""

from .dispatch import (ARCHS, CUDA_ARCHS, HIP_ARCHS, KEYS_PER_CHUNK, MAX_GATED_HEAD_DIM, MAX_HEAD_DIM, MAX_ROWS,
                       OBJECTS_DIR, ROWS_PER_WORKGROUP, THREADS, AttentionDispatch, attention_dispatch, entry_point,
                       f32_bits, object_file, standalone_module, why_unsupported)

__all__ = ["ARCHS", "CUDA_ARCHS", "HIP_ARCHS", "KEYS_PER_CHUNK", "MAX_GATED_HEAD_DIM", "MAX_HEAD_DIM", "MAX_ROWS",
           "OBJECTS_DIR", "ROWS_PER_WORKGROUP", "THREADS", "AttentionDispatch", "attention_dispatch", "entry_point",
           "f32_bits", "object_file", "standalone_module", "why_unsupported"]
