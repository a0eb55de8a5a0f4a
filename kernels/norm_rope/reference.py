"""Float64 NumPy reference of the head norm + rope (kernels/norm_rope/dispatch.py): the per-head RMSNorm
(q_norm / k_norm) followed by RoPE, of Qwen3 (`apply_rope(rms_norm(x, w, eps), cos, sin)` of
export/qwen3.py) and of Qwen3.5's gated attention (`partial_rope(zc_rms_norm(x, w, eps), cos, sin)` of
export/qwen35.py), without their roundings to the dtype.

Needs NumPy only. The kernel repeats the eager ops' roundings, so on the GPU it is checked bit for bit
against those ops (bench/norm_rope_check.py); tests/test_norm_rope.py checks this reference against
them in float64.
"""

from __future__ import annotations

import numpy as np


def norm_rope(x: np.ndarray, w: np.ndarray, cos: np.ndarray, sin: np.ndarray, eps: float,
              zero_centered: bool = False, rotary_dim: int = 0) -> np.ndarray:
    """Each head of x [S, T, H, X], its first D = len(w) <= X values, normalized over D
    (x / sqrt(mean(x^2) + eps) * w, or * (1 + w) when zero_centered), then its first R dims rotated
    by cos, sin [S, T, R]: y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[R/2:R], x[:R/2]);
    the D - R after them pass through. R = rotary_dim, 0 for all D.
    Any float dtype in; float64 [S, T, H, D] out. Raises ValueError for an odd R or one above D."""
    D = w.shape[-1]
    R = rotary_dim or D
    if R % 2 or R > D:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {D}")
    x = x[..., :D].astype(np.float64)
    scale = w.astype(np.float64) + (1.0 if zero_centered else 0.0)
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale
    half = R // 2
    rotated = np.concatenate([-n[..., half:R], n[..., :half]], -1)
    c, s = cos.astype(np.float64)[:, :, None], sin.astype(np.float64)[:, :, None]
    return np.concatenate([n[..., :R] * c + rotated * s, n[..., R:]], -1)
