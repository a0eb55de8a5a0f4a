/* GPU layer of the per-head RMSNorm + rotary embedding (norm_rope_body.h): CUDA (NVPTX) and HIP (AMDGCN) from one file.
 *
 * Entry point, IREE's ABI for hand-authored GPU kernels (bindings in order, then the push constants):
 *
 *   dflash_norm_rope(x[rows*H*D], weight[D], cos[rows*D], sin[rows*D], out[rows*H*D], H, D, dtype, bits of eps)
 *       grid (rows * H, 1, 1); NR_T threads; dtype 0 f32, 1 bf16, 2 f16 (every tensor has it).
 */
#include "gpu.h"
#include "norm_rope_body.h"

extern "C" __global__ void KG_LAUNCH(NR_T)
dflash_norm_rope(const void* __restrict__ x, const void* __restrict__ w, const void* __restrict__ cs,
                 const void* __restrict__ sn, void* __restrict__ out, int H, int D, int dtype, int eps_bits) {
  union { int i; float f; } e;
  e.i = eps_bits;
  nr_workgroup(x, w, cs, sn, out, H, D, dtype, e.f, KG_WG_X(), KG_TID());
}
