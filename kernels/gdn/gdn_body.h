/* Gated DeltaNet step: the token-by-token gated delta rule of one layer, the one kernel body for every GPU backend.
 *
 * The rule (Yang et al., "Gated Delta Networks", arXiv:2412.06464; transformers' qwen3_next
 * `torch_recurrent_gated_delta_rule`; export/gdn.py `prepare`, `delta_step`, `recurrent_rule`), per
 * stream s, value head h (key head h / (Hv / Hk)) and row t = 0..T-1, with S the float32 state [dk, dv]:
 *
 *   q, k  = l2norm(q_t), l2norm(k_t)  (x * 1 / sqrt(sum x^2 + eps));  q *= scale (dk^-1/2 as f32)
 *   beta  = sigmoid(b_t)  (rounded to the model dtype, as eager's `b.sigmoid()`)
 *   g     = -exp(A_log) * softplus(a_t + dt_bias)  (f32; softplus(x) = x above 20)
 *   S     = S * exp(g);  kv = S^T k;  delta = (v_t - kv) * beta;  S = S + k (x) delta;  o_t = S^T q
 *
 * and the state after row t is written to slot row base + t (every_row 1: decode, verify, the rows a
 * rollback may resume from) or the last row's state only, to slot row base (every_row 0: a prefill's
 * blocks, each resuming from the one before); o_t is written in the model dtype.
 *
 *   mixed   dt  [S, T, conv_dim]   the conv's output, q | k | v (conv_dim = 2 Hk dk + Hv dv), read in place
 *   b, a    dt  [S, T, Hv]         in_proj_b / in_proj_a outputs
 *   A_log, dt_bias  dt [Hv]
 *   rows    i32 [S, 2]             per stream: the flat slot row holding the state before row 0
 *                                  (-1: a fresh sequence, zeros), the flat row of slot 0 (written + t)
 *   slots   f32 [R, n_gdn, Hv, dk, dv]   export/recurrent_state.py gdn_slots viewed as R = streams * slots
 *                                  rows; this layer's part is read (one row) and written (T rows, or one) in place
 *   o       dt  [S, T, Hv, dv]
 *   dt: f32 (dtype 0) or bf16 (dtype 1).
 *
 * Decomposition: workgroup (c, h, s) owns the 8 state columns [8 c, 8 c + 8) of head h; its 128
 * threads are 4 warps, warp w holding the rows [w Q, w Q + Q) of those columns (Q = dk / 4), lane
 * (gi, c8) of a warp (lane 8 gi + c8) the rows [w Q + gi R, w Q + gi R + R) of column 8 c + c8 in
 * registers (R = ceil(Q / 4) <= 8; the last groups' ranges stop at Q: an empty one adds +0). So a
 * 27B layer's state runs on 3,072 warps (23 an SM of an H100): the rule is a chain of dependent sums
 * a row, and more warps hide its latency. The state is read once, updated T times in registers and
 * written after every row, or after the last (32-byte segments); a workgroup reads
 * and writes its own columns only, so `from` may equal the row it writes. All T rows' q, k and v are staged in shared memory
 * first, and q and k normalised (2T threads, one row each); the gates by T threads. kv and o are
 * per-lane sums over the lane's rows; a warp adds its 4 groups' partials of a column gathered across
 * the warp (KG_SHFL), and the 4 warps' sums are added through shared memory (two barriers a row).
 *
 * Numerics contract: a row's o and the state after it depend only on the state before it and the
 * row's inputs, whatever T is and wherever the row sits (decode and verify give bit-identical states
 * and outputs: the project's row invariance). Every sum has a fixed order: the squares of a q or k
 * row over i = 0, 1, ...; kv and o as 16 group partials, each over its rows in increasing i
 * (starting from +0), a warp's four added ((p0 + p1) + p2) + p3 and the four warps' sums
 * ((w0 + w1) + w2) + w3. No multiply-add is contracted (built with -ffp-contract=off), each product
 * rounds as eager's do. exp and log are the float32 polynomials below (no libm, no hardware
 * approximation), 1/sqrt and divisions IEEE-rounded. reference.py repeats exactly these operations in
 * NumPy float32, so the kernel's bits are reference.py's bits; against torch's eager rule the
 * differences are float32 rounding only (the order of the sums, exp, log1p and sigmoid to within a
 * few ulps).
 *
 * Limits: dk a multiple of 4 up to 128 (GD_DMAX), any dv (column blocks of 8), 1 <= T <= GD_TMAX
 * (16), Hv a multiple of Hk. Shared memory: 2 * 16 * 128 * 4 + 16 * 8 * 4 + 2 * 4 * 8 * 4 + 256 =
 * 17,408 bytes.
 */
#ifndef DFLASH_GDN_BODY_H
#define DFLASH_GDN_BODY_H

#define GD_T 128      /* threads per workgroup: 4 warps */
#define GD_COLS 8     /* state columns per workgroup */
#define GD_WARPS 4    /* row quarters, one a warp */
#define GD_GROUPS 4   /* row groups of a warp (lanes 8 gi + c8) */
#define GD_DMAX 128   /* largest dk */
#define GD_RMAX (GD_DMAX / (GD_WARPS * GD_GROUPS))
#define GD_TMAX 16    /* largest T */

typedef union { float f; unsigned u; int i; } gd_bits;

KG_FN float gd_f(unsigned u) {
  gd_bits v;
  v.u = u;
  return v.f;
}

KG_FN unsigned gd_u(float f) {
  gd_bits v;
  v.f = f;
  return v.u;
}

/* element i of a tensor of the model dtype (0 f32, 1 bf16) as f32 */
KG_FN float gd_load(const void* p, long i, int dtype) {
  if (dtype == 1) return gd_f((unsigned)((const unsigned short*)p)[i] << 16);
  return ((const float*)p)[i];
}

/* f32 rounded to the model dtype and back (what eager's `.to(dtype)` then `.float()` gives) */
KG_FN float gd_round(float x, int dtype) { return dtype == 1 ? gd_f((unsigned)kg_bf16(x) << 16) : x; }

/* 2^n as a float for -126 <= n <= 127 */
KG_FN float gd_pow2(int n) { return gd_f((unsigned)(n + 127) << 23); }

/* e^x in float32: n = rint(x log2 e), r = x - n ln2 (Cody-Waite), e^r by its degree-7 Taylor
 * polynomial (Horner), times 2^n in two normal factors where 2^n alone would be subnormal.
 * reference.py `expf` is the same operations. */
KG_FN float gd_exp(float x) {
  if (x > 88.72283f) return __builtin_inff();
  if (x < -103.97208f) return 0.0f;
  const float n = __builtin_rintf(x * 1.44269504f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.98412698e-4f;  /* 1/5040 */
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int e = (int)n;
  if (e < -125) return (p * gd_pow2(e + 100)) * gd_pow2(-100);
  if (e > 127) return (p * gd_pow2(e - 1)) * 2.0f;
  return p * gd_pow2(e);
}

/* log(u) in float32 for a finite u >= 1: u = m 2^e with m in [sqrt(1/2), sqrt(2)), s = (m - 1) / (m + 1),
 * log m = 2 s (1 + s^2/3 + ... + s^10/11), log u = e ln2_hi + (log m + e ln2_lo). */
KG_FN float gd_log(float u) {
  const unsigned bits = gd_u(u);
  int e = (int)((bits >> 23) & 255u) - 127;
  float m = gd_f((bits & 0x7fffffu) | 0x3f800000u);
  if (m > 1.41421356f) {
    m = m * 0.5f;
    e = e + 1;
  }
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  float p = 9.09090909e-2f;  /* 1/11 */
  p = p * s2 + 1.11111111e-1f;
  p = p * s2 + 1.42857143e-1f;
  p = p * s2 + 2.0e-1f;
  p = p * s2 + 3.33333333e-1f;
  p = p * s2 + 1.0f;
  const float lm = (2.0f * s) * p;
  const float fe = (float)e;
  return fe * 0.693359375f + (lm + fe * -2.12194440e-4f);
}

/* softplus(x) = log1p(e^x), x above 20 passes (torch's threshold); log1p(y) = log(1 + y) y / ((1 + y) - 1) */
KG_FN float gd_softplus(float x) {
  if (x > 20.0f) return x;
  const float y = gd_exp(x);
  const float u = 1.0f + y;
  if (u == 1.0f) return y;
  return gd_log(u) * (y / (u - 1.0f));
}

KG_FN void gd_workgroup(const void* __restrict__ mixed, const void* __restrict__ bb, const void* __restrict__ aa,
                        const void* __restrict__ alog, const void* __restrict__ dtb, const int* __restrict__ rows,
                        float* slots, void* __restrict__ out, int T, int Hk, int Hv, int dk, int dv, int layer,
                        int n_gdn, int dtype, float eps, float scale, int every_row, int wc, int h, int s, int tid) {
  KG_SHARED float sq[GD_TMAX][GD_DMAX];
  KG_SHARED float sk[GD_TMAX][GD_DMAX];
  KG_SHARED float sv[GD_TMAX][GD_COLS];
  KG_SHARED float inv[2 * GD_TMAX];
  KG_SHARED float sdecay[GD_TMAX], sbeta[GD_TMAX];
  KG_SHARED float pkv[GD_WARPS][GD_COLS], po[GD_WARPS][GD_COLS];

  const int conv_dim = 2 * Hk * dk + Hv * dv;
  const int hk = h / (Hv / Hk);
  const int w = tid / 32, lane = tid % 32, gi = lane / GD_COLS, c8 = lane % GD_COLS;
  const int j = wc * GD_COLS + c8;
  const bool col = j < dv;
  const int Q = dk / GD_WARPS, R = (Q + GD_GROUPS - 1) / GD_GROUPS;
  const int i0 = w * Q + gi * R;
  const int n = gi * R >= Q ? 0 : (Q - gi * R < R ? Q - gi * R : R); /* this lane's rows */
  const long head = (long)dk * dv;

  /* stage q and k of every row, raw, and v of this workgroup's columns */
  for (int x = tid; x < 2 * T * dk; x += GD_T) {
    const int which = x / (T * dk), t = (x / dk) % T, i = x % dk;
    const float v = gd_load(mixed, (long)(s * T + t) * conv_dim + which * Hk * dk + hk * dk + i, dtype);
    if (which == 0) sq[t][i] = v; else sk[t][i] = v;
  }
  for (int x = tid; x < T * GD_COLS; x += GD_T) {
    const int t = x / GD_COLS, jj = wc * GD_COLS + x % GD_COLS;
    sv[t][x % GD_COLS] = jj < dv ? gd_load(mixed, (long)(s * T + t) * conv_dim + 2 * Hk * dk + h * dv + jj, dtype) : 0.0f;
  }
  /* the gates of every row */
  if (tid < T) {
    const long at = (long)(s * T + tid) * Hv + h;
    const float bv = gd_load(bb, at, dtype);
    sbeta[tid] = gd_round(1.0f / (1.0f + gd_exp(-bv)), dtype);
    const float A = gd_exp(gd_load(alog, h, dtype));
    const float g = -A * gd_softplus(gd_load(aa, at, dtype) + gd_load(dtb, h, dtype));
    sdecay[tid] = gd_exp(g);
  }
  /* the state before row 0 */
  float st[GD_RMAX];
  const int from = rows[2 * s], base = rows[2 * s + 1];
  const long col0 = (long)i0 * dv + j;
#pragma unroll
  for (int r = 0; r < GD_RMAX; ++r) st[r] = 0.0f;
  if (from >= 0 && col) {
    const float* src = slots + ((long)from * n_gdn + layer) * Hv * head + (long)h * head + col0;
#pragma unroll
    for (int r = 0; r < GD_RMAX; ++r) {
      if (r < n) st[r] = *src;
      src += dv;
    }
  }
  KG_BARRIER();
  /* the norms: one thread a row, squares summed in increasing i */
  if (tid < 2 * T) {
    const float* x = tid < T ? sq[tid] : sk[tid - T];
    float ss = 0.0f;
#pragma unroll 8
    for (int i = 0; i < dk; ++i) ss = ss + x[i] * x[i];
    inv[tid] = 1.0f / __builtin_sqrtf(ss + eps);
  }
  KG_BARRIER();
  for (int x = tid; x < 2 * T * dk; x += GD_T) {
    const int which = x / (T * dk), t = (x / dk) % T, i = x % dk;
    if (which == 0) sq[t][i] = (sq[t][i] * inv[t]) * scale;
    else sk[t][i] = sk[t][i] * inv[T + t];
  }
  KG_BARRIER();

  for (int t = 0; t < T; ++t) {
    const float decay = sdecay[t];
    float p = 0.0f;
#pragma unroll
    for (int r = 0; r < GD_RMAX; ++r) {
      if (r < n) {
        st[r] = st[r] * decay;
        p = p + st[r] * sk[t][i0 + r];
      }
    }
    p = ((KG_SHFL(p, c8) + KG_SHFL(p, 8 + c8)) + KG_SHFL(p, 16 + c8)) + KG_SHFL(p, 24 + c8);
    if (gi == 0) pkv[w][c8] = p;
    KG_BARRIER();  /* (every lane read the last row's pkv before the last barrier, warp 0 its po before this one) */
    const float kv = ((pkv[0][c8] + pkv[1][c8]) + pkv[2][c8]) + pkv[3][c8];
    const float delta = (sv[t][c8] - kv) * sbeta[t];
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < GD_RMAX; ++r) {
      if (r < n) {
        st[r] = st[r] + sk[t][i0 + r] * delta;
        o = o + st[r] * sq[t][i0 + r];
      }
    }
    if (col && (every_row || t == T - 1)) {
      float* d = slots + ((long)(base + (every_row ? t : 0)) * n_gdn + layer) * Hv * head + (long)h * head + col0;
#pragma unroll
      for (int r = 0; r < GD_RMAX; ++r) {
        if (r < n) *d = st[r];
        d += dv;
      }
    }
    o = ((KG_SHFL(o, c8) + KG_SHFL(o, 8 + c8)) + KG_SHFL(o, 16 + c8)) + KG_SHFL(o, 24 + c8);
    if (gi == 0) po[w][c8] = o;
    KG_BARRIER();
    if (w == 0 && gi == 0 && col) {
      const float y = ((po[0][c8] + po[1][c8]) + po[2][c8]) + po[3][c8];
      const long at = ((long)(s * T + t) * Hv + h) * dv + j;
      if (dtype == 1) ((unsigned short*)out)[at] = kg_bf16(y);
      else ((float*)out)[at] = y;
    }
  }
}

#endif
