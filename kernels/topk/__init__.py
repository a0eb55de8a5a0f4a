"""Draft top-K with log-probs: one kernel body (topk_body.h) for CUDA, HIP and the host CPU.

- topk_body.h, topk_gpu.cu, topk_cpu.c: the kernel and its GPU / CPU layers (kernels/objects/);
- dispatch.py: the MLIR of the spliceable dispatch (`topk_dispatch`) and a standalone module;
- reference.py: the float64 NumPy reference, the parity cases and the score;
- check.py: `dflash-iree topk-check`, the parity of every case on a device.
"""

from .dispatch import (ARCHS, CUDA_ARCHS, HIP_ARCHS, MAX_K, OBJECTS_DIR, TopKDispatch, check_shape, device_flags,
                       host_object_arch, object_file, plan_chunks, standalone_module, topk_dispatch)

__all__ = ["ARCHS", "CUDA_ARCHS", "HIP_ARCHS", "MAX_K", "OBJECTS_DIR", "TopKDispatch", "check_shape", "device_flags",
           "host_object_arch", "object_file", "plan_chunks", "standalone_module", "topk_dispatch"]
