/* Per-head RMSNorm, then the rotary embedding: Qwen3's q_norm / k_norm and RoPE as one pass.
 *
 * For one row r (a token) and one head h of x [rows, H, D]:
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
 * One workgroup of NR_T threads per (row, head): workgroup id = r * H + h. Thread t takes the pairs
 * (i, i + D/2) for i = t, t + NR_T, ... < D/2. Needs the GPU primitives of gpu.h.
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

KG_FN void nr_workgroup(const void* x, const void* w, const void* cs, const void* sn, void* out, int H, int D,
                        int dt, float eps, int wg, int tid) {
  KG_SHARED float red[NR_T];
  const int half = D / 2;
  const long row = wg / H;
  const long base = (long)wg * D;  /* x and out are [rows, H, D], contiguous */
  const long tab = row * D;        /* cos and sin are [rows, D] */
  float ss = 0.0f;
  for (int i = tid; i < D; i += NR_T) {
    float v = nr_load(x, base + i, dt);
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
    float a = nr_round(nr_load(w, i, dt) * nr_round(nr_load(x, base + i, dt) * r, dt), dt);
    float b = nr_round(nr_load(w, i + half, dt) * nr_round(nr_load(x, base + i + half, dt) * r, dt), dt);
    float lo = nr_round(nr_round(a * nr_load(cs, tab + i, dt), dt) + nr_round(-b * nr_load(sn, tab + i, dt), dt), dt);
    float hi = nr_round(nr_round(b * nr_load(cs, tab + i + half, dt), dt) + nr_round(a * nr_load(sn, tab + i + half, dt), dt), dt);
    nr_store(out, base + i, lo, dt);
    nr_store(out, base + i + half, hi, dt);
  }
}

#endif
