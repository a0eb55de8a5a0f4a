/* GPU layer of the skinny GEMM: CUDA (NVPTX, mma.sync) and HIP (AMDGCN gfx11/gfx12, WMMA) from one file.
 *
 * Built by clang without any vendor header or device library (the primitives of gpu.h). Entry points follow
 * IREE's ABI for hand-authored GPU kernels (bindings in order, then the 32-bit push constants):
 *
 *   dflash_gemm_mt{1,2,3,4}(x bf16[M*K], w bf16[N*K], cnt i32[N / GM_BN], y bf16[M*N], part f32[S*M*N],
 *                           M, K, KR, S, GX, N)                               grid (GX, S, 1)
 *       GX <= N / GM_BN workgroups take the column blocks in turn (gemm_body.h gm_group; only where
 *       GM_BLOCK_LOOP is 1, CUDA: the gfx objects need GX = the block count);
 *       rows are padded to 16*MT; with S == 1, cnt and part are not touched (any pointer will do);
 *       with S > 1, cnt must be zero on entry (it is left zero) and part is scratch
 *   dflash_gemm{2,3}_mt{1,2,3,4}(x, w0, w1[, w2], cnt, y0, y1[, y2], part, M, K, KR, S, GX, N0, N1[, N2])
 *       the same for 2 or 3 weights of one x: their column blocks (sum_g N_g / GM_BN) in one grid
 *       (GX, S, 1); cnt and part hold the weights' counters and partials one after the other
 *   dflash_gemm_res_mt{1,2,3,4}(x, w0, r bf16[M*N], cnt, y0, part, M, K, KR, S, GX, N)
 *       y0 = bf16(r + bf16(x . w0^T)): the residual add after a projection (gemm_body.h, epilogues)
 *   dflash_swiglu_mt{1,2,3,4}(x, w_gate, w_up, cnt i32[N / (GM_BN / 2)], y bf16[M*N], part f32[2*S*M*N],
 *                             M, K, KR, S, GX, N)
 *       y = bf16(bf16(silu(bf16(x . w_gate^T))) * bf16(x . w_up^T)), both weights [N, K]; a column block
 *       is GM_BN / 2 columns of each
 *   dflash_gemm_reduce(part f32[S*M*N], y bf16[M*N], M*N, S)                  grid (ceil(M*N/1024), 1, 1)
 * One workgroup is GM_WARPS * 32 threads (128 on both).
 */
#include "../gpu.h"
#define GM_SHARED KG_SHARED
#define GM_FN KG_FN
#define GM_TID() KG_TID()
#define GM_WG_X() KG_WG_X()
#define GM_WG_Y() KG_WG_Y()
#define GM_BARRIER() KG_BARRIER()
#define GM_FENCE() KG_FENCE()

#if defined(__NVPTX__)
/* ---- NVIDIA: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (sm_80 PTX) ----
 * Lane = 4*g + t. A chunk is 32 k-values of an 8-column tile: lane (g, t) loads the 16 bytes
 * W[col + g, k + 8t .. k + 8t + 7] (the 4 lanes of a column read 64 contiguous bytes) and x rows
 * g and g + 8 of the m-tile at the same k. The two mma instructions of a chunk take, in this order,
 * k + 8t + {0..3} then k + 8t + {4..7} into the k slots {2t, 2t+1, 2t+8, 2t+9} of every lane t:
 * a fixed permutation of the chunk's 32 k-values, the same for A and B (a 4-bit super-chunk's chunk:
 * gm_mma_q's order, below). */
/* 4 warps of one 8-column tile each, 16 chunks (8 KiB of W per warp) in flight per round, up to 4
 * workgroups per SM (<= 128 registers): the best of the variants measured on the H200 (docs/architecture.md;
 * 16 chunks over 8: the decode step's weights at M = 1 0.59-0.91 -> 0.61-0.94 of copy bandwidth, the 8B
 * decode step 0.951x and verify 0.964x the time, experiments/2026-12-03-gemm-m1-variants/). */
#ifndef GM_WARPS
#define GM_WARPS 4
#endif
#ifndef GM_CW
#define GM_CW 1
#endif
#ifndef GM_U
#define GM_U 16
#endif
#ifndef GM_MINB
#define GM_MINB 4
#endif
/* 4-bit: fetches (super-chunks of 4 chunks, 16 bytes a lane) a round. */
#ifndef GM_UQ
#define GM_UQ(MT) 4
#endif
#define GM_BLOCK_LOOP 1 /* the plan may give a workgroup several column blocks (kernels/gemm.py) */
#define GM_TN 8
#define GM_KC 32
#define GM_ACC_N 4
typedef unsigned gm_u4 __attribute__((ext_vector_type(4)));
typedef struct { float d[4]; } gm_acc;
typedef struct { gm_u4 v; } gm_wfrag;
typedef struct { gm_u4 lo, hi; } gm_xfrag; /* rows g and g + 8 */

/* 16 bytes at p when ok, else zeros. Predicated inside the asm, so that a round's loads are
 * straight-line code rather than branches. W is streamed once (no L1 allocation); x is reread by
 * every warp of the SM (through L1). */
#define GM_LD4(NAME, INSN)                                                                                 \
  GM_FN gm_u4 NAME(const unsigned short* p, int ok) {                                                    \
    unsigned a = 0, b = 0, c = 0, d = 0;                                                                 \
    asm("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p " INSN " {%0, %1, %2, %3}, [%4];\n}"           \
        : "+r"(a), "+r"(b), "+r"(c), "+r"(d) : "l"(p), "r"(ok));                                        \
    return (gm_u4){a, b, c, d};                                                                          \
  }
GM_LD4(gm_ld4_stream, "ld.global.nc.L1::no_allocate.v4.u32")
GM_LD4(gm_ld4, "ld.global.nc.v4.u32")

GM_FN void gm_load_w(gm_wfrag* f, const unsigned short* w, int col, int k, int K, int ok) {
  int lane = GM_TID() & 31;
  f->v = gm_ld4_stream(w + (long)(col + (lane >> 2)) * K + k + 8 * (lane & 3), ok);
}
#define GM_WLANE_V 8
GM_FN void gm_wfrag_set(gm_wfrag* f, const unsigned (&pairs)[4]) { f->v = (gm_u4){pairs[0], pairs[1], pairs[2], pairs[3]}; }

GM_FN void gm_load_x(gm_xfrag* f, const unsigned short* x, int row0, int k, int M, int K) {
  int lane = GM_TID() & 31;
  int r = row0 + (lane >> 2);
  const unsigned short* p = x + (long)r * K + k + 8 * (lane & 3);
  f->lo = gm_ld4(p, r < M);
  f->hi = gm_ld4(p + 8L * K, r + 8 < M);
}
/* Decode's one row from the norm prologue's shared copy (gemm_body.h gm_normed_x): gm_load_x's fragment
 * at M = 1. */
GM_FN void gm_load_xs(gm_xfrag* f, const unsigned short* xs, int k) {
  int lane = GM_TID() & 31;
  f->lo = (lane >> 2) == 0 ? *(const gm_u4*)(xs + k + 8 * (lane & 3)) : (gm_u4){0u, 0u, 0u, 0u};
  f->hi = (gm_u4){0u, 0u, 0u, 0u};
}
/* The same rows at this lane's own k-values from kl (a 4-bit super-chunk's chunk, gemm_body.h
 * gm_consume_round). Rows past M read row M - 1 instead of zeros: a matrix instruction's output row
 * depends on its own A row only, and rows >= M are never written, so their values do not matter and the
 * loads need no predicate and no zeroed registers. XLO: rows row0 + 8.. are not loaded at all. */
GM_FN gm_u4 gm_ld4_any(const unsigned short* p) {
  unsigned a, b, c, d;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
  return (gm_u4){a, b, c, d};
}
template <bool XLO>
GM_FN void gm_load_x_at(gm_xfrag* f, const unsigned short* x, int row0, int kl, int M, int K) {
  int lane = GM_TID() & 31;
  int r = row0 + (lane >> 2);
  f->lo = gm_ld4_any(x + (long)(r < M ? r : M - 1) * K + kl);
  if (!XLO) f->hi = gm_ld4_any(x + (long)(r + 8 < M ? r + 8 : M - 1) * K + kl);
}

GM_FN void gm_mma(gm_acc* acc, const gm_xfrag* xf, const gm_wfrag* wf) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(acc->d[0]), "+f"(acc->d[1]), "+f"(acc->d[2]), "+f"(acc->d[3])
      : "r"(xf->lo.x), "r"(xf->hi.x), "r"(xf->lo.y), "r"(xf->hi.y), "r"(wf->v.x), "r"(wf->v.y));
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(acc->d[0]), "+f"(acc->d[1]), "+f"(acc->d[2]), "+f"(acc->d[3])
      : "r"(xf->lo.z), "r"(xf->hi.z), "r"(xf->lo.w), "r"(xf->hi.w), "r"(wf->v.z), "r"(wf->v.w));
}

/* A 4-bit super-chunk's chunk (gemm_body.h gm_consume_round, F > 1): the first instruction takes the
 * lane's k-values {0, 1, 4, 5} (x words lo.x, lo.z; W pairs 0, 2), the second {2, 3, 6, 7}, so that with
 * XLO (rows 8..15 unused) the first instruction's A operand is x's 16-byte load as it came (lo.y, lo.w
 * sit in the unused rows' slots) and the second needs two register moves where gm_mma's order needs
 * eight (kernels/gemm/reference.py q4_k_order, pair_order 1). */
template <bool XLO>
GM_FN void gm_mma_q(gm_acc* acc, const gm_xfrag* xf, const gm_wfrag* wf) {
  const unsigned a1 = XLO ? xf->lo.y : xf->hi.x, a3 = XLO ? xf->lo.w : xf->hi.z; /* XLO: values at hand */
  const unsigned b1 = XLO ? xf->lo.y : xf->hi.y, b3 = XLO ? xf->lo.w : xf->hi.w;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(acc->d[0]), "+f"(acc->d[1]), "+f"(acc->d[2]), "+f"(acc->d[3])
      : "r"(xf->lo.x), "r"(a1), "r"(xf->lo.z), "r"(a3), "r"(wf->v.x), "r"(wf->v.z));
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(acc->d[0]), "+f"(acc->d[1]), "+f"(acc->d[2]), "+f"(acc->d[3])
      : "r"(xf->lo.y), "r"(b1), "r"(xf->lo.w), "r"(b3), "r"(wf->v.y), "r"(wf->v.w));
}

GM_FN void gm_acc_zero(gm_acc* a) { a->d[0] = a->d[1] = a->d[2] = a->d[3] = 0.0f; }

/* D fragment: d0, d1 at (g, 2t), (g, 2t+1); d2, d3 at (g+8, 2t), (g+8, 2t+1). */
GM_FN float gm_acc_get(const gm_acc* a, int i, int* row, int* col) {
  int lane = GM_TID() & 31;
  *row = (lane >> 2) + (i >> 1) * 8;
  *col = 2 * (lane & 3) + (i & 1);
  return a->d[i];
}
#define GM_WLANE_N(lane) ((lane) >> 2)
#define GM_WLANE_K(lane) (8 * ((lane) & 3))
/* 4-bit W: lane (g, t) holds the 8 k-values of one word, W[col + g, k + 8t .. + 7], of a chunk; a fetch
 * of a super-chunk (GM_QSC = 4 chunks, 128 k-values) loads the lane's 4 consecutive words, k + 32t ..
 * + 31, in one 16-byte load (the 4 lanes of a column read 64 contiguous bytes), chunk h taking word h:
 * 4x fewer, 4x wider loads of W and 4x fewer scale and offset loads than a fetch a chunk. */
#ifndef GM_QSC
#define GM_QSC 4
#endif
#define GM_QLANE_K(lane) (32 * ((lane) & 3))
template <int W>
GM_FN void gm_load_q(unsigned (&words)[W], const unsigned* p, int ok) {
  if (W == 1) {
    unsigned a = 0;
    asm("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.L1::no_allocate.u32 %0, [%1];\n}"
        : "+r"(a) : "l"(p), "r"(ok));
    words[0] = a;
  } else {
    static_assert(W == 1 || W == 4, "a lane loads 1 or 4 words");
    const gm_u4 v = gm_ld4_stream((const unsigned short*)p, ok);
    words[0] = v.x, words[W > 1 ? 1 : 0] = v.y, words[W > 2 ? 2 : 0] = v.z, words[W > 3 ? 3 : 0] = v.w;
  }
}
GM_FN unsigned gm_pack_bf16x2(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
/* *p when ok, else 0 (u16) or `otherwise` (u32): a predicated load, no branch (gemm_body.h GM_QSTRAIGHT). */
GM_FN unsigned short gm_ld_u16_if(const unsigned short* p, int ok) {
  unsigned short a = 0;
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.u16 %0, [%1];\n}" : "+h"(a) : "l"(p), "r"(ok));
  return a;
}
GM_FN unsigned gm_ld_u32_if(const unsigned* p, int ok, unsigned otherwise) {
  unsigned a = otherwise;
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p ld.global.nc.u32 %0, [%1];\n}" : "+r"(a) : "l"(p), "r"(ok));
  return a;
}
/* The 4-bit entry points' fetches without branches, the next round's in flight while this one is
 * consumed (one m-tile), and x's rows 8..15 not loaded at M <= 8: gemm_body.h; measured in
 * experiments/2026-12-07-q4-pipeline/. */
#define GM_QSTRAIGHT 1
#define GM_QPIPE 1
#define GM_QXLO 1
/* 4-bit values dequantized two at a time in bf16x2 arithmetic (gemm_body.h GM_QPAIRS): a prmt and a
 * lop3 a pair, two fmas. */
#ifndef GM_QPAIRS
#define GM_QPAIRS 1
#endif
GM_FN unsigned gm_fma_bf16x2(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
/* The 4 bf16 pairs (values 2i, 2i+1) of a packed word: byte i of the word (value 2i in its low
 * nibble) and of the word >> 4 (value 2i + 1) into the low halves of two bf16s of exponent 0x43, whose
 * value is 128 + q; then q - z = (128 + q) - (128 + z) and s * (q - z) + b, bf16x2 fmas, each exact
 * but the last, which rounds once (to nearest even). */
GM_FN void gm_q4_pairs(unsigned* pairs, unsigned word, unsigned s2, unsigned o2, unsigned c2) {
  const unsigned hi = word >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    unsigned t;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(word), "r"(hi), "r"(i | (4 + i) << 8));
    asm("lop3.b32 %0, %0, 0x000F000F, 0x43004300, 0xEA;" : "+r"(t)); /* (t & 0x000F000F) | 0x43004300 */
    pairs[i] = gm_fma_bf16x2(s2, gm_fma_bf16x2(t, 0x3F803F80u, c2), o2);
  }
}
/* m-tiles 1-2 keep GM_MINB workgroups per SM; 3-4 take up to 255 registers. */
#define GM_LAUNCH(MT) __attribute__((launch_bounds(GM_WARPS * 32, (MT) <= 2 ? GM_MINB : 1)))

#elif defined(__AMDGCN__)
/* ---- AMD RDNA3/4 WMMA 16x16x16 bf16 -> f32, wave32 ----
 * A chunk is 16 k-values of a 16-column tile. gfx11: lane l holds column (W) or row (x) l % 16 and all
 * 16 k-values of the chunk in order (lanes 16..31 repeat lanes 0..15, as gfx11 requires: the same
 * addresses, one memory request); D element i of lane l is (row 2i + l/16, column l % 16).
 * gfx12: lane l holds k-values 8*(l/16) .. +7 of row/column l % 16; D element i is
 * (row 8*(l/16) + i, column l % 16). */
#ifndef GM_WARPS
#define GM_WARPS 4
#endif
#ifndef GM_CW
#define GM_CW 2
#endif
#ifndef GM_U
#define GM_U 4
#endif
/* 4-bit: gfx11's 3- and 4-m-tile entry points spill at 4 chunks a round (each lane expands all 16
 * k-values of a chunk), so they take 2. */
#ifndef GM_UQ
#if defined(__gfx1200__) || defined(__gfx1201__)
#define GM_UQ(MT) GM_U
#else
#define GM_UQ(MT) ((MT) <= 2 ? GM_U : 2)
#endif
#endif
/* One column block per workgroup: the loop's hoisted addresses would spill the 3- and 4-m-tile
 * entry points here, and the plan never needs it (kernels/gemm.py). */
#define GM_BLOCK_LOOP 0
#define GM_TN 16
#define GM_KC 16
#define GM_ACC_N 8
typedef float gm_v8f __attribute__((ext_vector_type(8)));
typedef struct { gm_v8f d; } gm_acc;
#if defined(__gfx1200__) || defined(__gfx1201__)
#define GM_GFX12 1
typedef short gm_frag_t __attribute__((ext_vector_type(8)));
#define GM_KOFF(lane) (8 * ((lane) >> 4))
#define GM_WMMA __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12
#else
typedef short gm_frag_t __attribute__((ext_vector_type(16)));
#define GM_KOFF(lane) 0
#define GM_WMMA __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32
#endif
typedef struct { gm_frag_t v; } gm_wfrag;
typedef struct { gm_frag_t v; } gm_xfrag;

GM_FN void gm_load_w(gm_wfrag* f, const unsigned short* w, int col, int k, int K, int ok) {
  int lane = GM_TID() & 31;
  const unsigned short* p = w + (long)(col + (lane & 15)) * K + k + GM_KOFF(lane);
  f->v = ok ? __builtin_nontemporal_load((const gm_frag_t*)p) : (gm_frag_t){};
}

/* 4-bit W: lane l holds the fragment's k-values of column l % 16 (gfx11 all 16: two words; gfx12 8: one). */
#define GM_WLANE_N(lane) ((lane) & 15)
#define GM_WLANE_K(lane) GM_KOFF(lane)
#ifdef GM_GFX12
#define GM_WLANE_V 8
#else
#define GM_WLANE_V 16
#endif
/* One chunk a fetch (GM_QSC 1): gfx11's 3- and 4-m-tile entry points already take 2 chunks a round to
 * fit their registers. */
#ifndef GM_QSC
#define GM_QSC 1
#endif
#define GM_QLANE_K(lane) GM_WLANE_K(lane)
template <int W>
GM_FN void gm_load_q(unsigned (&words)[W], const unsigned* p, int ok) {
  typedef unsigned qv __attribute__((ext_vector_type(W)));
  qv v = ok ? __builtin_nontemporal_load((const qv*)p) : (qv){};
  __builtin_memcpy(words, &v, sizeof v);
}
GM_FN void gm_wfrag_set(gm_wfrag* f, const unsigned (&pairs)[GM_WLANE_V / 2]) { __builtin_memcpy(&f->v, pairs, sizeof f->v); }
GM_FN unsigned gm_pack_bf16x2(float lo, float hi) { return kg_bf16(lo) | (unsigned)kg_bf16(hi) << 16; }

GM_FN void gm_load_x(gm_xfrag* f, const unsigned short* x, int row0, int k, int M, int K) {
  int lane = GM_TID() & 31;
  int r = row0 + (lane & 15);
  f->v = r < M ? *(const gm_frag_t*)(x + (long)r * K + k + GM_KOFF(lane)) : (gm_frag_t){};
}
GM_FN void gm_load_xs(gm_xfrag* f, const unsigned short* xs, int k) {
  int lane = GM_TID() & 31;
  f->v = (lane & 15) == 0 ? *(const gm_frag_t*)(xs + k + GM_KOFF(lane)) : (gm_frag_t){};
}
template <bool XLO>
GM_FN void gm_load_x_at(gm_xfrag* f, const unsigned short* x, int row0, int kl, int M, int K) {
  int lane = GM_TID() & 31;
  int r = row0 + (lane & 15);
  f->v = r < M ? *(const gm_frag_t*)(x + (long)r * K + kl) : (gm_frag_t){};
}

GM_FN void gm_mma(gm_acc* acc, const gm_xfrag* xf, const gm_wfrag* wf) { acc->d = GM_WMMA(xf->v, wf->v, acc->d); }
template <bool XLO>
GM_FN void gm_mma_q(gm_acc* acc, const gm_xfrag* xf, const gm_wfrag* wf) { gm_mma(acc, xf, wf); }

GM_FN void gm_acc_zero(gm_acc* a) { a->d = (gm_v8f){}; }

GM_FN float gm_acc_get(const gm_acc* a, int i, int* row, int* col) {
  int lane = GM_TID() & 31;
#ifdef GM_GFX12
  *row = 8 * (lane >> 4) + i;
#else
  *row = 2 * i + (lane >> 4);
#endif
  *col = lane & 15;
  return a->d[i];
}
#define GM_LAUNCH(MT) __attribute__((amdgpu_flat_work_group_size(1, GM_WARPS * 32)))

#else
#error "gemm_gpu.cu is built for NVPTX or AMDGCN only"
#endif

#include "gemm_body.h"

/* One entry point per weight count G and m-tile count MT: dflash_gemm_mt{MT} (G = 1),
 * dflash_gemm2_mt{MT}, dflash_gemm3_mt{MT}; and the same for packed 4-bit weights, dflash_q4gemm*. */
typedef unsigned short GM_U16;
#define GM_W16(i) gm_w16{w##i}
#define GM_ENTRY1(MT)                                                                                         \
  extern "C" __global__ void GM_LAUNCH(MT) dflash_gemm_mt##MT(const GM_U16* __restrict__ x, const GM_U16* w0, \
                                                               int* cnt, GM_U16* y0, float* part, int M, int K, \
                                                               int KR, int S, int GX, int N0) {                         \
    gm_group<MT, 1>(x, GM_W16(0), GM_W16(0), GM_W16(0), cnt, y0, y0, y0, part, M, K, KR, S, GX, N0, 0, 0, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
#define GM_ENTRY2(MT)                                                                                          \
  extern "C" __global__ void GM_LAUNCH(MT)                                                                    \
      dflash_gemm2_mt##MT(const GM_U16* __restrict__ x, const GM_U16* w0, const GM_U16* w1, int* cnt, GM_U16* y0, \
                          GM_U16* y1, float* part, int M, int K, int KR, int S, int GX, int N0, int N1) {               \
    gm_group<MT, 2>(x, GM_W16(0), GM_W16(1), GM_W16(1), cnt, y0, y1, y1, part, M, K, KR, S, GX, N0, N1, 0, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
#define GM_ENTRY3(MT)                                                                                           \
  extern "C" __global__ void GM_LAUNCH(MT)                                                                     \
      dflash_gemm3_mt##MT(const GM_U16* __restrict__ x, const GM_U16* w0, const GM_U16* w1, const GM_U16* w2,    \
                          int* cnt, GM_U16* y0, GM_U16* y1, GM_U16* y2, float* part, int M, int K, int KR, int S, \
                          int GX, int N0, int N1, int N2) {                                                              \
    gm_group<MT, 3>(x, GM_W16(0), GM_W16(1), GM_W16(2), cnt, y0, y1, y2, part, M, K, KR, S, GX, N0, N1, N2, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
#define GM_ENTRY_RES(MT)                                                                                       \
  extern "C" __global__ void GM_LAUNCH(MT)                                                                    \
      dflash_gemm_res_mt##MT(const GM_U16* __restrict__ x, const GM_U16* w0, const GM_U16* r, int* cnt, GM_U16* y0, \
                             float* part, int M, int K, int KR, int S, int GX, int N0) {                             \
    gm_single<MT, GM_EPI_RESIDUAL>(x, GM_W16(0), GM_W16(0), r, cnt, y0, part, M, K, KR, S, GX, N0, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
#define GM_ENTRY_SWIGLU(MT)                                                                                    \
  extern "C" __global__ void GM_LAUNCH(MT)                                                                    \
      dflash_swiglu_mt##MT(const GM_U16* __restrict__ x, const GM_U16* w0, const GM_U16* w1, int* cnt, GM_U16* y, \
                           float* part, int M, int K, int KR, int S, int GX, int N) {                                \
    gm_single<MT, GM_EPI_SWIGLU>(x, GM_W16(0), GM_W16(1), r_unused(), cnt, y, part, M, K, KR, S, GX, N, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
/* 4-bit: each weight is three bindings (q, s, o: gemm_body.h gm_w4); fmt and group come last. */
#define GM_W4(i) gm_w4{q##i, s##i, o##i, fmt, group, 31 - __builtin_clz(group)}
#define GM_Q4ARGS(i) const unsigned* q##i, const GM_U16* s##i, const void* o##i
#define GM_Q4ENTRY1(MT)                                                                                       \
  extern "C" __global__ void GM_LAUNCH(MT) dflash_q4gemm_mt##MT(const GM_U16* __restrict__ x, GM_Q4ARGS(0),     \
      int* cnt, GM_U16* y0, float* part, int M, int K, int KR, int S, int GX, int N0, int fmt, int group) {      \
    gm_group<MT, 1>(x, GM_W4(0), GM_W4(0), GM_W4(0), cnt, y0, y0, y0, part, M, K, KR, S, GX, N0, 0, 0, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
#define GM_Q4ENTRY2(MT)                                                                                       \
  extern "C" __global__ void GM_LAUNCH(MT) dflash_q4gemm2_mt##MT(const GM_U16* __restrict__ x, GM_Q4ARGS(0),    \
      GM_Q4ARGS(1), int* cnt, GM_U16* y0, GM_U16* y1, float* part, int M, int K, int KR, int S, int GX, int N0,   \
      int N1, int fmt, int group) {                                                                              \
    gm_group<MT, 2>(x, GM_W4(0), GM_W4(1), GM_W4(1), cnt, y0, y1, y1, part, M, K, KR, S, GX, N0, N1, 0, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
#define GM_Q4ENTRY3(MT)                                                                                       \
  extern "C" __global__ void GM_LAUNCH(MT) dflash_q4gemm3_mt##MT(const GM_U16* __restrict__ x, GM_Q4ARGS(0),    \
      GM_Q4ARGS(1), GM_Q4ARGS(2), int* cnt, GM_U16* y0, GM_U16* y1, GM_U16* y2, float* part, int M, int K, int KR, \
      int S, int GX, int N0, int N1, int N2, int fmt, int group) {                                               \
    gm_group<MT, 3>(x, GM_W4(0), GM_W4(1), GM_W4(2), cnt, y0, y1, y2, part, M, K, KR, S, GX, N0, N1, N2, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
#define GM_Q4ENTRY_RES(MT)                                                                                    \
  extern "C" __global__ void GM_LAUNCH(MT) dflash_q4gemm_res_mt##MT(const GM_U16* __restrict__ x, GM_Q4ARGS(0), \
      const GM_U16* r, int* cnt, GM_U16* y0, float* part, int M, int K, int KR, int S, int GX, int N0, int fmt,   \
      int group) {                                                                                               \
    gm_single<MT, GM_EPI_RESIDUAL>(x, GM_W4(0), GM_W4(0), r, cnt, y0, part, M, K, KR, S, GX, N0, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
#define GM_Q4ENTRY_SWIGLU(MT)                                                                                 \
  extern "C" __global__ void GM_LAUNCH(MT) dflash_q4swiglu_mt##MT(const GM_U16* __restrict__ x, GM_Q4ARGS(0),   \
      GM_Q4ARGS(1), int* cnt, GM_U16* y, float* part, int M, int K, int KR, int S, int GX, int N, int fmt,       \
      int group) {                                                                                               \
    gm_single<MT, GM_EPI_SWIGLU>(x, GM_W4(0), GM_W4(1), r_unused(), cnt, y, part, M, K, KR, S, GX, N, GM_WG_X(), GM_WG_Y(), GM_TID()); \
  }
GM_FN const GM_U16* r_unused() { return 0; }
/* Decode's one row with the RMSNorm before the GEMM in its prologue (gemm_body.h gm_normed_x): q, k and v
 * of a layer, and gate + up with swiglu; g the norm's bf16 weight [K], eps its bits. */
GM_FN float gm_eps(int bits) {
  union { int i; float f; } u;
  u.i = bits;
  return u.f;
}
#define GM_ENTRY3_NORM                                                                                        \
  extern "C" __global__ void GM_LAUNCH(1)                                                                     \
      dflash_gemm3_norm_mt1(const GM_U16* __restrict__ x, const GM_U16* g, const GM_U16* w0, const GM_U16* w1,     \
                            const GM_U16* w2, int* cnt, GM_U16* y0, GM_U16* y1, GM_U16* y2, float* part, int M, int K, \
                            int KR, int S, int GX, int N0, int N1, int N2, int eps) {                               \
    gm_group<1, 3, gm_w16, true>(x, GM_W16(0), GM_W16(1), GM_W16(2), cnt, y0, y1, y2, part, M, K, KR, S, GX, N0, N1, N2, \
                                 GM_WG_X(), GM_WG_Y(), GM_TID(), g, gm_eps(eps));                          \
  }
#define GM_ENTRY_SWIGLU_NORM                                                                                 \
  extern "C" __global__ void GM_LAUNCH(1)                                                                    \
      dflash_swiglu_norm_mt1(const GM_U16* __restrict__ x, const GM_U16* g, const GM_U16* w0, const GM_U16* w1,   \
                             int* cnt, GM_U16* y, float* part, int M, int K, int KR, int S, int GX, int N, int eps) { \
    gm_single<1, GM_EPI_SWIGLU, gm_w16, true>(x, GM_W16(0), GM_W16(1), r_unused(), cnt, y, part, M, K, KR, S, GX, N, \
                                              GM_WG_X(), GM_WG_Y(), GM_TID(), g, gm_eps(eps));             \
  }
/* Two objects from this file (kernels/build.py): gemm_{arch} with the bf16 entry points (GM_BITS 16) and
 * gemm_q4_{arch} with the 4-bit ones (GM_BITS 4), so that a bf16 module embeds no 4-bit code. */
#ifndef GM_BITS
#define GM_BITS 16
#endif
#if GM_BITS == 4
#define GM_ENTRIES(MT) GM_Q4ENTRY1(MT) GM_Q4ENTRY2(MT) GM_Q4ENTRY3(MT) GM_Q4ENTRY_RES(MT) GM_Q4ENTRY_SWIGLU(MT)
#else
#define GM_ENTRIES(MT) GM_ENTRY1(MT) GM_ENTRY2(MT) GM_ENTRY3(MT) GM_ENTRY_RES(MT) GM_ENTRY_SWIGLU(MT)
#endif
GM_ENTRIES(1)
#if GM_BITS != 4
GM_ENTRY3_NORM
GM_ENTRY_SWIGLU_NORM
/* The norm's own dispatch (the target's rows at M > 1: verify, prefill): grid (M), GM_NT threads. */
extern "C" __global__ void __attribute__((launch_bounds(GM_NT))) dflash_rms_norm(const GM_U16* __restrict__ x,
                                                                                const GM_U16* __restrict__ g,
                                                                                GM_U16* __restrict__ y, int K, int eps) {
  gm_rms_norm_workgroup(x, g, y, K, gm_eps(eps), GM_WG_X(), GM_TID());
}
#endif
GM_ENTRIES(2)
GM_ENTRIES(3)
GM_ENTRIES(4)

extern "C" __global__ void __attribute__((launch_bounds(GM_RT))) dflash_gemm_reduce(const float* __restrict__ part,
                                                                                    unsigned short* __restrict__ y,
                                                                                    int MN, int S) {
  gm_reduce_workgroup(part, y, MN, S, GM_WG_X(), GM_TID());
}
