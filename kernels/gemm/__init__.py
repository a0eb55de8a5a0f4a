"""The skinny GEMM y[M, N] = x[M, K] . W[N, K]^T (bf16 in, f32 sums, bf16 out) of the verify / draft matmuls.

- gemm_body.h, gemm_gpu.cu: the kernel (mma.sync on CUDA, WMMA on gfx11/12) and its GPU layer;
- dispatch.py: the plan (`gemm_plan`) and the MLIR of the spliceable dispatch (`gemm_dispatch`),
  grouped weights, epilogues and the RMSNorm before the GEMM included (`norm_dispatch`, `norm_fused`),
  and a standalone module;
- reference.py: the float64 NumPy reference and the bf16 parity rule.

The HAL helpers it used to hold (`pipeline_layout`, `executable_head`, ...) are kernels/hal.py's,
and still importable from here.
"""

from ..hal import entry_attribute, executable_head, executable_source, executable_target, gpu_object, pipeline_layout
from .dispatch import (ARCHS, CUDA_ARCHS, EPILOGUES, HIP_ARCHS, MAX_M, MAX_WEIGHTS, OBJECTS_DIR, Q4, Q4_FORMATS, Q4_GROUPS,
                       NORM_MAX_K, GemmDispatch, GemmPlan, gemm_dispatch, gemm_plan, norm_dispatch, norm_fused,
                       norm_why_unsupported, object_file, standalone_module, weight_types, why_unsupported)

__all__ = ["ARCHS", "CUDA_ARCHS", "EPILOGUES", "HIP_ARCHS", "MAX_M", "MAX_WEIGHTS", "OBJECTS_DIR", "Q4", "Q4_FORMATS",
           "Q4_GROUPS", "NORM_MAX_K", "GemmDispatch",
           "GemmPlan", "entry_attribute", "executable_head", "executable_source", "executable_target", "gemm_dispatch",
           "gemm_plan", "gpu_object", "norm_dispatch", "norm_fused", "norm_why_unsupported", "object_file", "pipeline_layout", "standalone_module", "weight_types",
           "why_unsupported"]
