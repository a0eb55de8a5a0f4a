/* CPU layer of the draft top-K kernel: IREE embedded-ELF workgroup functions.
 *
 * IREE runs a CPU dispatch as one call per workgroup on one worker thread, so a workgroup's
 * DK_T "threads" are virtual: each phase of the body runs as a loop over them, and the phases
 * run one after another (the barriers are no-ops). Each virtual thread takes DK_U consecutive
 * elements, which the compiler turns into SIMD loads and a vectorized exp.
 *
 * Built freestanding (no libc, no TLS, no globals): the object is linked into IREE's executable.
 * IREE's shim (see topk.py) passes the buffers as raw addresses, then the push constants, then
 * the workgroup ids.
 */
#include <stddef.h>
#include <stdint.h>

#define DK_T 64
#define DK_U 16
#define DK_FN static inline
#define DK_SHARED
#define DK_THREADS(tid) for (int tid = 0; tid < DK_T; ++tid)
#define DK_NPRIV DK_T
#define DK_PIDX(tid) (tid)
#define DK_BARRIER() ((void)0)
#define DK_ATOMIC_INC(p) ((*(p))++)

#include "topk_body.h"

void dflash_topk_partial_cpu(uintptr_t logits, uintptr_t partial, int32_t V, int32_t K, int32_t C,
                             int32_t chunk_len, int32_t inv_t_bits, int32_t wg_x, int32_t wg_y) {
  dk_partial_workgroup((const float*)logits, (int*)partial, V, K, C, chunk_len, dk_from_bits(inv_t_bits), wg_x,
                       wg_y);
}

void dflash_topk_merge_cpu(uintptr_t partial, uintptr_t ids, uintptr_t logprobs, int32_t K, int32_t C,
                           int32_t inv_t_bits, int32_t wg_x) {
  dk_merge_workgroup((const int*)partial, (int*)ids, (float*)logprobs, K, C, dk_from_bits(inv_t_bits), wg_x);
}
