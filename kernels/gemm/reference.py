"""Float64 NumPy reference and parity score for the skinny GEMM y[M, N] = x[M, K] . W[N, K]^T (bf16).

The kernel sums in f32 in its own (fixed) k order and rounds once to bf16. Against the float64 sum
rounded to bf16, an output is correct when it is within 1 bf16 ulp; where the sum cancels (|y| below
2^-8 of sum_k |x_k w_k|) the f32 summation order alone moves the bf16 result by more ulps, so there
it must be within 2^-16 * sum_k |x_k w_k| instead. bench/gemm_bench.py applies the same rule on the
GPU (against torch's float32 sums).
"""

from __future__ import annotations

import numpy as np


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequantize_q4(q: np.ndarray, s_bits: np.ndarray, o: np.ndarray | None, fmt: str, group: int, N: int,
                  K: int) -> np.ndarray:
    """bf16 bits [N, K] of a packed 4-bit weight (kernels/gemm `Q4`), by export/quantized.py's rule:
    w = s * q + b ("mlx", o = the biases' bf16 bits [N, K / group]), s * (q - 8) ("sym", o None) or
    s * (q - z) ("zp", o = int32 zero points [ceil(N / 8), K / group] packed along N), in float32
    (one rounding: s * q is exact), then rounded to bf16. q: int32 [N, K / 8], value j of a word in
    bits 4j..4j+3; s_bits: the scales' bf16 bits [N, K / group]."""
    u = ((q.view(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).reshape(N, K // group, group)
    s = bf16_to_f32(s_bits)[..., None]
    if fmt == "mlx":
        w = s * u.astype(np.float32) + bf16_to_f32(o)[..., None]
    else:
        if fmt == "sym":
            z = np.float32(8)
        else:
            z = ((o.view(np.uint32).T[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).reshape(K // group, -1).T[:N]
            z = z.astype(np.float32)[..., None]
        w = (u.astype(np.float32) - z) * s
    return bf16_bits(w.astype(np.float32).reshape(N, K))


def q4_k_order(K: int, splits: int, fetch_chunks: int, pair_order: int = 0, chunk: int = 32,
               lane_k: int = 8) -> np.ndarray:
    """The k order of the 4-bit kernel as the bf16 kernel's: int64 [K], order[j] = the column of x and W
    that the 4-bit kernel gives the matrix instructions where the bf16 kernel gives column j. So the
    4-bit y equals, bit for bit, the bf16 kernel's y on x[:, order] and the dequantized W[:, order].

    The 4-bit kernel fetches `fetch_chunks` chunks of `chunk` k-values at a time (gemm_body.h GM_QSC,
    `dispatch.q4_fetch_chunks`): in each whole fetch of each split (K / splits k-values) lane group t
    (of chunk / lane_k) takes the fetch's k-values kb + t * fetch_chunks * lane_k .. in one load, and
    chunk h of the fetch its k-values kb + t * fetch_chunks * lane_k + h * lane_k .. + lane_k - 1, where
    the bf16 kernel's chunk kb + h * chunk gives that lane group kb + h * chunk + t * lane_k ... The rest
    of a split (under a fetch) is in the bf16 order, as is everything when fetch_chunks is 1.
    `pair_order` 1 (gemm_gpu.cu `gm_mma_q`, `dispatch.q4_pair_order`): within a whole fetch, a lane
    group's lane_k = 8 k-values j = 0..7 meet the matrix instructions where the bf16 kernel puts its
    k-values 0, 1, 4, 5, 2, 3, 6, 7 (the first instruction takes the pairs j = 0, 1 and 4, 5).
    """
    order = np.arange(K)
    if fetch_chunks == 1:
        return order
    KR, span, groups = K // splits, fetch_chunks * chunk, chunk // lane_k
    within = np.array([0, 1, 4, 5, 2, 3, 6, 7]) if pair_order else np.arange(lane_k)
    for s in range(splits):
        for kb in range(s * KR, s * KR + KR // span * span, span):
            for h in range(fetch_chunks):
                for t in range(groups):
                    src = kb + t * fetch_chunks * lane_k + h * lane_k
                    order[kb + h * chunk + t * lane_k: kb + h * chunk + (t + 1) * lane_k] = src + within
    return order


def reference(x_bits: np.ndarray, w_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float64 y [M, N], float64 scale = |x| . |W|^T) from bf16 bit patterns x [M, K], w [N, K]."""
    x = bf16_to_f32(x_bits).astype(np.float64)
    w = bf16_to_f32(w_bits).astype(np.float64)
    return x @ w.T, np.abs(x) @ np.abs(w).T


def ulp_distance(a_bits: np.ndarray, b_bits: np.ndarray) -> np.ndarray:
    """Distance in bf16 ulps between two arrays of bf16 bit patterns (sign-magnitude ordered)."""
    def order(b):
        v = np.asarray(b, dtype=np.uint16).astype(np.int64)
        return np.where(v >= 0x8000, 0x8000 - v, v)
    return np.abs(order(a_bits) - order(b_bits))


def score(y_bits: np.ndarray, x_bits: np.ndarray, w_bits: np.ndarray) -> dict:
    """Parity of kernel output y (bf16 bits [M, N]) for inputs x, w (bf16 bits).

    Returns max_ulp (over well-conditioned outputs), bad (outputs breaking the rule in the module
    docstring) and n (outputs)."""
    ref, scale = reference(x_bits, w_bits)
    ref_bits = bf16_bits(ref.astype(np.float32))
    ul = ulp_distance(y_bits, ref_bits)
    well = np.abs(ref) >= scale * 2.0**-8
    err = np.abs(bf16_to_f32(y_bits).astype(np.float64) - ref)
    bad = (well & (ul > 1)) | (~well & (ul > 1) & (err > scale * 2.0**-16))
    return {"max_ulp": int(ul[well].max()) if well.any() else 0, "bad": int(bad.sum()), "n": int(ul.size)}
