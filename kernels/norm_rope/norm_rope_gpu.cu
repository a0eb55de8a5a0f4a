/* GPU layer of the per-head RMSNorm + rotary embedding (norm_rope_body.h): CUDA (NVPTX) and HIP (AMDGCN) from one file.
 *
 * Entry point, IREE's ABI for hand-authored GPU kernels (bindings in order, then the push constants):
 *
 *   dflash_norm_rope(x[rows*H*D], weight[D], cos[rows*D], sin[rows*D], out[rows*H*D], H, D, dtype, bits of eps)
 *       grid (rows * H, 1, 1); NR_T threads; dtype 0 f32, 1 bf16, 2 f16 (every tensor has it).
 *
 *   dflash_norm_rope2(xq[rows*Hq*D], wq[D], xk[rows*Hk*D], wk[D], cos[rows*D], sin[rows*D],
 *                     outq[rows*Hq*D], outk[rows*Hk*D], rows * Hq, Hq, Hk, D, dtype, bits of eps)
 *       q and k of one layer (one position table) in one grid (rows * (Hq + Hk), 1, 1): the first
 *       rows * Hq workgroups take q's heads, the rest k's; each head as dflash_norm_rope computes it.
 *
 *   dflash_norm_rope2_kv(xq[rows*Hq*D], wq[D], xk[rows*Hk*D], wk[D], cos[rows*D], sin[rows*D], v[rows*Hk*D],
 *                        cache_rows[S*2T] (int64), cache[*, Hk*D], outq[rows*Hq*D], rows * Hq, Hq, Hk, D, T,
 *                        dtype, bits of eps)
 *       dflash_norm_rope2's q and k, k's result and v written into their rows of the KV cache in place
 *       (nr_workgroup_kv): grid (rows * (Hq + 2 Hk), 1, 1), rows = S * T.
 *
 *   dflash_norm_rope_v(x[rows*H*XS], weight[D], cos[rows*R], sin[rows*R], out[rows*H*D], H, D, R, XS, zc, dtype,
 *                      bits of eps)
 *   dflash_norm_rope2_v(xq[rows*Hq*XSq], wq[D], xk[rows*Hk*XSk], wk[D], cos[rows*R], sin[rows*R],
 *                       outq[rows*Hq*D], outk[rows*Hk*D], rows * Hq, Hq, Hk, D, R, XSq, XSk, zc, dtype, bits of eps)
 *       the variants (nr_workgroup_v): zc 1 for the zero-centred norm, the first R dims rotated, each
 *       head the first D of XS values (XS = 2 D: Qwen3.5's q inside q_proj's [query, gate] heads).
 */
#include "../gpu.h"
#include "norm_rope_body.h"

extern "C" __global__ void KG_LAUNCH(NR_T)
dflash_norm_rope(const void* __restrict__ x, const void* __restrict__ w, const void* __restrict__ cs,
                 const void* __restrict__ sn, void* __restrict__ out, int H, int D, int dtype, int eps_bits) {
  union { int i; float f; } e;
  e.i = eps_bits;
  nr_workgroup(x, w, cs, sn, out, H, D, dtype, e.f, KG_WG_X(), KG_TID());
}

extern "C" __global__ void KG_LAUNCH(NR_T)
dflash_norm_rope2(const void* __restrict__ xq, const void* __restrict__ wq, const void* __restrict__ xk,
                  const void* __restrict__ wk, const void* __restrict__ cs, const void* __restrict__ sn,
                  void* __restrict__ outq, void* __restrict__ outk, int q_groups, int Hq, int Hk, int D, int dtype,
                  int eps_bits) {
  union { int i; float f; } e;
  e.i = eps_bits;
  const int wg = KG_WG_X();
  if (wg < q_groups)
    nr_workgroup(xq, wq, cs, sn, outq, Hq, D, dtype, e.f, wg, KG_TID());
  else
    nr_workgroup(xk, wk, cs, sn, outk, Hk, D, dtype, e.f, wg - q_groups, KG_TID());
}

extern "C" __global__ void KG_LAUNCH(NR_T)
dflash_norm_rope2_kv(const void* __restrict__ xq, const void* __restrict__ wq, const void* __restrict__ xk,
                     const void* __restrict__ wk, const void* __restrict__ cs, const void* __restrict__ sn,
                     const void* __restrict__ v, const long long* __restrict__ rows, void* __restrict__ cache,
                     void* __restrict__ outq, int q_groups, int Hq, int Hk, int D, int T, int dtype, int eps_bits) {
  union { int i; float f; } e;
  e.i = eps_bits;
  nr_workgroup_kv(xq, wq, xk, wk, cs, sn, v, rows, cache, outq, q_groups, Hq, Hk, D, T, dtype, e.f, KG_WG_X(),
                  KG_TID());
}

/* The variants: entry points of their own, so that Qwen3's two keep their code, byte for byte. */
extern "C" __global__ void KG_LAUNCH(NR_T)
dflash_norm_rope_v(const void* __restrict__ x, const void* __restrict__ w, const void* __restrict__ cs,
                   const void* __restrict__ sn, void* __restrict__ out, int H, int D, int R, int XS, int zc, int dtype,
                   int eps_bits) {
  union { int i; float f; } e;
  e.i = eps_bits;
  nr_workgroup_v(x, w, cs, sn, out, H, D, R, XS, zc, dtype, e.f, KG_WG_X(), KG_TID());
}

extern "C" __global__ void KG_LAUNCH(NR_T)
dflash_norm_rope2_v(const void* __restrict__ xq, const void* __restrict__ wq, const void* __restrict__ xk,
                    const void* __restrict__ wk, const void* __restrict__ cs, const void* __restrict__ sn,
                    void* __restrict__ outq, void* __restrict__ outk, int q_groups, int Hq, int Hk, int D, int R,
                    int XSq, int XSk, int zc, int dtype, int eps_bits) {
  union { int i; float f; } e;
  e.i = eps_bits;
  const int wg = KG_WG_X();
  if (wg < q_groups)
    nr_workgroup_v(xq, wq, cs, sn, outq, Hq, D, R, XSq, zc, dtype, e.f, wg, KG_TID());
  else
    nr_workgroup_v(xk, wk, cs, sn, outk, Hk, D, R, XSk, zc, dtype, e.f, wg - q_groups, KG_TID());
}
