"""NumPy reference of the Gated DeltaNet step (kernels/gdn/): float32 in the kernel's order, so its bits are the kernel's.

Needs NumPy only. Every operation of gdn_body.h is repeated here on float32 arrays, in the same
order (the squares of a q or k row summed in increasing i; kv and o as 16 row-group partials, a
warp's four added ((p0 + p1) + p2) + p3 and the four warps' sums ((w0 + w1) + w2) + w3; exp and log the body's polynomials; 1/sqrt and divisions IEEE), so
bench/gdn_check.py expects the kernel's o and states bit for bit. tests/test_gdn.py checks this
reference against the eager rule of export/gdn.py (float32 rounding apart).
"""

from __future__ import annotations

import numpy as np

F = np.float32
WARPS, GROUPS = 4, 4  # gdn_body.h GD_WARPS, GD_GROUPS


def _pow2(e: np.ndarray) -> np.ndarray:
    return ((np.clip(e, -126, 127) + 127).astype(np.uint32) << np.uint32(23)).view(np.float32)


def expf(x) -> np.ndarray:
    """gdn_body.h `gd_exp`, elementwise on float32."""
    x = np.asarray(x, dtype=F)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        n = np.rint(x * F(1.44269504))
        r = (x - n * F(0.693359375)) - n * F(-2.12194440e-4)
        p = F(1.98412698e-4)
        for c in (1.38888889e-3, 8.33333333e-3, 4.16666667e-2, 1.66666667e-1, 0.5, 1.0, 1.0):
            p = p * r + F(c)
        e = np.where(np.isfinite(n), n, 0).astype(np.int32)
        y = np.where(e < -125, (p * _pow2(e + 100)) * _pow2(np.full_like(e, -100)),
                     np.where(e > 127, (p * _pow2(e - 1)) * F(2.0), p * _pow2(e)))
        y = np.where(x > F(88.72283), F(np.inf), np.where(x < F(-103.97208), F(0.0), y))
    return y.astype(F)


def logf(u) -> np.ndarray:
    """gdn_body.h `gd_log` (u >= 1, finite), elementwise on float32."""
    u = np.asarray(u, dtype=F)
    bits = u.view(np.uint32)
    e = ((bits >> np.uint32(23)) & np.uint32(255)).astype(np.int32) - 127
    m = ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(np.float32)
    big = m > F(1.41421356)
    m = np.where(big, m * F(0.5), m)
    e = np.where(big, e + 1, e)
    s = (m - F(1.0)) / (m + F(1.0))
    s2 = s * s
    p = F(9.09090909e-2)
    for c in (1.11111111e-1, 1.42857143e-1, 2.0e-1, 3.33333333e-1, 1.0):
        p = p * s2 + F(c)
    lm = (F(2.0) * s) * p
    fe = e.astype(F)
    return (fe * F(0.693359375) + (lm + fe * F(-2.12194440e-4))).astype(F)


def softplusf(x) -> np.ndarray:
    """gdn_body.h `gd_softplus`: x above 20 passes, else log1p(e^x) as log(1 + y) y / ((1 + y) - 1)."""
    x = np.asarray(x, dtype=F)
    y = expf(np.minimum(x, F(20.0)))
    u = y + F(1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lp = np.where(u == F(1.0), y, logf(u) * (y / (u - F(1.0))))
    return np.where(x > F(20.0), x, lp).astype(F)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 rounded to DTYPE ("f32": unchanged; "bf16": to nearest even) and back to float32."""
    x = np.asarray(x, dtype=F)
    if dtype == "f32":
        return x
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << np.uint32(16)
    return r.view(np.float32)


def gates(b, a, A_log, dt_bias, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """beta = dtype(sigmoid(b)) and the decay exp(g), g = -exp(A_log) softplus(a + dt_bias): b, a [S, T, Hv],
    A_log, dt_bias [Hv], all float32 holding DTYPE values. Returns (beta, decay) float32 [S, T, Hv]."""
    b, a, A_log, dt_bias = (np.asarray(x, dtype=F) for x in (b, a, A_log, dt_bias))
    beta = round_to(F(1.0) / (F(1.0) + expf(-b)), dtype)
    g = -expf(A_log) * softplusf(a + dt_bias)
    return beta, expf(g)


def gdn_step(mixed, b, a, A_log, dt_bias, slots, rows, layer: int, Hk: int, dk: int, dtype: str = "f32",
             eps: float = 1e-6, every_row: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's result: o float32 [S, T, Hv, dv] (values of DTYPE) and the slots after its writes.

    Args:
        mixed: [S, T, 2 Hk dk + Hv dv] (the conv's output: q | k | v); b, a: [S, T, Hv]; A_log,
            dt_bias: [Hv]: float32 arrays holding values of DTYPE ("f32" or "bf16").
        slots: float32 [streams, slots, n_gdn, Hv, dk, dv] (not modified: a copy is returned).
        rows: int [S, 2]: per stream the flat slot row of the state before row 0 (-1: zeros) and
            the flat row of slot 0 (row t's state goes to it + t; with every_row False only the
            last row's state is written, to it).
        layer: the GDN layer (index into n_gdn); Hk: key heads; dk: key head dim (a multiple of 4).

    Raises:
        ValueError: dk not a multiple of 4 (gdn_dispatch refuses it too).
    """
    if dk % 4 or dk < 4:
        raise ValueError(f"dk={dk} is not a multiple of 4 (the kernel's row quarters)")
    mixed = np.asarray(mixed, dtype=F)
    S, T, conv = mixed.shape
    Hv = np.shape(b)[2]
    dv = (conv - 2 * Hk * dk) // Hv
    rep = Hv // Hk
    out = np.array(slots, dtype=F, copy=True)
    flat = out.reshape(-1, *out.shape[2:])  # [R, n, Hv, dk, dv], a view
    qk = mixed[..., :2 * Hk * dk].reshape(S, T, 2, Hk, dk)
    ss = np.zeros((S, T, 2, Hk), F)
    for i in range(dk):
        ss = ss + qk[..., i] * qk[..., i]
    inv = F(1.0) / np.sqrt(ss + F(eps))
    q = (qk[:, :, 0] * inv[:, :, 0, :, None]) * F(dk ** -0.5)
    k = qk[:, :, 1] * inv[:, :, 1, :, None]
    heads = np.arange(Hv) // rep
    q, k = q[:, :, heads], k[:, :, heads]  # [S, T, Hv, dk]
    v = mixed[..., 2 * Hk * dk:].reshape(S, T, Hv, dv)
    beta, decay = gates(b, a, A_log, dt_bias, dtype)
    st = np.zeros((S, Hv, dk, dv), F)
    for s in range(S):
        if rows[s][0] >= 0:
            st[s] = flat[rows[s][0], layer]
    Q = dk // WARPS
    R = -(-Q // GROUPS)  # a lane's rows; the last groups' ranges stop at Q (an empty one is +0)
    o = np.zeros((S, T, Hv, dv), F)

    def grouped(x):  # sum_i st[i, j] x[i] as the kernel's 16 partials, a warp's four, then the warps'
        warps = []
        for w in range(WARPS):
            parts = []
            for gi in range(GROUPS):
                p = np.zeros((S, Hv, dv), F)
                for i in range(w * Q + gi * R, w * Q + min(gi * R + R, Q)):
                    p = p + st[:, :, i, :] * x[:, :, i, None]
                parts.append(p)
            warps.append(((parts[0] + parts[1]) + parts[2]) + parts[3])
        return ((warps[0] + warps[1]) + warps[2]) + warps[3]

    for t in range(T):
        st = st * decay[:, t, :, None, None]
        kv = grouped(k[:, t])
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        st = st + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = round_to(grouped(q[:, t]), dtype)
        if every_row or t == T - 1:
            for s in range(S):
                flat[rows[s][1] + (t if every_row else 0), layer] = st[s]
    return o, out
