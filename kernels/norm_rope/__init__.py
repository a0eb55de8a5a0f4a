"""The per-head q_norm / k_norm and RoPE in one dispatch (q and k of a layer together): Qwen3's, and
Qwen3.5's zero-centred, partial-rotary variant with q read in place from [query, gate] heads.

- norm_rope_body.h, norm_rope_gpu.cu: the kernel and its GPU layer (every GPU arch, built with
  -ffp-contract=off);
- dispatch.py: the MLIR of the spliceable dispatch (`norm_rope_dispatch`) and a standalone module;
- reference.py: the NumPy reference, rounding to the dtype where the eager ops do.
"""

from .dispatch import (ARCHS, DTYPES, OBJECTS_DIR, THREADS, NormRopeDispatch, f32_bits, norm_rope_dispatch, norm_rope_kv_dispatch,
                       object_file, standalone_module)

__all__ = ["ARCHS", "DTYPES", "OBJECTS_DIR", "THREADS", "NormRopeDispatch", "f32_bits", "norm_rope_dispatch",
           "norm_rope_kv_dispatch", "object_file", "standalone_module"]
