/* Per-head RMSNorm, then the rotary embedding: the q_norm / k_norm and RoPE of Qwen3 and of Qwen3.5's
 * gated attention as one pass.
 *
 * For one row r (a token) and one head h of x [rows, H, D], Qwen3 (nr_workgroup):
 *
 *   n    = round(x * rsqrt(sum(x^2) / D + eps))        sums and products in f32
 *   y    = round(weight * n)
 *   out  = round(round(y * cos[r]) + round(rot(y) * sin[r]))
 *
 * with rot(y) = [-y[D/2:], y[:D/2]] (the NEOX halves of export/qwen3.py `apply_rope`) and round()
 * the rounding to the tensor dtype (f32: none, bf16, f16), one per PyTorch op of the eager module, so
 * that the result is the eager one bit for bit up to the order of the f32 sum of squares. rsqrt is
 * 1 / sqrt with both correctly rounded, as ATen's CPU kernel computes it; no multiply-add is
 * contracted (the eager ops round each product): the objects are built with -ffp-contract=off.
 *
 * The variants (nr_workgroup_v; export/qwen35.py `zc_rms_norm` then `partial_rope`):
 *
 *   y    = round(x * rsqrt(sum(x^2) / D + eps) * (1 + weight))   zero-centred: products in f32, one rounding
 *   out  = the rope above over y[:R] (rot over R: [-y[R/2:R], y[:R/2]], cos and sin [rows, R]), y[R:] as it is
 *
 * One workgroup of NR_T threads per (row, head): workgroup id = r * H + h (the pair and the KV-writing
 * entry points put k's heads, and v's, after q's: nr_workgroup_kv). Thread t takes the pairs
 * (i, i + R/2) for i = t, t + NR_T, ... < R/2 (R = D for Qwen3), then the dims R + t, R + t + NR_T, ...
 * < D. Needs the GPU primitives of gpu.h.
 */
#ifndef DFLASH_KERNELS_NORM_ROPE_BODY_H
#define DFLASH_KERNELS_NORM_ROPE_BODY_H

#define NR_T 64

enum { NR_F32 = 0, NR_BF16 = 1, NR_F16 = 2 };

KG_FN float nr_load(const void* p, long i, int dt) {
  if (dt == NR_F32) return ((const float*)p)[i];
  if (dt == NR_BF16) {
    union { unsigned u; float f; } v;
    v.u = (unsigned)((const unsigned short*)p)[i] << 16;
    return v.f;
  }
  return (float)((const _Float16*)p)[i];
}

KG_FN float nr_round(float f, int dt) {
  if (dt == NR_F32) return f;
  if (dt == NR_BF16) {
    union { unsigned u; float f; } v;
    v.u = (unsigned)kg_bf16(f) << 16;
    return v.f;
  }
  return (float)(_Float16)f;
}

KG_FN void nr_store(void* p, long i, float f, int dt) {
  if (dt == NR_F32) ((float*)p)[i] = f;
  else if (dt == NR_BF16) ((unsigned short*)p)[i] = kg_bf16(f);
  else ((_Float16*)p)[i] = (_Float16)f;
}

/* One head: x's D values at element xb, normed, weighted and rotated (cos and sin rows at tab) into
 * out at element ob. */
KG_FN void nr_head(const void* x, long xb, const void* w, const void* cs, const void* sn, long tab, void* out,
                   long ob, int D, int dt, float eps, int tid) {
  KG_SHARED float red[NR_T];
  const int half = D / 2;
  float ss = 0.0f;
  for (int i = tid; i < D; i += NR_T) {
    float v = nr_load(x, xb + i, dt);
    ss += v * v;
  }
  red[tid] = ss;
  KG_BARRIER();
  for (int s = NR_T / 2; s > 0; s >>= 1) {
    if (tid < s) red[tid] += red[tid + s];
    KG_BARRIER();
  }
  const float r = 1.0f / __builtin_sqrtf(red[0] / (float)D + eps);
  for (int i = tid; i < half; i += NR_T) {
    float a = nr_round(nr_load(w, i, dt) * nr_round(nr_load(x, xb + i, dt) * r, dt), dt);
    float b = nr_round(nr_load(w, i + half, dt) * nr_round(nr_load(x, xb + i + half, dt) * r, dt), dt);
    float lo = nr_round(nr_round(a * nr_load(cs, tab + i, dt), dt) + nr_round(-b * nr_load(sn, tab + i, dt), dt), dt);
    float hi = nr_round(nr_round(b * nr_load(cs, tab + i + half, dt), dt) + nr_round(a * nr_load(sn, tab + i + half, dt), dt), dt);
    nr_store(out, ob + i, lo, dt);
    nr_store(out, ob + i + half, hi, dt);
  }
}

/* Head (row, h) of x [rows, H, D] into the same place of out [rows, H, D]; cos and sin [rows, D]. */
KG_FN void nr_workgroup(const void* x, const void* w, const void* cs, const void* sn, void* out, int H, int D,
                        int dt, float eps, int wg, int tid) {
  nr_head(x, (long)wg * D, w, cs, sn, (long)(wg / H) * D, out, (long)wg * D, D, dt, eps, tid);
}

/* A layer's q and k, with k and v written into the KV cache (dflash_norm_rope2_kv). Workgroup wg of
 * rows * (Hq + 2 Hk): q's heads into outq as nr_workgroup does, then k's heads normed and rotated, then
 * v's heads copied, each into its cache row. Row r = s * T + t of k (v) goes to flat cache row
 * rows[s * 2T + t] (rows[s * 2T + T + t]) of cache [*, Hk * D] (export/qwen3.py `cache_rows`: a
 * stream's T key rows, then its T value rows). */
KG_FN void nr_workgroup_kv(const void* xq, const void* wq, const void* xk, const void* wk, const void* cs,
                           const void* sn, const void* v, const long long* rows, void* cache, void* outq,
                           int q_groups, int Hq, int Hk, int D, int T, int dt, float eps, int wg, int tid) {
  if (wg < q_groups) {
    nr_workgroup(xq, wq, cs, sn, outq, Hq, D, dt, eps, wg, tid);
    return;
  }
  const int k_groups = q_groups / Hq * Hk;
  int j = wg - q_groups;
  const int is_v = j >= k_groups;
  if (is_v) j -= k_groups;
  const int r = j / Hk, h = j - r * Hk, s = r / T, t = r - s * T;
  const long ob = (long)rows[(long)s * 2 * T + (is_v ? T : 0) + t] * ((long)Hk * D) + (long)h * D;
  if (!is_v) {
    nr_head(xk, (long)j * D, wk, cs, sn, (long)r * D, cache, ob, D, dt, eps, tid);
  } else if (dt == NR_F32) {
    for (int i = tid; i < D; i += NR_T) ((float*)cache)[ob + i] = ((const float*)v)[(long)j * D + i];
  } else {
    for (int i = tid; i < D; i += NR_T)
      ((unsigned short*)cache)[ob + i] = ((const unsigned short*)v)[(long)j * D + i];
  }
}

/* Element i of a head, normed and weighted (x at xi): Qwen3's round(w * round(x * r)) (zc = 0), or
 * Qwen3.5's zero-centred round(x * r * (1 + w)) (zc = 1), whose eager `zc_rms_norm` scales in float32
 * and rounds to the dtype once. */
KG_FN float nr_norm(const void* x, long xi, const void* w, int i, float r, int zc, int dt) {
  if (zc) return nr_round(nr_load(x, xi, dt) * r * (1.0f + nr_load(w, i, dt)), dt);
  return nr_round(nr_load(w, i, dt) * nr_round(nr_load(x, xi, dt) * r, dt), dt);
}

/* The variants' workgroup: head (row, h) of x [rows, H, XS], of which the first D of each head are
 * its values (XS = 2 D: q read in place from q_proj's interleaved [query, gate] heads, where IREE
 * would copy it out in a dispatch of its own), into out [rows, H, D]; cos and sin [rows, R]. The first
 * R dims rotate (pairs (i, i + R/2)), the D - R after them take the norm only (export/qwen35.py
 * `partial_rope`); zc as nr_norm. With zc = 0, R = XS = D it computes nr_workgroup's bits;
 * nr_workgroup keeps its own arithmetic (nr_head) so that Qwen3's entry points keep the arithmetic
 * checked on the device. */
KG_FN void nr_workgroup_v(const void* x, const void* w, const void* cs, const void* sn, void* out, int H, int D,
                          int R, int XS, int zc, int dt, float eps, int wg, int tid) {
  KG_SHARED float red[NR_T];
  const int half = R / 2;
  const long row = wg / H;
  const long xb = (long)wg * XS, ob = (long)wg * D, tab = row * R;
  float ss = 0.0f;
  for (int i = tid; i < D; i += NR_T) {
    float v = nr_load(x, xb + i, dt);
    ss += v * v;
  }
  red[tid] = ss;
  KG_BARRIER();
  for (int s = NR_T / 2; s > 0; s >>= 1) {
    if (tid < s) red[tid] += red[tid + s];
    KG_BARRIER();
  }
  const float r = 1.0f / __builtin_sqrtf(red[0] / (float)D + eps);
  for (int i = tid; i < half; i += NR_T) {
    float a = nr_norm(x, xb + i, w, i, r, zc, dt);
    float b = nr_norm(x, xb + i + half, w, i + half, r, zc, dt);
    float lo = nr_round(nr_round(a * nr_load(cs, tab + i, dt), dt) + nr_round(-b * nr_load(sn, tab + i, dt), dt), dt);
    float hi = nr_round(nr_round(b * nr_load(cs, tab + i + half, dt), dt) + nr_round(a * nr_load(sn, tab + i + half, dt), dt), dt);
    nr_store(out, ob + i, lo, dt);
    nr_store(out, ob + i + half, hi, dt);
  }
  for (int i = R + tid; i < D; i += NR_T) nr_store(out, ob + i, nr_norm(x, xb + i, w, i, r, zc, dt), dt);
}

#endif
