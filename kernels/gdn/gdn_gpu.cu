/* GPU layer of the Gated DeltaNet step (gdn_body.h): CUDA (NVPTX) and HIP (AMDGCN) from one file.
 *
 * Entry point, IREE's ABI for hand-authored GPU kernels (bindings in order, then the push constants):
 *
 *   dflash_gdn(mixed dt[S*T*conv_dim], b dt[S*T*Hv], a dt[S*T*Hv], A_log dt[Hv], dt_bias dt[Hv],
 *              rows i32[S*2], slots f32[R*n_gdn*Hv*dk*dv] (read and written in place), o dt[S*T*Hv*dv],
 *              T, Hk, Hv, dk, dv, layer, n_gdn, dtype, bits of eps, bits of scale, every_row)
 *       grid (ceil(dv / 8), Hv, S); 128 threads; dtype 0 f32, 1 bf16; every_row 1 writes the state
 *       after each row (slot rows base + t), 0 the last row's only (slot row base).
 */
#include "../gpu.h"
#include "gdn_body.h"

extern "C" __global__ void KG_LAUNCH(GD_T)
dflash_gdn(const void* __restrict__ mixed, const void* __restrict__ b, const void* __restrict__ a,
           const void* __restrict__ alog, const void* __restrict__ dtb, const int* __restrict__ rows, float* slots,
           void* __restrict__ out, int T, int Hk, int Hv, int dk, int dv, int layer, int n_gdn, int dtype,
           int eps_bits, int scale_bits, int every_row) {
  gd_workgroup(mixed, b, a, alog, dtb, rows, slots, out, T, Hk, Hv, dk, dv, layer, n_gdn, dtype, gd_f((unsigned)eps_bits),
               gd_f((unsigned)scale_bits), every_row, KG_WG_X(), KG_WG_Y(), KG_WG_Z(), KG_TID());
}
