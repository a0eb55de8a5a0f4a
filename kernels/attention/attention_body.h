/* Block attention over the KV cache: the one kernel body for every GPU backend.
 *
 * For one layer of the verify step: out = softmax(q k^T * scale, masked) v, per KV head h, for a block
 * of R query rows (the block's B tokens times the g query heads that share h, export/qwen3.py
 * `attend`), over the first N cache rows. q, the cache and out are bf16; every sum is f32.
 *
 *   q     bf16 [S, Hkv, R, D]              query rows, already rotated (G = 0), or the model's own
 *         bf16 [S, T, Hkv, G, D]           layout, row r = t * G + j being query head h * G + j of
 *                                          token t (G > 0, R = T * G): no transpose before or after
 *   cache bf16 [S, L, 2, C, Hkv * D]       the target's KV cache (export/qwen3.py `write_cache`),
 *                                          read in place: keys of layer l at [s, l, 0, :N], values at [s, l, 1, :N]
 *   mask  i8   [S, R, N]                   nonzero: the row attends to that key
 *   out   bf16 [S, Hkv, R, D] (G = 0), [S, T, Hkv, G, D] (G > 0)
 *
 * Decomposition (flash decoding: Dao et al., "Flash-Decoding for long-context inference", 2023, and
 * the online softmax of Milakov & Gimelshein, arXiv:1805.02867). Workgroup (c, h * RG + rg, s) takes
 * rows [16 rg, 16 rg + 16) of head h and the 64 keys [64 c, 64 c + 64): it stages the rows' q and the
 * chunk's keys and values in shared memory, computes the 16 x 64 scores, each row's chunk maximum m,
 * p = 2^(score - m) and l = sum p, and o = p v (16 x D), and writes (o, m, l) to `part` unnormalized.
 * It then counts itself in cnt[(s, h, rg)] (an integer atomic, as in gemm_body.h); the workgroup that
 * arrives last merges the chunks of its 16 rows, whoever it is: M = max m_c, L = sum l_c 2^(m_c - M)
 * (as AT_TPR strided partial sums over c = pt, pt + AT_TPR, ..., added in pt order),
 * out = bf16(sum o_c 2^(m_c - M) / L) summed in chunk order c = 0, 1, ...; it resets its counter.
 * One dispatch, no float atomics.
 *
 * Numerics contract: a row's result depends only on its q row, its mask row and the cache. Scores
 * are summed over d in increasing order, a chunk's p v over its keys in increasing order, the chunks
 * in the fixed orders above; chunks sit at absolute key positions. So a query row comes out
 * bit-identical whatever R is, wherever it sits in the block and however many more keys N takes in
 * (masked keys and chunks add exact zeros, given finite cache values: the cache starts as zeros):
 * what `exact` mode and drafted == plain rely on. Scores are in log2 units (scale * log2 e folded
 * in), exponentials from the hardware's 2^x.
 *
 * Output gate (AT_GATE = 1: the Qwen3.5 family's gated attention, export/qwen35.py):
 *   gate  bf16, out's layout                the gate logits of every output element
 *   out = bf16(f32(o) * f32(s)), o = bf16(attention in f32), s = bf16(1 / (1 + 2^(-gate * log2 e)))
 * which are the roundings of the eager bf16 `attention(q, k, v) * torch.sigmoid(gate)`: the
 * attention, then sigmoid, then the product, each rounded to bf16 (the product of two bf16 values
 * is exact in f32, so it rounds once). The sigmoid's exponential is the hardware's 2^x, as the
 * softmax's: where f32 sigmoid(x) lies within ~2^-22 (relative) of a bf16 rounding boundary, s
 * can come out one bf16 ulp from torch's. That is the project's bf16 near-tie policy for compiled
 * against eager (README.md's opening; the norm + rope kernel's 1-2 ulp near-ties, kernels/README.md):
 * drafted == plain and `exact` mode need the compiled decode and verify to agree with each other,
 * and both run this kernel, whose result for a row does not depend on R (the numerics contract
 * above), not with eager torch bit for bit.
 *
 * Variants (compile-time, one object each, kernels/build.py): the default (D <= 128, no gate:
 * the Qwen3 targets), AT_GATE = 1 (D <= 128 with the gate: `dflash_attention_gated`) and AT_GATE = 1
 * with AT_DMAX = 256 (`dflash_attention_gated_d256`). Every variant sums in the orders above, so
 * for the same inputs all three give the same o bit for bit; the wide one stages the keys and
 * then the values in one shared buffer (AT_KV_ONE) and merges its 16 elements a thread in two
 * passes of 8 (AT_EPG), so that its shared memory stays under 48 KiB and its registers under 256
 * (one pass of 16 spilled 117 VGPRs on gfx11).
 *
 * Limits: D a multiple of 8 and <= AT_DMAX (128, or 256 for the wide variant); R <= 128 (the limit
 * of kernels/attention/dispatch.py; the body takes any R, one row group of 16 rows per 16);
 * N >= 1 (N = 0 launches no workgroup and leaves out unwritten; the runtime always reads at least
 * one page); 16-byte aligned rows. Static shared memory: 43,652 bytes (42.6 KiB) for AT_DMAX = 128,
 * 47,492 bytes (46.4 KiB) for 256: under CUDA's 48 KiB static limit and gfx11's 64 KiB a workgroup.
 */
#ifndef DFLASH_ATTENTION_BODY_H
#define DFLASH_ATTENTION_BODY_H

#ifndef AT_T
#define AT_T 256  /* threads per workgroup */
#endif
#define AT_RW 16  /* query rows per workgroup */
#define AT_KC 64  /* keys per chunk */
#ifndef AT_DMAX
#define AT_DMAX 128
#endif
#ifndef AT_GATE
#define AT_GATE 0
#endif
/* The wide variant stages keys, then values, in one buffer: two would take 66 KiB. */
#define AT_KV_ONE (AT_DMAX > 128)
#define AT_W (AT_DMAX / 2)   /* 32-bit words (bf16 pairs) of a row */
#define AT_PAD (AT_W + 1)    /* a staged key row's stride in words: the 64 keys fall in distinct banks */
#define AT_SR (AT_RW * AT_KC / AT_T) /* scores: rows per thread (one key each) */
#define AT_TPR (AT_T / AT_RW)        /* softmax and merge: threads per row */
#define AT_KPT (AT_KC / AT_TPR)      /* softmax: keys per thread */
#define AT_PR (AT_RW * AT_W / AT_T)  /* p v: rows per thread (one d pair each) */
#define AT_EPT (AT_RW * AT_DMAX / AT_T) /* merge: output elements per thread */
#define AT_MB 8                      /* merge: chunks whose loads are in flight together */
#define AT_EPG (AT_EPT < 8 ? AT_EPT : 8) /* merge: elements per pass (AT_EPT for AT_DMAX = 128) */
#define AT_NEG_INF (-__builtin_inff())
typedef unsigned at_u4 __attribute__((ext_vector_type(4)));

KG_FN float at_lo(unsigned w) {
  union { unsigned u; float f; } v;
  v.u = w << 16;
  return v.f;
}
KG_FN float at_hi(unsigned w) {
  union { unsigned u; float f; } v;
  v.u = w & 0xffff0000u;
  return v.f;
}
/* Four words into shared memory one by one (a padded row is only 4-byte aligned). */
KG_FN void at_put4(unsigned* p, at_u4 v) {
  p[0] = v.x;
  p[1] = v.y;
  p[2] = v.z;
  p[3] = v.w;
}

/* A load of another workgroup's partial results that skips this unit's possibly stale L1. */
KG_FN float at_load_f32(const float* p) {
#if defined(__NVPTX__)
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#else
  union { int i; float f; } v;
  v.i = __scoped_atomic_load_n((const int*)p, __ATOMIC_RELAXED, __MEMORY_SCOPE_DEVICE);
  return v.f;
#endif
}

/* Row r's maximum of its AT_TPR threads' values m (thread (r, pt) gives one); every thread gets it. */
KG_FN float at_row_max(float (*red)[AT_TPR], int r, int pt, float m) {
  red[r][pt] = m;
  KG_BARRIER();
  m = red[r][0];
#pragma unroll
  for (int i = 1; i < AT_TPR; ++i) m = red[r][i] > m ? red[r][i] : m;
  return m;
}

/* Row r's sum of its threads' values l, added in pt order, kept with the row's maximum m in sm[r], sl[r]. */
KG_FN void at_row_keep(float (*red)[AT_TPR], float* sm, float* sl, int r, int pt, float m, float l) {
  red[r][pt] = l;
  KG_BARRIER();
  if (pt == 0) {
    float t = 0.0f;
#pragma unroll
    for (int i = 0; i < AT_TPR; ++i) t += red[r][i];
    sm[r] = m;
    sl[r] = t;
  }
}

/* Element offset of query (and output) row r of KV head h in stream s, in q's layout (G above). */
KG_FN long at_row(int s, int h, int r, int R, int Hkv, int D, int G) {
  return G ? ((((long)s * (R / G) + r / G) * Hkv + h) * G + r % G) * D : (((long)s * Hkv + h) * R + r) * D;
}

#if AT_GATE
#define AT_GATE_PARAM const unsigned short* __restrict__ gate,
#define AT_GATE_ARG gate,
#define AT_LOG2E 1.44269504088896340736f
/* bf16(sigmoid(x)) of a bf16 x: 1 / (1 + 2^(-x log2 e)), 2^x from the hardware (header). */
KG_FN float at_sigmoid_bf16(float x) {
  float s = 1.0f / (1.0f + KG_EXP2(-x * AT_LOG2E));
  return at_hi((unsigned)kg_bf16(s) << 16);
}
#else
#define AT_GATE_PARAM
#define AT_GATE_ARG
#endif

/* One workgroup. part holds, per (s, h, rg, c), 16 rows of D + 2 floats: o[0..D), m, l. */
KG_FN void at_workgroup(const unsigned short* __restrict__ q, const unsigned short* __restrict__ cache,
                        const signed char* __restrict__ mask, AT_GATE_PARAM int* cnt, unsigned short* __restrict__ out,
                        float* __restrict__ part, int R, int N, int D, int Hkv, int layer, int L, int C,
                        int chunks, float scale_log2, int G, int c, int hr, int s, int tid) {
  KG_SHARED unsigned sq[AT_RW][AT_W];
  KG_SHARED unsigned sk[AT_KC][AT_PAD];
#if AT_KV_ONE
#define AT_SV sk /* the values overwrite the keys once the scores are in sp */
#else
#define AT_SV sv
  KG_SHARED unsigned sv[AT_KC][AT_PAD];
#endif
  KG_SHARED float sp[AT_RW][AT_KC];
  KG_SHARED float red_m[AT_RW][AT_TPR], red_l[AT_RW][AT_TPR];
  KG_SHARED float sm[AT_RW], sl[AT_RW];
  KG_SHARED int last;

  const int RG = (R + AT_RW - 1) / AT_RW;
  const int h = hr / RG, rg = hr % RG;
  const int r0 = rg * AT_RW, rows = R - r0 < AT_RW ? R - r0 : AT_RW;
  const int k0 = c * AT_KC, keys = N - k0 < AT_KC ? N - k0 : AT_KC;
  const int W = D / 2, KV = Hkv * D;
  const long kbase = (((long)s * L + layer) * 2 * C) * KV + (long)h * D; /* element offset of key 0, head h */
  const long vbase = kbase + (long)C * KV;

  /* Stage q, keys and values in 16-byte loads, all issued before the first store. */
  const int V4 = D / 8; /* 16-byte vectors per row */
  at_u4 qv[AT_RW * AT_W / 4 / AT_T], kv[AT_KC * AT_W / 4 / AT_T], vv[AT_KC * AT_W / 4 / AT_T];
#pragma unroll
  for (int i = 0; i < AT_RW * AT_W / 4 / AT_T; ++i) {
    int e = tid + AT_T * i, r = e / V4;
    qv[i] = r < rows ? *(const at_u4*)(q + at_row(s, h, r0 + r, R, Hkv, D, G) + 8 * (e % V4)) : (at_u4){0u, 0u, 0u, 0u};
  }
#pragma unroll
  for (int i = 0; i < AT_KC * AT_W / 4 / AT_T; ++i) {
    int e = tid + AT_T * i, j = e / V4;
    long off = (long)(k0 + j) * KV + 8 * (e % V4);
    kv[i] = j < keys ? *(const at_u4*)(cache + kbase + off) : (at_u4){0u, 0u, 0u, 0u};
    vv[i] = j < keys ? *(const at_u4*)(cache + vbase + off) : (at_u4){0u, 0u, 0u, 0u};
  }
#pragma unroll
  for (int i = 0; i < AT_RW * AT_W / 4 / AT_T; ++i) {
    int e = tid + AT_T * i, r = e / V4, w = 4 * (e % V4);
    if (r < AT_RW) at_put4(&sq[r][w], qv[i]);
  }
#pragma unroll
  for (int i = 0; i < AT_KC * AT_W / 4 / AT_T; ++i) {
    int e = tid + AT_T * i, j = e / V4, w = 4 * (e % V4);
    if (j < AT_KC) {
      at_put4(&sk[j][w], kv[i]);
#if !AT_KV_ONE
      at_put4(&AT_SV[j][w], vv[i]);
#endif
    }
  }
  KG_BARRIER();

  /* Scores: thread (g, j) takes key j for rows AT_SR g .. AT_SR g + AT_SR - 1. */
  {
    const int j = tid % AT_KC, half = tid / AT_KC;
    float acc[AT_SR];
#pragma unroll
    for (int i = 0; i < AT_SR; ++i) acc[i] = 0.0f;
#pragma unroll 4
    for (int w = 0; w < W; ++w) { /* W is a multiple of 4 */
      unsigned kw = sk[j][w];
      float klo = at_lo(kw), khi = at_hi(kw);
#pragma unroll
      for (int i = 0; i < AT_SR; ++i) {
        unsigned qw = sq[half * AT_SR + i][w];
        acc[i] = __builtin_fmaf(at_lo(qw), klo, acc[i]);
        acc[i] = __builtin_fmaf(at_hi(qw), khi, acc[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < AT_SR; ++i) {
      int r = half * AT_SR + i;
      int vis = r < rows && j < keys && mask[((long)s * R + r0 + r) * N + k0 + j] != 0;
      sp[r][j] = vis ? acc[i] * scale_log2 : AT_NEG_INF;
    }
  }
  KG_BARRIER();
#if AT_KV_ONE
  /* Every key is read: the values (loaded with the keys, held in registers since) take their place;
   * the softmax's barriers below make them visible before p v. */
#pragma unroll
  for (int i = 0; i < AT_KC * AT_W / 4 / AT_T; ++i) {
    int e = tid + AT_T * i, j = e / V4, w = 4 * (e % V4);
    if (j < AT_KC) at_put4(&AT_SV[j][w], vv[i]);
  }
#endif

  /* Per row: chunk maximum m, p = 2^(score - m), l = sum p. Thread (r, pt) takes AT_KPT keys. */
  {
    const int r = tid / AT_TPR, pt = tid % AT_TPR;
    float m = AT_NEG_INF;
#pragma unroll
    for (int i = 0; i < AT_KPT; ++i) m = sp[r][pt * AT_KPT + i] > m ? sp[r][pt * AT_KPT + i] : m;
    m = at_row_max(red_m, r, pt, m);
    float l = 0.0f;
#pragma unroll
    for (int i = 0; i < AT_KPT; ++i) {
      float x = sp[r][pt * AT_KPT + i];
      float p = (m == AT_NEG_INF || x == AT_NEG_INF) ? 0.0f : KG_EXP2(x - m);
      sp[r][pt * AT_KPT + i] = p;
      l += p;
    }
    at_row_keep(red_l, sm, sl, r, pt, m, l);
  }
  KG_BARRIER();

  /* o = p v: thread (g, w) takes the d pair (2w, 2w + 1) for rows AT_PR g .. AT_PR g + AT_PR - 1. */
  float* rec = part + ((((long)s * Hkv + h) * RG + rg) * chunks + c) * (long)(AT_RW * (D + 2));
  {
    const int w = tid % AT_W, half = tid / AT_W;
    float o0[AT_PR], o1[AT_PR];
#pragma unroll
    for (int i = 0; i < AT_PR; ++i) o0[i] = o1[i] = 0.0f;
    if (w < W) {
#pragma unroll 8
      for (int j = 0; j < AT_KC; ++j) { /* past `keys`, p and v are 0: exact zeros */
        unsigned vw = AT_SV[j][w];
        float vlo = at_lo(vw), vhi = at_hi(vw);
#pragma unroll
        for (int i = 0; i < AT_PR; ++i) {
          float p = sp[half * AT_PR + i][j];
          o0[i] = __builtin_fmaf(p, vlo, o0[i]);
          o1[i] = __builtin_fmaf(p, vhi, o1[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < AT_PR; ++i) {
        int r = half * AT_PR + i;
        if (r < rows) {
          rec[r * (D + 2) + 2 * w] = o0[i];
          rec[r * (D + 2) + 2 * w + 1] = o1[i];
        }
      }
    }
    if (tid < rows) {
      rec[tid * (D + 2) + D] = sm[tid];
      rec[tid * (D + 2) + D + 1] = sl[tid];
    }
  }

  /* The last workgroup of (s, h, rg) to arrive merges the chunks in order. */
  KG_FENCE();
  KG_BARRIER();
  const long ci = ((long)s * Hkv + h) * RG + rg;
  if (tid == 0)
    last = __scoped_atomic_fetch_add(&cnt[ci], 1, __ATOMIC_ACQ_REL, __MEMORY_SCOPE_DEVICE) == chunks - 1;
  KG_BARRIER();
  if (!last) return;
  KG_FENCE();
  const float* recs = part + ci * chunks * (long)(AT_RW * (D + 2)); /* chunk c's record at c * stride */
  const long stride = AT_RW * (D + 2);
  /* Row r's M and L: thread (r, pt) takes the chunks c = pt, pt + AT_TPR, ... (in increasing c), then
   * the AT_TPR partials are combined in pt order; a chunk past a row's last key adds an exact 0. The
   * L pass leaves each chunk's weight 2^(m_c - M) in sp[r][c] (chunks past AT_KC recompute theirs). */
  {
    const int r = tid / AT_TPR, pt = tid % AT_TPR;
    float m = AT_NEG_INF;
    if (r < rows)
      for (int cc = pt; cc < chunks; cc += AT_TPR) {
        float mc = at_load_f32(recs + cc * stride + r * (D + 2) + D);
        m = mc > m ? mc : m;
      }
    m = at_row_max(red_m, r, pt, m);
    float l = 0.0f;
    for (int cc = pt; cc < AT_KC || cc < chunks; cc += AT_TPR) {
      float wgt = 0.0f;
      if (r < rows && cc < chunks) {
        float mc = at_load_f32(recs + cc * stride + r * (D + 2) + D);
        float lc = at_load_f32(recs + cc * stride + r * (D + 2) + D + 1);
        wgt = mc == AT_NEG_INF ? 0.0f : KG_EXP2(mc - m);
        l += lc * wgt;
      }
      if (cc < AT_KC) sp[r][cc] = wgt;
    }
    at_row_keep(red_l, sm, sl, r, pt, m, l);
  }
  KG_BARRIER();
  /* Each thread keeps the elements e = tid + AT_T i of the 16 x D block (AT_EPT of them) and takes the
   * chunks AT_MB at a time, all their loads issued before the first is used, summed in chunk order.
   * The wide variant does so for AT_EPG of its elements at a time (two passes over the chunks): all
   * 16 at once would hold 16 x AT_MB loads and their addresses, past the 256 VGPRs (spills). */
  for (int e0 = 0; e0 < AT_EPT; e0 += AT_EPG) {
    float acc[AT_EPG];
#pragma unroll
    for (int i = 0; i < AT_EPG; ++i) acc[i] = 0.0f;
    for (int cb = 0; cb < chunks; cb += AT_MB) {
      float v[AT_MB][AT_EPG];
#pragma unroll
      for (int b = 0; b < AT_MB; ++b)
#pragma unroll
        for (int i = 0; i < AT_EPG; ++i) {
          int e = tid + AT_T * (e0 + i), r = e / D;
          v[b][i] = r < rows && cb + b < chunks ? at_load_f32(recs + (cb + b) * stride + r * (D + 2) + e % D) : 0.0f;
        }
#pragma unroll
      for (int b = 0; b < AT_MB; ++b) {
        const int cc = cb + b;
        if (cc >= chunks) break;
#pragma unroll
        for (int i = 0; i < AT_EPG; ++i) {
          int r = (tid + AT_T * (e0 + i)) / D;
          if (r >= rows) continue;
          float wgt;
          if (cc < AT_KC) {
            wgt = sp[r][cc];
          } else {
            float mc = at_load_f32(recs + cc * stride + r * (D + 2) + D);
            wgt = mc == AT_NEG_INF ? 0.0f : KG_EXP2(mc - sm[r]);
          }
          acc[i] = __builtin_fmaf(wgt, v[b][i], acc[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < AT_EPG; ++i) {
      int e = tid + AT_T * (e0 + i), r = e / D;
#if AT_GATE
      if (r < rows) {
        const long o = at_row(s, h, r0 + r, R, Hkv, D, G) + e % D;
        float a = at_hi((unsigned)kg_bf16(sl[r] > 0.0f ? acc[i] / sl[r] : 0.0f) << 16);
        out[o] = kg_bf16(a * at_sigmoid_bf16(at_lo(gate[o])));
      }
#else
      if (r < rows) out[at_row(s, h, r0 + r, R, Hkv, D, G) + e % D] = kg_bf16(sl[r] > 0.0f ? acc[i] / sl[r] : 0.0f);
#endif
    }
  }
  if (tid == 0) __scoped_atomic_store_n(&cnt[ci], 0, __ATOMIC_RELAXED, __MEMORY_SCOPE_DEVICE);
}
#undef AT_SV

#endif
