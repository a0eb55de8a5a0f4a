/* Skinny GEMM y[M, N] = x[M, K] . W[N, K]^T: the one kernel body for every GPU backend.
 *
 * x and W are bf16 (W is the checkpoint's weight, row-major [N, K], read in place), the products
 * are accumulated in f32 by the matrix units (NVIDIA mma.sync m16n8k16, AMD WMMA 16x16x16), and y is
 * bf16, rounded once (to nearest, ties to even) at the end. M is small (1..64): the rows are padded
 * with zeros to GM_MT m-tiles of 16, so a weight element costs 2*16*GM_MT flops, which the matrix
 * units do at far more than memory bandwidth; the kernel is a stream over W.
 *
 * Decomposition. A workgroup of GM_WARPS warps (waves) owns GM_BN = GM_WARPS * GM_CW * GM_TN
 * consecutive columns and one split, [s*KR, (s+1)*KR). Every warp walks the whole
 * split for its GM_CW column tiles of GM_TN columns; the warps of a workgroup read the same x
 * columns at the same time, so x comes from L1/L0 and only W streams from memory. With S = K/KR > 1
 * splits each workgroup writes its f32 partial sums, then counts itself in cnt[column block] (an
 * integer atomic); the workgroup that arrives last adds the S partials of its columns in the order
 * s = 0..S-1, whoever arrives last, rounds to bf16, writes y and resets the counter to 0 for the
 * next call (no float atomics, one dispatch). With S = 1 the kernel rounds and writes y itself.
 * (gm_reduce_workgroup is the same sum as a separate dispatch, for when no counter is at hand.)
 *
 * Numerics contract: y[m, :] depends only on x[m, :] and W. The k order of each output's sum is
 * fixed by (N, K, the split) alone: within a split the k range is consumed in "chunks" of GM_KC
 * k-values, in increasing order, each chunk by the backend's fixed sequence of matrix
 * instructions, accumulating into one f32 register per output; the split partials are then added
 * in split order. Nothing depends on M, on GM_MT, on GM_CW, on GM_U or on where a row sits in its
 * m-tile: a matrix instruction computes each output element from its own row of A and column of B.
 *
 * A split's chunks are loaded GM_U at a time (a round), then GM_U / 2 at a time, the rest one at a
 * time; every way they are consumed in increasing k order. A chunk's k-values are loaded by each lane as contiguous 16-byte vectors of W (coalesced: the
 * lanes of a column read one contiguous segment), and given to the matrix instruction under a fixed
 * permutation of k; the x fragments are loaded with the same permutation, so the sum is unchanged.
 *
 * Packed 4-bit weights (gm_w4, issue #28): the same kernel reads W as its checkpoint stores it, q int32
 * [N, K / 8] (eight 4-bit values a word along k, value j in bits 4j..4j+3) with one bf16 scale s per
 * group of `group` k-values of a row ([N, K / group]) and, by format, MLX's bf16 bias b
 * (w = s*q + b), compressed-tensors' symmetric offset 8 (w = s*(q - 8)) or its zero points z, int32
 * [ceil(N / 8), K / group] packed along n (w = s*(q - z)). Each lane dequantizes its own fragment in
 * registers (gm_expand) and rounds each value to bf16 once, as export/quantized.py's `dequantize` does
 * (see GM_QPAIRS below for where the two agree); no dequantized weight is written anywhere. A fetch
 * of GM_QSC chunks (a super-chunk; CUDA 4: 16 bytes of W a lane in one load, one scale and offset a
 * lane) gives its chunks the super-chunk's k-values under a fixed permutation (gm_round), so the k
 * order of each output's sum is still fixed by (N, K, the split) alone and the numerics contract
 * holds, with W the dequantized bf16 weight: y equals the bf16 kernel's on x and W with their columns
 * permuted that way (kernels/gemm/reference.py `q4_k_order`; bench/gemm_q4_bench.py checks it bit for
 * bit). A fetch's k-values of a lane lie in one group (group in 32, 64, 128).
 *
 * Each backend layer (gemm_gpu.cu) includes gpu.h (kg_bf16) and defines before including this file:
 *   GM_FN, GM_TID(), GM_WG_X(), GM_WG_Y()  qualifiers, thread id, workgroup ids
 *   GM_WARPS, GM_CW, GM_U         warps per workgroup, column tiles per warp, chunks per round
 *   GM_UQ(MT)                     fetches per round of the 4-bit entry points of MT m-tiles
 *   GM_QSC, GM_QLANE_K(l)         4-bit chunks a fetch, and a lane's k offset in a fetch of GM_QSC > 1
 *                                 chunks (chunk h's k-values: k + GM_QLANE_K(l) + 8 * GM_WQ * h ..)
 *   GM_QPAIRS, gm_q4_pairs(p, word, s2, o2, c2)  1: a word's 4 bf16 pairs, dequantized in bf16x2
 *   GM_BLOCK_LOOP                 1: a workgroup may take several column blocks in turn (GX < blocks)
 *   GM_TN, GM_KC                  columns per tile, k-values per chunk
 *   gm_wfrag, gm_xfrag, gm_acc    a lane's W fragment of one chunk, x fragment of one chunk and
 *                                 m-tile, accumulator of one m-tile x column tile
 *   gm_load_w(f, w, col, k, ok)   W fragment of tile column base `col` at chunk start k (zeros if !ok)
 *   GM_WLANE_N(l), GM_WLANE_K(l), GM_WLANE_V  a lane's W fragment: column col + N(l), k-values
 *                                 k + K(l) .. + V - 1 in order (4-bit: V / 8 words)
 *   gm_load_q<W>(words, p, ok)    W consecutive int32 words at p (zeros if !ok), streamed
 *   gm_wfrag_set(f, pairs)        a W fragment from its V bf16 values, two a word (low half first)
 *   gm_pack_bf16x2(lo, hi)        two f32 -> bf16 bits (nearest even) in one word, lo in the low half
 *   gm_load_x(f, x, row0, k, M, K) x fragment of m-tile rows row0.. at chunk start k (rows >= M are 0)
 *   gm_load_x_at<XLO>(f, x, row0, kl, M, K) the same at the lane's own first k-value kl, where rows
 *                                 >= M may hold any values (their outputs are never written; CUDA
 *                                 reads row M - 1) and, with XLO, rows row0 + 8.. need not be loaded
 *   gm_mma(acc, xf, wf)           acc += the chunk's products
 *   gm_mma_q<XLO>(acc, xf, wf)    the same for a chunk of a 4-bit fetch of GM_QSC > 1 chunks (its own
 *                                 fixed order of the lane's k-values: kernels/gemm/reference.py q4_k_order)
 *   GM_QSTRAIGHT, gm_ld_u16_if, gm_ld_u32_if  1: a 4-bit fetch's loads without branches (predicated)
 *   GM_QPIPE                      1: the 4-bit entry points of one m-tile issue the next round's loads
 *                                 before consuming this one (gm_rounds_pipelined)
 *   GM_QXLO                       1: with M <= 8 the 4-bit entry points of one m-tile take gm_split<.., true>
 *   gm_acc_zero(acc)
 *   gm_acc_get(acc, i, &row, &col) element i of GM_ACC_N of a lane's accumulator and its
 *                                 (row within the m-tile, column within the tile)
 *   GM_ACC_N                      f32 values per lane per accumulator
 *   GM_SHARED, GM_BARRIER()       workgroup-shared storage, workgroup barrier
 *   GM_FENCE()                    device-scope memory fence (orders the partials and the count)
 * The number of m-tiles MT (1..4) and of weights G (1..3) are template parameters: one entry point
 * per (G, MT).
 *
 * Epilogues (gm_single): instead of y = bf16(sum), the op the model applies next, so that it costs no
 * dispatch of its own (each is a launch on the step's critical path):
 *   GM_EPI_RESIDUAL  y = bf16(r + bf16(sum)), r bf16 [M, N]: the residual add after o_proj and down_proj.
 *   GM_EPI_SWIGLU    two weights, gate and up, side by side: a block is GM_BN / 2 columns of each, the
 *                    first half of the warps take the gate's, the second half up's; y [M, N] =
 *                    bf16(bf16(silu(g)) * u) with g, u the two sums rounded to bf16 (y of the plain
 *                    grouped dispatch).
 * Both repeat the roundings of the eager bf16 model (each op rounds its result to bf16; PyTorch
 * computes silu(a) = a / (1 + exp(-a)) in f32), and each weight's sums are the plain kernel's, so the
 * numerics contract above holds per weight.
 */
#ifndef DFLASH_GEMM_BODY_H
#define DFLASH_GEMM_BODY_H

#define GM_BN (GM_WARPS * GM_CW * GM_TN)
#define GM_LANES 32

/* f32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN: gpu.h's. */
#define gm_bf16 kg_bf16

#define GM_EPI_NONE 0
#define GM_EPI_RESIDUAL 1
#define GM_EPI_SWIGLU 2

GM_FN float gm_f32(unsigned short b) {
  union { unsigned u; float f; } v;
  v.u = (unsigned)b << 16;
  return v.f;
}

GM_FN unsigned short gm_residual(float s, unsigned short r) { return gm_bf16(gm_f32(r) + gm_f32(gm_bf16(s))); }

/* silu from the hardware exp2 (rel. error ~2^-22, far below a bf16 ulp; 2^inf = inf gives -0 as PyTorch). */
GM_FN unsigned short gm_swiglu(unsigned short g, unsigned short u) {
  const float a = gm_f32(g);
  const float silu = a / (1.0f + KG_EXP2(-a * 1.4426950408889634f));
  return gm_bf16(gm_f32(gm_bf16(silu)) * gm_f32(u));
}

/* A weight operand is fetched (gm_fetch: the loads of a chunk, its `raw` form, in flight for a whole
 * round) and then expanded (gm_expand: the chunk's bf16 W fragment, just before its matrix
 * instructions, so that a round holds only the raw forms in registers).
 * gm_w16: bf16 [N, K] as stored; raw is the fragment itself. */
struct gm_w16 {
  template <int F>
  using raw = gm_wfrag;
  static constexpr int fetch_chunks = 1;
  const unsigned short* w;
};
template <int F>
GM_FN void gm_fetch(gm_wfrag* r, const gm_w16& ws, int col, int k, int K, int ok) { gm_load_w(r, ws.w, col, k, K, ok); }
GM_FN void gm_expand(gm_wfrag* f, const gm_wfrag& r, int, const gm_w16&) { *f = r; }

/* gm_w4: a packed 4-bit weight (header): q, s, and o = b (GM_Q_MLX, bf16) or z (GM_Q_ZP, int32), unused
 * for GM_Q_SYM; fmt and group (gshift = log2 group) are uniform push constants. */
#define GM_Q_MLX 0
#define GM_Q_SYM 1
#define GM_Q_ZP 2
#define GM_WQ (GM_WLANE_V / 8) /* words of a lane a chunk */
/* A 4-bit fetch covers F consecutive chunks (F = 1, or GM_QSC: a "super-chunk" of F * GM_KC k-values):
 * lane l loads F * GM_WQ consecutive words of its column in one load, the k-values
 * kb + gm_qlane_k<F>(l) .. + F * 8 * GM_WQ - 1, and chunk h (0..F-1) of the fetch takes words
 * h * GM_WQ .. of them, its k-values kb + gm_qlane_k<F>(l) + h * 8 * GM_WQ ... (the x fragment is
 * loaded at the same k, gm_load_x_at). With F = 1 that is the bf16 kernel's fragment (GM_WLANE_K);
 * with F = GM_QSC > 1 the chunks of a super-chunk hold its k-values in another fixed permutation (on
 * CUDA chunk h lane t holds kb + 32t + 8h .. + 7): still fixed by (N, K, the split) alone. A lane's
 * k-values of a fetch lie in one group, so a fetch loads one scale and one offset.
 * GM_QPAIRS 0: w = bf16(fma(s, q, o)) in f32, o = b or -z * s (exact), which is export/quantized.py
 * `dequantize` itself: an f32 rounding, then a bf16 one. GM_QPAIRS 1: the backend dequantizes two
 * values at a time (gm_q4_pairs, bf16x2 arithmetic: w = bf16(s * (q - z) + b) rounded once, from
 * s2 = (s, s), o2 = (b, b) or +0, c2 = -(128 + z) twice); that is the same value wherever s * q + b is
 * exact in f32, so that its f32 rounding is none: always for sym and zp (s * (q - z) has at most 12
 * significant bits), and for mlx when b = 0 or 2^-11 <= |b / s| < 2^15 by exponents, which mlx-lm's
 * biases are (b, the group's edge, is 0 or q0 * s with 1 <= |q0| <= 15). */
#ifndef GM_QPAIRS
#define GM_QPAIRS 0
#endif
#ifndef GM_QPIPE
#define GM_QPIPE 0
#endif
#ifndef GM_QSTRAIGHT
#define GM_QSTRAIGHT 0
#endif
#ifndef GM_QXLO
#define GM_QXLO 0
#endif
template <int F>
GM_FN int gm_qlane_k(int lane) { return F == 1 ? GM_WLANE_K(lane) : GM_QLANE_K(lane); }
template <int F>
struct gm_q4raw {
  unsigned words[F * GM_WQ];
#if GM_QPAIRS
  unsigned s2, o2, c2;
#else
  float s, o;
#endif
};
struct gm_w4 {
  template <int F>
  using raw = gm_q4raw<F>;
  static constexpr int fetch_chunks = GM_QSC;
  const unsigned* q;
  const unsigned short* s;
  const void* o;
  int fmt, group, gshift;
};

template <int F>
GM_FN void gm_fetch(gm_q4raw<F>* r, const gm_w4& ws, int col, int k, int K, int ok) {
  const int lane = GM_TID() % GM_LANES;
  const int k0 = k + gm_qlane_k<F>(lane);
  const int groups = K >> ws.gshift, g = k0 >> ws.gshift;
#if GM_QSTRAIGHT
  /* A tile past N reads column GM_WLANE_N(lane) instead (its sums are never written): every load of a
   * fetch is issued unconditionally, with no branch between a round's loads. */
  const int n = (ok ? col : 0) + GM_WLANE_N(lane);
  gm_load_q(r->words, ws.q + (long)n * (K / 8) + k0 / 8, 1);
  const long gi = (long)n * groups + g;
  const float s = gm_f32(ws.s[gi]);
  const float b = gm_f32(gm_ld_u16_if((const unsigned short*)ws.o + gi, ws.fmt == GM_Q_MLX));
  const unsigned zw = gm_ld_u32_if((const unsigned*)ws.o + (long)(n / 8) * groups + g, ws.fmt == GM_Q_ZP, 0x88888888u);
  const float z = ws.fmt == GM_Q_MLX ? 0.0f : (float)((zw >> (4 * (n % 8))) & 15u);
#else
  const int n = col + GM_WLANE_N(lane);
  gm_load_q(r->words, ws.q + (long)n * (K / 8) + k0 / 8, ok);
  float s = 0.0f, b = 0.0f, z = 0.0f;
  if (ok) {
    const long gi = (long)n * groups + g;
    s = gm_f32(ws.s[gi]);
    if (ws.fmt == GM_Q_MLX)
      b = gm_f32(((const unsigned short*)ws.o)[gi]);
    else
      z = (float)(ws.fmt == GM_Q_ZP ? (((const unsigned*)ws.o)[(long)(n / 8) * groups + g] >> (4 * (n % 8))) & 15u
                                    : 8u);
  }
#endif
#if GM_QPAIRS
  r->s2 = gm_pack_bf16x2(s, s), r->o2 = gm_pack_bf16x2(b, b), r->c2 = gm_pack_bf16x2(-128.0f - z, -128.0f - z);
#else
  r->s = s, r->o = ws.fmt == GM_Q_MLX ? b : -z * s;
#endif
}

/* Value j (0..7) of a packed word as an exact f32: its 4 bits under the exponent of 2^23, less 2^23
 * (no integer-to-float conversion, a slow instruction on both vendors). */
GM_FN float gm_nibble(unsigned word, int j) {
  union { unsigned u; float f; } v;
  v.u = 0x4B000000u | ((word >> (4 * j)) & 15u);
  return v.f - 8388608.0f;
}

/* Chunk h's fragment from a lane's words, scale and offset: pairs[4 * wi + i] is word wi's values 2i and
 * 2i + 1 (gm_wfrag_set places them). */
template <int F>
GM_FN void gm_expand(gm_wfrag* f, const gm_q4raw<F>& r, int h, const gm_w4&) {
  unsigned pairs[GM_WLANE_V / 2];
#pragma unroll
  for (int wi = 0; wi < GM_WQ; ++wi) {
    const unsigned word = r.words[h * GM_WQ + wi];
#if GM_QPAIRS
    gm_q4_pairs(pairs + 4 * wi, word, r.s2, r.o2, r.c2);
#else
#pragma unroll
    for (int i = 0; i < 4; ++i)
      pairs[4 * wi + i] = gm_pack_bf16x2(__builtin_fmaf(r.s, gm_nibble(word, 2 * i), r.o),
                                         __builtin_fmaf(r.s, gm_nibble(word, 2 * i + 1), r.o));
#endif
  }
  gm_wfrag_set(f, pairs);
}

/* U consecutive fetches of F chunks each from kk of one warp's GM_CW column tiles into acc: all U
 * fetches' W loads are issued first (U * F chunks in flight), then the chunks are consumed fetch by
 * fetch, chunk by chunk (increasing k for F = 1; the super-chunk's fixed permutation for F > 1). */
template <int U, int F, class WS>
GM_FN void gm_fetch_round(typename WS::template raw<F> (&wr)[GM_CW][U], const WS& w, int col_w,
                          const int (&ok)[GM_CW], int kk, int K) {
#pragma unroll
  for (int j = 0; j < U; ++j)
#pragma unroll
    for (int c = 0; c < GM_CW; ++c) gm_fetch<F>(&wr[c][j], w, col_w + c * GM_TN, kk + j * F * GM_KC, K, ok[c]);
}

template <int GM_MT, int U, int F, class WS, bool XLO = false, bool XS = false>
GM_FN void gm_consume_round(gm_acc (&acc)[GM_MT][GM_CW], const typename WS::template raw<F> (&wr)[GM_CW][U],
                            const unsigned short* __restrict__ x, const WS& w, int kk, int M, int K) {
#pragma unroll
  for (int j = 0; j < U; ++j)
#pragma unroll
    for (int h = 0; h < F; ++h) {
      gm_wfrag wf[GM_CW];
#pragma unroll
      for (int c = 0; c < GM_CW; ++c) gm_expand(&wf[c], wr[c][j], h, w);
#pragma unroll
      for (int mt = 0; mt < GM_MT; ++mt) {
        gm_xfrag xf;
        if (XS)
          gm_load_xs(&xf, x, kk + j * GM_KC);
        else if (F == 1)
          gm_load_x(&xf, x, mt * 16, kk + j * GM_KC, M, K);
        else
          gm_load_x_at<XLO>(&xf, x, mt * 16, kk + j * F * GM_KC + gm_qlane_k<F>(GM_TID() % GM_LANES) + h * 8 * GM_WQ,
                            M, K);
#pragma unroll
        for (int c = 0; c < GM_CW; ++c)
          if (F == 1)
            gm_mma(&acc[mt][c], &xf, &wf[c]);
          else
            gm_mma_q<XLO>(&acc[mt][c], &xf, &wf[c]);
      }
    }
}

template <int GM_MT, int U, int F, class WS, bool XLO = false, bool XS = false>
GM_FN void gm_round(gm_acc (&acc)[GM_MT][GM_CW], const unsigned short* __restrict__ x, const WS& w, int col_w,
                    const int (&ok)[GM_CW], int kk, int M, int K) {
  typename WS::template raw<F> wr[GM_CW][U];
  gm_fetch_round<U, F>(wr, w, col_w, ok, kk, K);
  gm_consume_round<GM_MT, U, F, WS, XLO, XS>(acc, wr, x, w, kk, M, K);
}

/* The whole rounds of [kk, k_end) with the next round's loads issued before this round is consumed
 * (two raw buffers, a and b, in turn): a warp keeps a round of W in flight while it dequantizes and
 * multiplies, where gm_round waits for each round's loads. The same fetches, chunks and matrix
 * instructions in the same order as gm_round's loop, so the same sums. Returns the k after them. */
template <int GM_MT, int U, int F, class WS, bool XLO>
GM_FN int gm_rounds_pipelined(gm_acc (&acc)[GM_MT][GM_CW], const unsigned short* __restrict__ x, const WS& w,
                              int col_w, const int (&ok)[GM_CW], int kk, int k_end, int M, int K) {
  constexpr int RS = GM_KC * F * U;
  if (kk + RS > k_end) return kk;
  typename WS::template raw<F> a[GM_CW][U], b[GM_CW][U];
  gm_fetch_round<U, F>(a, w, col_w, ok, kk, K);
  for (;;) {
    if (kk + 2 * RS > k_end) {
      gm_consume_round<GM_MT, U, F, WS, XLO>(acc, a, x, w, kk, M, K);
      return kk + RS;
    }
    gm_fetch_round<U, F>(b, w, col_w, ok, kk + RS, K);
    gm_consume_round<GM_MT, U, F, WS, XLO>(acc, a, x, w, kk, M, K);
    kk += RS;
    if (kk + 2 * RS > k_end) {
      gm_consume_round<GM_MT, U, F, WS, XLO>(acc, b, x, w, kk, M, K);
      return kk + RS;
    }
    gm_fetch_round<U, F>(a, w, col_w, ok, kk + RS, K);
    gm_consume_round<GM_MT, U, F, WS, XLO>(acc, b, x, w, kk, M, K);
    kk += RS;
  }
}

/* Fetches a round: GM_U for bf16 weights (a chunk each), GM_UQ(MT) for packed ones (GM_QSC chunks
 * each; their expansion needs registers). */
template <class WS, int MT>
struct gm_u {
  static constexpr int value = GM_U;
};
template <int MT>
struct gm_u<gm_w4, MT> {
  static constexpr int value = GM_UQ(MT);
};

/* A warp's sums over its split [kk, k_end): rounds, then shorter ones, then single chunks. XLO: m-tile 0's
 * rows 8..15 hold no row of the call (4-bit fetches of GM_QSC > 1 chunks only). */
template <int GM_MT, bool XLO, class WS, bool XS = false>
GM_FN void gm_split(gm_acc (&acc)[GM_MT][GM_CW], const unsigned short* __restrict__ x, const WS& w, int col_w,
                    const int (&ok)[GM_CW], int kk, int k_end, int M, int K) {
  constexpr int U = gm_u<WS, GM_MT>::value, F = WS::fetch_chunks;
  if (GM_QPIPE && F > 1 && GM_MT == 1) /* 4-bit, one m-tile: the next round in flight while this one is consumed */
    kk = gm_rounds_pipelined<GM_MT, U, F, WS, XLO>(acc, x, w, col_w, ok, kk, k_end, M, K);
  for (; kk + GM_KC * F * U <= k_end; kk += GM_KC * F * U) /* whole rounds: U fetches in flight */
    gm_round<GM_MT, U, F, WS, XLO, XS>(acc, x, w, col_w, ok, kk, M, K);
  if (U > 4) /* then a round of half as many: a short split (small K) keeps loads in flight */
    for (; kk + GM_KC * F * (U / 2) <= k_end; kk += GM_KC * F * (U / 2))
      gm_round<GM_MT, (U > 4 ? U / 2 : 1), F, WS, XLO, XS>(acc, x, w, col_w, ok, kk, M, K);
  if (F > 1) /* whole fetches, one at a time */
    for (; kk + GM_KC * F <= k_end; kk += GM_KC * F)
      gm_round<GM_MT, 1, F, WS, XLO>(acc, x, w, col_w, ok, kk, M, K);
  for (; kk < k_end; kk += GM_KC) /* the rest, a chunk at a time */
    gm_round<GM_MT, 1, 1, WS, false, XS>(acc, x, w, col_w, ok, kk, M, K);
}


/* RMSNorm of a row of K bf16 values x (issue #24), HF's Qwen3RMSNorm with its roundings:
 * y = bf16(f32(g) * f32(bf16(x * rinv))), rinv = 1 / sqrt(ss / K + eps) in f32, g the norm's bf16 weight.
 * ss, the sum of the squares, in one fixed order for a row whoever computes it: GM_NT threads, thread t
 * taking the 16-byte vectors t, t + GM_NT, ... of the row in turn (each vector's 8 values in k order,
 * one fma each), then the 32 lanes of a warp by an xor butterfly (each step a + b, the same sum in
 * both lanes), then the warps' sums in warp order. The norm's own dispatch (gm_rms_norm_workgroup,
 * verify's and the draft's rows) and the GEMM's norm prologue (gm_normed_x, decode's one row) both
 * run gm_rms_rinv with GM_NT threads, so decode's normalized row has verify's bits. */
#define GM_NT (GM_WARPS * GM_LANES)
#ifndef GM_NORM_KMAX
#define GM_NORM_KMAX 8192 /* the prologue's shared row: 16 KiB */
#endif
#define GM_NV (GM_NORM_KMAX / 8 / GM_NT) /* a thread's vectors of a row, at most */
typedef unsigned gm_nvec __attribute__((ext_vector_type(4)));

GM_FN float gm_lo(unsigned w) { return gm_f32((unsigned short)(w & 0xffffu)); }
GM_FN float gm_hi(unsigned w) { return gm_f32((unsigned short)(w >> 16)); }

/* 1 / sqrt(ss / K + eps) of the row whose vectors tid + GM_NT i this thread holds in v (zeros past K). */
GM_FN float gm_rms_rinv(const gm_nvec (&v)[GM_NV], int K, float eps, int tid) {
  GM_SHARED float gm_ss[GM_WARPS];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < GM_NV; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      ss = __builtin_fmaf(gm_lo(v[i][c]), gm_lo(v[i][c]), ss);
      ss = __builtin_fmaf(gm_hi(v[i][c]), gm_hi(v[i][c]), ss);
    }
  const int lane = tid % GM_LANES;
#pragma unroll
  for (int m = GM_LANES / 2; m >= 1; m /= 2) ss = ss + KG_SHFL(ss, lane ^ m);
  if (lane == 0) gm_ss[tid / GM_LANES] = ss;
  GM_BARRIER();
  float t = gm_ss[0];
#pragma unroll
  for (int w = 1; w < GM_WARPS; ++w) t += gm_ss[w];
  return 1.0f / __builtin_sqrtf(t / (float)K + eps);
}

/* The row's vectors tid + GM_NT i, all loads issued at once (zeros past K). */
GM_FN void gm_row_vectors(gm_nvec (&v)[GM_NV], const unsigned short* __restrict__ x, int K, int tid) {
#pragma unroll
  for (int i = 0; i < GM_NV; ++i) {
    const int e = 8 * (tid + GM_NT * i);
    v[i] = e < K ? *(const gm_nvec*)(x + e) : (gm_nvec){0u, 0u, 0u, 0u};
  }
}

GM_FN gm_nvec gm_norm_vec(gm_nvec xv, gm_nvec gv, float rinv) {
  gm_nvec o;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float a = gm_f32(gm_bf16(gm_lo(xv[c]) * rinv)), b = gm_f32(gm_bf16(gm_hi(xv[c]) * rinv));
    o[c] = (unsigned)gm_bf16(gm_lo(gv[c]) * a) | (unsigned)gm_bf16(gm_hi(gv[c]) * b) << 16;
  }
  return o;
}

/* One workgroup of the norm's dispatch (grid (M), GM_NT threads): row wg_x of x [M, K] into y. */
GM_FN void gm_rms_norm_workgroup(const unsigned short* __restrict__ x, const unsigned short* __restrict__ g,
                                 unsigned short* __restrict__ y, int K, float eps, int wg_x, int tid) {
  gm_nvec v[GM_NV], gv[GM_NV];
  x += (long)wg_x * K, y += (long)wg_x * K;
  gm_row_vectors(v, x, K, tid);
  gm_row_vectors(gv, g, K, tid);
  const float rinv = gm_rms_rinv(v, K, eps, tid);
#pragma unroll
  for (int i = 0; i < GM_NV; ++i) {
    const int e = 8 * (tid + GM_NT * i);
    if (e < K) *(gm_nvec*)(y + e) = gm_norm_vec(v[i], gv[i], rinv);
  }
}

/* The GEMM's norm prologue (one row, M = 1): this workgroup's split [k0, k0 + KR) of the normalized row
 * into shared memory; returns the address that the split's x loads (gm_load_xs) index by k. Every
 * workgroup reads the whole row from L2 for ss (8 KiB at K = 4096) and g for its split only. */
GM_FN const unsigned short* gm_normed_x(const unsigned short* __restrict__ x, const unsigned short* __restrict__ g,
                                        float eps, int K, int k0, int KR, int tid) {
  GM_SHARED gm_nvec gm_xs[GM_NORM_KMAX / 8];
  gm_nvec v[GM_NV], gv[GM_NV];
  gm_row_vectors(v, x, K, tid);
#pragma unroll
  for (int i = 0; i < GM_NV; ++i) {
    const int e = 8 * (tid + GM_NT * i);
    gv[i] = e >= k0 && e < k0 + KR ? *(const gm_nvec*)(g + e) : (gm_nvec){0u, 0u, 0u, 0u};
  }
  const float rinv = gm_rms_rinv(v, K, eps, tid);
#pragma unroll
  for (int i = 0; i < GM_NV; ++i) {
    const int e = 8 * (tid + GM_NT * i);
    if (e >= k0 && e < k0 + KR) gm_xs[(e - k0) / 8] = gm_norm_vec(v[i], gv[i], rinv);
  }
  GM_BARRIER();
  return (const unsigned short*)gm_xs - k0;
}

/* Column block wg_x (of ceil(N / GM_BN); GM_EPI_SWIGLU: ceil(N / (GM_BN / 2))), split wg_y (of S) of
 * one weight (GM_EPI_SWIGLU: w the gate's, w1 up's), as one workgroup does it. When S == 1, y is
 * bf16[M*N]; otherwise part is f32[S*M*N] (split-major scratch; GM_EPI_SWIGLU: the gate's, then
 * up's) and cnt int32[blocks] is zero on entry and left zero. r: GM_EPI_RESIDUAL's bf16[M*N]. */
template <int GM_MT, int GM_EPI = GM_EPI_NONE, class WS, bool XS = false>
GM_FN void gm_workgroup(const unsigned short* __restrict__ x, WS w, unsigned short* __restrict__ y, float* __restrict__ part, int* cnt, int M, int N, int K,
                        int KR, int S, int wg_x, int wg_y, int tid, WS w1 = WS{},
                        const unsigned short* __restrict__ r = 0) {
  const int warp = tid / GM_LANES;
  const int half = GM_EPI == GM_EPI_SWIGLU ? warp / (GM_WARPS / 2) : 0; /* 1: an up warp */
  const int bn = GM_EPI == GM_EPI_SWIGLU ? GM_BN / 2 : GM_BN;
  const int wh = warp - half * (GM_WARPS / 2);
  const int col_w = wg_x * bn + wh * (GM_CW * GM_TN); /* this warp's first column */
  if (half) w = w1;
  if (half && S > 1) part += (long)S * M * N; /* up's partials after the gate's */
  const int k0 = wg_y * KR;
  gm_acc acc[GM_MT][GM_CW];
  int ok[GM_CW];
#pragma unroll
  for (int c = 0; c < GM_CW; ++c) {
    ok[c] = col_w + c * GM_TN < N; /* N is a multiple of GM_TN: a tile is all in or all out */
#pragma unroll
    for (int mt = 0; mt < GM_MT; ++mt) gm_acc_zero(&acc[mt][c]);
  }
  if constexpr (GM_QXLO && WS::fetch_chunks > 1 && GM_MT == 1) {
    if (M <= 8) /* no row of the call in rows 8..15: their x is not loaded (gm_load_x_at) */
      gm_split<GM_MT, true>(acc, x, w, col_w, ok, k0, k0 + KR, M, K);
    else
      gm_split<GM_MT, false>(acc, x, w, col_w, ok, k0, k0 + KR, M, K);
  } else {
    gm_split<GM_MT, false, WS, XS>(acc, x, w, col_w, ok, k0, k0 + KR, M, K);
  }
  /* GM_EPI_SWIGLU, one split: up's rounded sums go to the gate warps, which hold the same outputs
   * (the slot depends on the lane only) and write y. */
  const int lane = tid % GM_LANES;
  GM_SHARED unsigned short gm_up[GM_EPI == GM_EPI_SWIGLU ? GM_WARPS / 2 : 1][GM_MT][GM_CW][GM_ACC_N][GM_LANES];
  const int exchange = GM_EPI == GM_EPI_SWIGLU && S == 1;
  if (exchange) {
    if (half)
#pragma unroll
      for (int mt = 0; mt < GM_MT; ++mt)
#pragma unroll
        for (int c = 0; c < GM_CW; ++c)
#pragma unroll
          for (int i = 0; i < GM_ACC_N; ++i) {
            int rr, cc;
            gm_up[wh][mt][c][i][lane] = gm_bf16(gm_acc_get(&acc[mt][c], i, &rr, &cc));
          }
    GM_BARRIER();
  }
#pragma unroll
  for (int mt = 0; mt < GM_MT; ++mt)
#pragma unroll
    for (int c = 0; c < GM_CW; ++c) {
      if (!ok[c] || (exchange && half)) continue;
#pragma unroll
      for (int i = 0; i < GM_ACC_N; ++i) {
        int rr, cc;
        float v = gm_acc_get(&acc[mt][c], i, &rr, &cc);
        int row = mt * 16 + rr, col = col_w + c * GM_TN + cc;
        if (row >= M) continue;
        if (S == 1)
          y[row * N + col] = GM_EPI == GM_EPI_SWIGLU     ? gm_swiglu(gm_bf16(v), gm_up[wh][mt][c][i][lane])
                             : GM_EPI == GM_EPI_RESIDUAL ? gm_residual(v, r[row * N + col])
                                                         : gm_bf16(v);
        else
          part[((long)wg_y * M + row) * N + col] = v;
      }
    }
  if (exchange) GM_BARRIER(); /* gm_up is free for this workgroup's next block */
  if (S == 1) return;
  if (half) part -= (long)S * M * N;
  /* Split-K: the last workgroup of this column block to finish adds the partials in split order. */
  GM_SHARED int gm_last;
  GM_FENCE();
  GM_BARRIER();
  if (tid == 0)
    gm_last = __scoped_atomic_fetch_add(&cnt[wg_x], 1, __ATOMIC_ACQ_REL, __MEMORY_SCOPE_DEVICE) == S - 1;
  GM_BARRIER();
  if (!gm_last) return;
  GM_FENCE();
  const int c0 = wg_x * bn;
  const int cols = N - c0 < bn ? N - c0 : bn;
  for (int e = tid; e < M * cols; e += GM_WARPS * GM_LANES) {
    int row = e / cols, col = c0 + e % cols;
    const int* p = (const int*)part + (long)row * N + col;
    float s = 0.0f, s1 = 0.0f;
    for (int sp = 0; sp < S; ++sp) {
      union { int i; float f; } u;
      u.i = __scoped_atomic_load_n(p + (long)sp * M * N, __ATOMIC_RELAXED, __MEMORY_SCOPE_DEVICE);
      s += u.f;
      if (GM_EPI == GM_EPI_SWIGLU) {
        u.i = __scoped_atomic_load_n(p + (long)(S + sp) * M * N, __ATOMIC_RELAXED, __MEMORY_SCOPE_DEVICE);
        s1 += u.f;
      }
    }
    y[row * N + col] = GM_EPI == GM_EPI_SWIGLU     ? gm_swiglu(gm_bf16(s), gm_bf16(s1))
                       : GM_EPI == GM_EPI_RESIDUAL ? gm_residual(s, r[row * N + col])
                                                   : gm_bf16(s);
  }
  if (tid == 0) __scoped_atomic_store_n(&cnt[wg_x], 0, __ATOMIC_RELAXED, __MEMORY_SCOPE_DEVICE);
}

/* One workgroup of a grouped dispatch: G (1..3) weights W_g [N_g, K] that multiply the same x, each
 * into its own y_g [M, N_g] (the q, k and v projections of a layer, or gate and up). The column
 * blocks of all weights, ceil(N_g / GM_BN) each, weight g's after weight g-1's, are spread over a
 * grid of GX x S workgroups: workgroup (wg_x, s) does split s of blocks wg_x, wg_x + GX, ... in turn
 * (GX below the block count when one pass would leave a partial second wave of workgroups). Weight
 * g's partials and counters follow weight g-1's in part and cnt. Each weight's columns are computed
 * exactly as gm_workgroup computes a lone weight with the same split, so the numerics contract holds
 * per weight, whatever G and GX are. */
template <int GM_MT, int GM_G, class WS, bool XS = false>
GM_FN void gm_group_block(const unsigned short* __restrict__ x, WS w0, WS w1, WS w2, int* cnt, unsigned short* y0, unsigned short* y1,
                          unsigned short* y2, float* part, int M, int K, int KR, int S, int N0, int N1, int N2,
                          int cb0, int cb1, int b, int wg_y, int tid) {
  WS w = w0;
  unsigned short* y = y0;
  int N = N0, coff = 0;
  long poff = 0;
  if (GM_G > 1 && b >= cb0) {
    b -= cb0, coff = cb0, poff = (long)S * M * N0, w = w1, y = y1, N = N1;
    if (GM_G > 2 && b >= cb1) b -= cb1, coff += cb1, poff += (long)S * M * N1, w = w2, y = y2, N = N2;
  }
  gm_workgroup<GM_MT, GM_EPI_NONE, WS, XS>(x, w, y, part + poff, cnt + coff, M, N, K, KR, S, b, wg_y, tid);
}

template <int GM_MT, int GM_G, class WS, bool XS = false>
GM_FN void gm_group(const unsigned short* __restrict__ x, WS w0, WS w1, WS w2, int* cnt, unsigned short* y0, unsigned short* y1, unsigned short* y2,
                    float* part, int M, int K, int KR, int S, int GX, int N0, int N1, int N2, int wg_x, int wg_y,
                    int tid, const unsigned short* g = 0, float eps = 0.0f) {
  if (XS) x = gm_normed_x(x, g, eps, K, wg_y * KR, KR, tid);
  const int cb0 = (N0 + GM_BN - 1) / GM_BN, cb1 = GM_G > 1 ? (N1 + GM_BN - 1) / GM_BN : 0;
#if GM_BLOCK_LOOP
  const int blocks = cb0 + cb1 + (GM_G > 2 ? (N2 + GM_BN - 1) / GM_BN : 0);
  for (int b = wg_x; b < blocks; b += GX)
    gm_group_block<GM_MT, GM_G, WS, XS>(x, w0, w1, w2, cnt, y0, y1, y2, part, M, K, KR, S, N0, N1, N2, cb0, cb1, b, wg_y, tid);
#else
  (void)GX; /* the plan gives GX = the block count on this backend: one block a workgroup */
  gm_group_block<GM_MT, GM_G, WS, XS>(x, w0, w1, w2, cnt, y0, y1, y2, part, M, K, KR, S, N0, N1, N2, cb0, cb1, wg_x, wg_y, tid);
#endif
}

/* One workgroup of a single-weight dispatch with an epilogue (GM_EPI_RESIDUAL: w0, r; GM_EPI_SWIGLU:
 * w0 = gate, w1 = up): grid GX x S, workgroup (wg_x, s) does split s of column blocks wg_x, wg_x + GX, ... */
template <int GM_MT, int GM_EPI, class WS, bool XS = false>
GM_FN void gm_single(const unsigned short* __restrict__ x, WS w0, WS w1, const unsigned short* r, int* cnt, unsigned short* y, float* part, int M, int K, int KR, int S,
                     int GX, int N, int wg_x, int wg_y, int tid, const unsigned short* g = 0, float eps = 0.0f) {
  if (XS) x = gm_normed_x(x, g, eps, K, wg_y * KR, KR, tid);
#if GM_BLOCK_LOOP
  const int bn = GM_EPI == GM_EPI_SWIGLU ? GM_BN / 2 : GM_BN;
  for (int b = wg_x; b < (N + bn - 1) / bn; b += GX)
    gm_workgroup<GM_MT, GM_EPI, WS, XS>(x, w0, y, part, cnt, M, N, K, KR, S, b, wg_y, tid, w1, r);
#else
  (void)GX;
  gm_workgroup<GM_MT, GM_EPI, WS, XS>(x, w0, y, part, cnt, M, N, K, KR, S, wg_x, wg_y, tid, w1, r);
#endif
}

/* One workgroup of the reduce dispatch (grid (ceil(M*N / (GM_RT*4)))): y[e] = bf16(sum_s part[s][e]),
 * s in increasing order, 4 consecutive elements per thread. */
#define GM_RT 256
GM_FN void gm_reduce_workgroup(const float* __restrict__ part, unsigned short* __restrict__ y, int MN, int S,
                               int wg_x, int tid) {
  int e = (wg_x * GM_RT + tid) * 4;
  if (e >= MN) return; /* MN is a multiple of 4 (N is a multiple of 8) */
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
  for (int s = 0; s < S; ++s) {
    const float* p = part + (long)s * MN + e;
    s0 += p[0];
    s1 += p[1];
    s2 += p[2];
    s3 += p[3];
  }
  y[e] = gm_bf16(s0);
  y[e + 1] = gm_bf16(s1);
  y[e + 2] = gm_bf16(s2);
  y[e + 3] = gm_bf16(s3);
}

#endif
