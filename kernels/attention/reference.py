"""Float64 NumPy reference of the block attention (kernels/attention/dispatch.py, head-major form).

Needs NumPy only. The kernel's bf16 result is checked against this on the GPU by
bench/attention_bench.py (against torch's float32 attention there); tests/test_attention.py checks
this reference against torch's scaled_dot_product_attention.
"""

from __future__ import annotations

import numpy as np


def attention(q: np.ndarray, cache: np.ndarray, mask: np.ndarray, layer: int, scale: float | None = None) -> np.ndarray:
    """softmax(q k^T * scale, mask) v over the first N = mask.shape[-1] cache rows of `layer`.

    q: [S, Hkv, R, D] (the R query rows of each KV head); cache: [S, L, 2, C, Hkv * D] (keys at
    [:, layer, 0], values at [:, layer, 1], head h at columns [h*D, (h+1)*D)); mask: bool
    [S, 1, R, N], True where a key is visible (every row sees at least one); scale: default D^-0.5.
    Any float dtype in (bf16 as float32: kernels/gemm/reference.py `bf16_to_f32`). Returns float64
    [S, Hkv, R, D].
    """
    S, H, R, D = q.shape
    N = mask.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    rows = cache[:, layer, :, :N].astype(np.float64).reshape(S, 2, N, H, D).transpose(0, 1, 3, 2, 4)
    k, v = rows[:, 0], rows[:, 1]  # [S, H, N, D]
    scores = np.einsum("shrd,shnd->shrn", q.astype(np.float64), k) * scale
    scores = np.where(mask.astype(bool), scores, -np.inf)  # [S, 1, R, N] broadcasts over the heads
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("shrn,shnd->shrd", p / p.sum(-1, keepdims=True), v)
