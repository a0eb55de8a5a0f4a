/* Draft top-K with log-probs: the one kernel body for every backend.
 *
 * Per row of a logits block x[n, V] (float32) and a temperature T > 0, this computes the K best
 * token ids (descending logit, equal logits by lower id first) and their log-probabilities
 * log_softmax(x / T) at those ids. It runs as two dispatches:
 *
 *   dk_partial_workgroup  grid (C, n): workgroup (c, r) scans chunk c of row r once. It keeps an
 *                         online logsumexp (max m and sum s of exp(y - m), y = x / T, rescaled
 *                         whenever m grows) and the chunk's top-K list, and writes both to a small
 *                         partial record. The logits are read exactly once.
 *   dk_merge_workgroup    grid (n): merges the C partial records of a row into its top-K and
 *                         logsumexp, and writes ids int32[n, K] and log-probs f32[n, K].
 *
 * Sources: the online logsumexp is the online normalizer of Milakov & Gimelshein, "Online
 * normalizer calculation for softmax" (2018). The first-round threshold is the delegate idea of
 * Gaihre et al., "Dr. Top-k: Delegate-Centric Top-k on GPUs" (SC 2021): the maxima of K disjoint
 * sub-ranges are K distinct elements, so the K-th largest of them bounds the K-th largest element
 * from below.
 *
 * Top-K within a chunk: the chunk is processed in rounds of DK_T*DK_U elements. In the first round
 * each thread's maximum is a delegate, and only elements at or above the K-th largest delegate are
 * candidates. In later rounds an element is a candidate only if it beats the current K-th best.
 * Candidates go to a shared buffer and are merged with the list by rank: an element's new position
 * is the number of union elements better than it (keys (value, id) are unique, so ranks are). On
 * random-order logits only about K*ln(V/K) elements per row are ever candidates; adversarial orders
 * (ascending logits) stay correct and get slower. Stage 2 ranks the C*K partial candidates the same
 * way and merges the C logsumexps.
 *
 * Backends differ only in how a "workgroup" runs; each defines, before including this file:
 *   DK_FN              qualifiers of a helper function (device function, or static inline)
 *   DK_T, DK_U         threads per workgroup, elements per thread per round
 *   DK_SHARED          storage of the workgroup-shared state (__shared__, or nothing)
 *   DK_THREADS(tid)    runs the following block once per thread: the calling thread on a GPU,
 *                      a loop over DK_T virtual threads on a CPU
 *   DK_NPRIV, DK_PIDX(tid)  per-thread variables are arrays [DK_NPRIV] indexed by DK_PIDX(tid)
 *   DK_BARRIER()       workgroup barrier (nothing on a CPU, where phases run one after another)
 *   DK_ATOMIC_INC(p)   returns *p and adds 1, atomically among the workgroup's threads
 * Phases between barriers are independent per thread, which is what lets a CPU run them as loops.
 *
 * Partial record, int32[2K + 2] per (row, chunk): K value bits, K ids, the bits of m, of s.
 * Unused list slots hold the padding key (-inf, DK_PAD_ID), worse than every real element.
 */
#ifndef DFLASH_TOPK_BODY_H
#define DFLASH_TOPK_BODY_H

#define DK_MAX_K 64
#define DK_PAD_ID 0x7fffffff
#define DK_CAND (DK_T * DK_U) /* a round adds at most one candidate per element */
#define DK_NEG_INF (-__builtin_inff())

typedef struct DkShared {
  float lv[DK_MAX_K]; /* the list: values (raw logits), best first */
  int li[DK_MAX_K];   /* ... and ids */
  float nv[DK_MAX_K]; /* merge output, copied to the list after a barrier */
  int ni[DK_MAX_K];
  float cv[DK_CAND]; /* candidates of the current round; in stage 2, the union of the records */
  int ci[DK_CAND];
  float seed[DK_T]; /* first round: each thread's maximum (the delegates) */
  float rm[DK_T];   /* logsumexp partials for the tree reduction */
  float rs[DK_T];
  float thr0; /* first-round threshold (a value), -inf afterwards */
  int ln;     /* list length (<= K) */
  int cn;     /* candidates in this round */
  int nl;     /* list length after the merge */
} DkShared;

/* ---- portable float helpers: no libm, the same arithmetic on every backend ---- */

DK_FN float dk_from_bits(int b) {
  union { int i; float f; } u;
  u.i = b;
  return u.f;
}

DK_FN int dk_to_bits(float f) {
  union { int i; float f; } u;
  u.f = f;
  return u.i;
}

DK_FN float dk_maxf(float a, float b) { return a > b ? a : b; }

/* exp(x) for x <= 0 (and moderately positive x): exp(x) = 2^k * exp(r), k = round(x / ln 2),
 * r = x - k ln 2 in [-0.35, 0.35] (Cody-Waite split of ln 2), exp(r) by its Taylor polynomial to
 * degree 7 (truncation error < 1e-8). Below -87.3 the result is 0, so exp(-inf) = 0. */
DK_FN float dk_exp(float x) {
  const float xc = x < -87.3f ? -87.3f : (x > 88.0f ? 88.0f : x);
  const float kf = (float)(int)(xc * 1.44269504f + (xc < 0.0f ? -0.5f : 0.5f));
  const float r = (xc - kf * 0.693145752f) - kf * 1.42860677e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = dk_from_bits(((int)kf + 127) << 23);
  return x < -87.3f ? 0.0f : p * scale;
}

/* log(x) for normal x > 0: x = 2^e * m with m in [sqrt(1/2), sqrt(2)), log(m) = 2 atanh(t),
 * t = (m - 1) / (m + 1), |t| <= 0.172, by its series to t^11 (error < 1e-9). Called once per row. */
DK_FN float dk_log(float x) {
  int b = dk_to_bits(x);
  int e = ((b >> 23) & 0xff) - 127;
  float m = dk_from_bits((b & 0x007fffff) | 0x3f800000);
  if (m > 1.41421356f) {
    m *= 0.5f;
    e += 1;
  }
  const float t = (m - 1.0f) / (m + 1.0f);
  const float t2 = t * t;
  float p = 1.0f / 11.0f;
  p = p * t2 + 1.0f / 9.0f;
  p = p * t2 + 1.0f / 7.0f;
  p = p * t2 + 1.0f / 5.0f;
  p = p * t2 + 1.0f / 3.0f;
  p = p * t2 + 1.0f;
  return (float)e * 0.693147181f + 2.0f * t * p;
}

/* Key order: larger value first, equal values by lower id. Ids are unique, so keys are. */
DK_FN int dk_better(float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); }

/* Folds (m2, s2) into (m, s): the logsumexp of the union, log(s) + m. */
DK_FN void dk_lse_merge(float* m, float* s, float m2, float s2) {
  const float mn = dk_maxf(*m, m2);
  if (mn == DK_NEG_INF) return; /* both empty: avoids (-inf) - (-inf) */
  *s = *s * dk_exp(*m - mn) + s2 * dk_exp(m2 - mn);
  *m = mn;
}

/* Tree reduction of the threads' (rm, rs) into rm[0], rs[0]. DK_T is a power of two. */
#define DK_LSE_TREE(sh)                                                   \
  for (int w_ = DK_T / 2; w_ > 0; w_ /= 2) {                              \
    DK_THREADS(tid) {                                                     \
      if (tid < w_) dk_lse_merge(&sh.rm[tid], &sh.rs[tid], sh.rm[tid + w_], sh.rs[tid + w_]); \
    }                                                                     \
    DK_BARRIER();                                                         \
  }

/* ---- stage 1: one chunk of one row ---- */

DK_FN void dk_partial_workgroup(const float* logits, int* partial, int V, int K, int C, int chunk_len,
                                float inv_t, int chunk, int row) {
  DK_SHARED DkShared sh;
  float px[DK_U][DK_NPRIV]; /* this round's elements of each thread (raw logits) */
  float pmax[DK_NPRIV], pm[DK_NPRIV], ps[DK_NPRIV];
  const float* x = logits + (long)row * V;
  const int begin = chunk * chunk_len;
  const int end = begin + chunk_len < V ? begin + chunk_len : V;

  DK_THREADS(tid) {
    pm[DK_PIDX(tid)] = DK_NEG_INF;
    ps[DK_PIDX(tid)] = 0.0f;
    if (tid == 0) {
      sh.ln = 0;
      sh.cn = 0;
      sh.thr0 = DK_NEG_INF;
    }
  }
  DK_BARRIER();

  for (int base = begin, round = 0; base < end; base += DK_T * DK_U, ++round) {
    /* Load the round and take each thread's maximum, then fold the round into the thread's
     * logsumexp with one rescale. Loops run u-outer so that on a CPU the virtual threads are the
     * SIMD lanes: consecutive threads read consecutive logits, as they coalesce on a GPU. */
    DK_THREADS(tid) { pmax[DK_PIDX(tid)] = DK_NEG_INF; }
    if (base + DK_T * DK_U <= end) { /* whole round in range: unguarded loads */
      for (int u = 0; u < DK_U; ++u) {
        DK_THREADS(tid) {
          const float v = x[base + u * DK_T + tid];
          px[u][DK_PIDX(tid)] = v;
          pmax[DK_PIDX(tid)] = dk_maxf(pmax[DK_PIDX(tid)], v);
        }
      }
    } else {
      for (int u = 0; u < DK_U; ++u) {
        DK_THREADS(tid) {
          const int i = base + u * DK_T + tid;
          const float v = i < end ? x[i] : DK_NEG_INF;
          px[u][DK_PIDX(tid)] = v;
          pmax[DK_PIDX(tid)] = dk_maxf(pmax[DK_PIDX(tid)], v);
        }
      }
    }
    DK_THREADS(tid) {
      const int p = DK_PIDX(tid);
      const float mn = dk_maxf(pm[p], pmax[p] * inv_t);
      ps[p] = mn == DK_NEG_INF ? 0.0f : ps[p] * dk_exp(pm[p] - mn);
      pm[p] = mn;
      if (round == 0) sh.seed[tid] = pmax[p];
    }
    for (int u = 0; u < DK_U; ++u) {
      DK_THREADS(tid) {
        const int p = DK_PIDX(tid);
        /* pm = -inf means every element so far is -inf: nothing to add (and no -inf - -inf) */
        ps[p] += pm[p] == DK_NEG_INF ? 0.0f : dk_exp(px[u][p] * inv_t - pm[p]);
      }
    }
    if (round == 0) {
      /* thr0 = the K-th largest seed (equal seeds ordered by thread); stays -inf if DK_T < K. */
      DK_BARRIER();
      DK_THREADS(tid) {
        const float v = sh.seed[tid];
        int rank = 0;
        for (int q = 0; q < DK_T; ++q) rank += sh.seed[q] > v || (sh.seed[q] == v && q < tid);
        if (rank == K - 1) sh.thr0 = v;
      }
      DK_BARRIER();
    }
    /* Candidates: at or above thr0 while the list is short, else better than the K-th best.
     * The test is workgroup-uniform; `any` lets a CPU skip the round with one vector compare. */
    {
      const int full = sh.ln == K;
      const float tv = full ? sh.lv[K - 1] : sh.thr0;
      const int ti = full ? sh.li[K - 1] : -1;
      int any = 0;
      DK_THREADS(tid) { any |= pmax[DK_PIDX(tid)] >= tv; }
      if (any) {
        DK_THREADS(tid) {
          const int p = DK_PIDX(tid);
          if (pmax[p] >= tv) {
            for (int u = 0; u < DK_U; ++u) {
              const int i = base + u * DK_T + tid;
              const float v = px[u][p];
              if (i < end && (full ? dk_better(v, i, tv, ti) : v >= tv)) {
                const int slot = DK_ATOMIC_INC(&sh.cn);
                sh.cv[slot] = v;
                sh.ci[slot] = i;
              }
            }
          }
        }
      }
    }
    DK_BARRIER();
    /* Merge list and candidates by rank; ranks are unique because keys are. */
    DK_THREADS(tid) {
      const int ln = sh.ln, total = sh.ln + sh.cn;
      for (int j = tid; j < total; j += DK_T) {
        const float v = j < ln ? sh.lv[j] : sh.cv[j - ln];
        const int id = j < ln ? sh.li[j] : sh.ci[j - ln];
        int rank = 0;
        for (int q = 0; q < ln; ++q) rank += dk_better(sh.lv[q], sh.li[q], v, id);
        for (int q = 0; q < sh.cn; ++q) rank += dk_better(sh.cv[q], sh.ci[q], v, id);
        if (rank < K) {
          sh.nv[rank] = v;
          sh.ni[rank] = id;
        }
      }
      if (tid == 0) sh.nl = total < K ? total : K;
    }
    DK_BARRIER();
    DK_THREADS(tid) {
      for (int j = tid; j < sh.nl; j += DK_T) {
        sh.lv[j] = sh.nv[j];
        sh.li[j] = sh.ni[j];
      }
      if (tid == 0) {
        sh.ln = sh.nl;
        sh.cn = 0;
        sh.thr0 = DK_NEG_INF;
      }
    }
    DK_BARRIER();
  }

  DK_THREADS(tid) {
    sh.rm[tid] = pm[DK_PIDX(tid)];
    sh.rs[tid] = ps[DK_PIDX(tid)];
  }
  DK_BARRIER();
  DK_LSE_TREE(sh)
  DK_THREADS(tid) {
    int* out = partial + ((long)row * C + chunk) * (2 * K + 2);
    for (int j = tid; j < K; j += DK_T) {
      out[j] = dk_to_bits(j < sh.ln ? sh.lv[j] : DK_NEG_INF);
      out[K + j] = j < sh.ln ? sh.li[j] : DK_PAD_ID;
    }
    if (tid == 0) {
      out[2 * K] = dk_to_bits(sh.rm[0]);
      out[2 * K + 1] = dk_to_bits(sh.rs[0]);
    }
  }
}

/* ---- stage 2: the C partial records of one row ---- */

DK_FN void dk_merge_workgroup(const int* partial, int* ids, float* logprobs, int K, int C, float inv_t,
                              int row) {
  DK_SHARED DkShared sh;
  const int* rec = partial + (long)row * C * (2 * K + 2);
  const int R = 2 * K + 2, total = C * K; /* total <= DK_CAND: topk.py bounds C */
  /* Gather the union (slot j % K of record j / K) into shared memory, and fold the logsumexps. */
  DK_THREADS(tid) {
    for (int j = tid; j < total; j += DK_T) {
      sh.cv[j] = dk_from_bits(rec[(j / K) * R + j % K]);
      sh.ci[j] = rec[(j / K) * R + K + j % K];
    }
    float m = DK_NEG_INF, s = 0.0f;
    for (int c = tid; c < C; c += DK_T) dk_lse_merge(&m, &s, dk_from_bits(rec[c * R + 2 * K]), dk_from_bits(rec[c * R + 2 * K + 1]));
    sh.rm[tid] = m;
    sh.rs[tid] = s;
  }
  DK_BARRIER();
  /* Rank the union. Padding keys are all equal, so ties go by union position to keep ranks unique. */
  DK_THREADS(tid) {
    for (int j = tid; j < total; j += DK_T) {
      const float v = sh.cv[j];
      const int id = sh.ci[j];
      int rank = 0;
      for (int q = 0; q < total; ++q) {
        rank += dk_better(sh.cv[q], sh.ci[q], v, id) || (sh.cv[q] == v && sh.ci[q] == id && q < j);
      }
      if (rank < K) {
        sh.nv[rank] = v;
        sh.ni[rank] = id;
      }
    }
  }
  DK_BARRIER();
  DK_LSE_TREE(sh)
  DK_THREADS(tid) {
    const float lse = sh.rm[0] + dk_log(sh.rs[0]);
    for (int j = tid; j < K; j += DK_T) {
      ids[(long)row * K + j] = sh.ni[j];
      logprobs[(long)row * K + j] = sh.nv[j] * inv_t - lse;
    }
  }
}

#endif /* DFLASH_TOPK_BODY_H */
