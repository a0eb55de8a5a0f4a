/* GPU layer of the draft top-K kernel: CUDA (NVPTX) and HIP (AMDGCN) from one file.
 *
 * Built by clang without any vendor header or device library (-nocudainc -nocudalib, or
 * -nogpuinc -nogpulib): the body needs no libm, and the few GPU primitives come from clang
 * builtins (gpu.h). The entry points follow IREE's ABI for hand-authored GPU kernels: the bindings
 * in order, then the 32-bit push constants in order; one workgroup of DK_T threads.
 *
 *   dflash_topk_partial(logits f32[n*V], partial i32[n*C*(2K+2)], V, K, C, chunk_len, inv_t bits)
 *       grid (C, n, 1)
 *   dflash_topk_merge(partial, ids i32[n*K], logprobs f32[n*K], K, C, inv_t bits)
 *       grid (n, 1, 1)
 */
#include "../gpu.h"
#define DK_TID() KG_TID()
#define DK_WG_X() KG_WG_X()
#define DK_WG_Y() KG_WG_Y()
#define DK_BARRIER() KG_BARRIER()

/* 256 threads x 8 elements: 8 KiB of logits per round, loads coalesced across threads. */
#define DK_T 256
#define DK_U 8
#define DK_FN static __device__ inline
#define DK_SHARED __shared__
#define DK_THREADS(tid) for (int tid = DK_TID(), dk_once_ = 1; dk_once_; dk_once_ = 0)
#define DK_NPRIV 1
#define DK_PIDX(tid) 0
#define DK_ATOMIC_INC(p) __scoped_atomic_fetch_add((p), 1, __ATOMIC_RELAXED, __MEMORY_SCOPE_WRKGRP)

#include "topk_body.h"

extern "C" __global__ void __attribute__((launch_bounds(DK_T)))
dflash_topk_partial(const float* __restrict__ logits, int* __restrict__ partial, int V, int K, int C,
                    int chunk_len, int inv_t_bits) {
  dk_partial_workgroup(logits, partial, V, K, C, chunk_len, dk_from_bits(inv_t_bits), DK_WG_X(), DK_WG_Y());
}

extern "C" __global__ void __attribute__((launch_bounds(DK_T)))
dflash_topk_merge(const int* __restrict__ partial, int* __restrict__ ids, float* __restrict__ logprobs, int K,
                  int C, int inv_t_bits) {
  dk_merge_workgroup(partial, ids, logprobs, K, C, dk_from_bits(inv_t_bits), DK_WG_X());
}
