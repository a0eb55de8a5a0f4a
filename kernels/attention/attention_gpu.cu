/* GPU layer of the block attention (attention_body.h): CUDA (NVPTX) and HIP (AMDGCN) from one file.
 *
 * Entry point, IREE's ABI for hand-authored GPU kernels (bindings in order, then the push constants):
 *
 *   dflash_attention(q bf16[S*Hkv*R*D], cache bf16[S*L*2*C*Hkv*D], mask i8[S*R*N], cnt i32[S*Hkv*RG],
 *                    out bf16[S*Hkv*R*D], part f32[S*Hkv*RG*chunks*16*(D+2)],
 *                    R, N, D, Hkv, layer, L, C, chunks, bits of scale * log2(e), G)
 *       G = 0: q and out head-major [S, Hkv, R, D]; G > 0: the model's token-major [S, R / G, Hkv, G, D]
 *       grid (chunks = ceil(N / 64), Hkv * RG, S) with RG = ceil(R / 16); 256 threads;
 *       cnt is zero on entry and left zero; part is scratch.
 *
 * Built with -DAT_GATE=1 (and -DAT_DMAX=256) the same file is the gated entry point
 * `dflash_attention_gated` (`dflash_attention_gated_d256`), with one binding more after the mask:
 *
 *   dflash_attention_gated(q, cache, mask, gate bf16 (out's layout), cnt, out, part, <the same constants>)
 *       out = bf16(bf16(attention) * bf16(sigmoid(gate))) (attention_body.h, "Output gate")
 */
#include "../gpu.h"
#include "attention_body.h"

#if !AT_GATE && AT_DMAX == 128
#define AT_ENTRY dflash_attention
#elif AT_GATE && AT_DMAX == 128
#define AT_ENTRY dflash_attention_gated
#elif AT_GATE && AT_DMAX == 256
#define AT_ENTRY dflash_attention_gated_d256
#else
#error "AT_DMAX: 128, or 256 with AT_GATE"
#endif

extern "C" __global__ void KG_LAUNCH(AT_T)
AT_ENTRY(const unsigned short* __restrict__ q, const unsigned short* __restrict__ cache,
                 const signed char* __restrict__ mask, AT_GATE_PARAM int* cnt, unsigned short* __restrict__ out,
                 float* __restrict__ part, int R, int N, int D, int Hkv, int layer, int L, int C, int chunks,
                 int scale_bits, int G) {
  union { int i; float f; } sc;
  sc.i = scale_bits;
  at_workgroup(q, cache, mask, AT_GATE_ARG cnt, out, part, R, N, D, Hkv, layer, L, C, chunks, sc.f, G, KG_WG_X(), KG_WG_Y(),
               KG_WG_Z(), KG_TID());
}
