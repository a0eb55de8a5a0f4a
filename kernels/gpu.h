/* The GPU primitives a kernel body needs, for NVPTX (CUDA) and AMDGCN (HIP), from clang builtins only.
 *
 * Included by the GPU layers (attention_gpu.cu, gemm_gpu.cu, topk_gpu.cu), built with no vendor header or device library (-nocudainc -nocudalib,
 * or -nogpuinc -nogpulib). IREE's ABI for hand-authored GPU kernels: the bindings in order as
 * pointers, then the 32-bit push constants in order.
 *
 *   KG_TID()           thread index in the workgroup (x only)
 *   KG_WG_X/Y/Z()      workgroup ids
 *   KG_BARRIER()       workgroup barrier that also makes shared-memory writes visible
 *   KG_FENCE()         device-scope memory fence (orders global writes before an arrival count)
 *   KG_EXP2(x)         2^x from the hardware unit (approximate: rel. error ~2^-22; 2^-inf = 0)
 *   KG_SHFL(v, lane)   float v of lane LANE (0..31) of this thread's warp / wave32; every lane must take part
 *   KG_LAUNCH(T)       entry-point attribute: at most T threads per workgroup
 *   KG_FN, KG_SHARED   device-function and workgroup-shared-storage qualifiers
 *   kg_bf16(f)         f32 -> bf16 bits, rounded to nearest even (NaN stays a quiet NaN)
 *
 * Built for the host with KG_HOST_SIMT defined (kernels/simt_host.h, tests only), a workgroup's
 * threads are host threads: shared storage is static, the barrier and the warp read go through it.
 */
#ifndef DFLASH_KERNELS_GPU_H
#define DFLASH_KERNELS_GPU_H

#if defined(KG_HOST_SIMT)
#define KG_SHARED static
#define KG_FN static inline
#define KG_TID() kg_host_tid()
#define KG_BARRIER() kg_host_barrier()
#define KG_SHFL(v, lane) kg_host_shfl((v), (lane))
#else
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define KG_SHARED __shared__
#define KG_FN static __device__ inline __attribute__((always_inline))
#endif

#if defined(KG_HOST_SIMT)
#elif defined(__NVPTX__)
#define KG_TID() ((int)__nvvm_read_ptx_sreg_tid_x())
#define KG_WG_X() ((int)__nvvm_read_ptx_sreg_ctaid_x())
#define KG_WG_Y() ((int)__nvvm_read_ptx_sreg_ctaid_y())
#define KG_WG_Z() ((int)__nvvm_read_ptx_sreg_ctaid_z())
#define KG_BARRIER() __nvvm_bar_sync(0)
#define KG_FENCE() __nvvm_membar_gl()
#define KG_EXP2(x) __nvvm_ex2_approx_ftz_f(x)
#define KG_LAUNCH(T) __attribute__((launch_bounds(T)))
#define KG_SHFL(v, lane) __nvvm_shfl_sync_idx_f32(0xffffffffu, (v), (lane), 0x1f)
#elif defined(__AMDGCN__)
#define KG_TID() ((int)__builtin_amdgcn_workitem_id_x())
#define KG_WG_X() ((int)__builtin_amdgcn_workgroup_id_x())
#define KG_WG_Y() ((int)__builtin_amdgcn_workgroup_id_y())
#define KG_WG_Z() ((int)__builtin_amdgcn_workgroup_id_z())
/* What HIP's __syncthreads does: make LDS writes visible across the workgroup, then wait. */
#define KG_BARRIER()                                       \
  do {                                                     \
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup"); \
    __builtin_amdgcn_s_barrier();                          \
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup"); \
  } while (0)
#define KG_FENCE() __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent")
#define KG_EXP2(x) __builtin_amdgcn_exp2f(x)
#define KG_LAUNCH(T) __attribute__((amdgpu_flat_work_group_size(1, T)))
/* ds_bpermute addresses lanes in bytes; the bodies' warps are 32 lanes, so only wave32 builds */
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != 32
#error "gpu.h: KG_SHFL and the kernels' 32-lane warps need wave32"
#endif
#define KG_SHFL(v, lane) __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute((lane) << 2, __builtin_bit_cast(int, (v))))
#else
#error "gpu.h is for NVPTX or AMDGCN device code only"
#endif

KG_FN unsigned short kg_bf16(float f) {
  union { float f; unsigned u; } v;
  v.f = f;
  unsigned u = v.u;
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
