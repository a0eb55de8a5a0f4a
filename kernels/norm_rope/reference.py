"""Float64 NumPy reference of the head norm + rope (kernels/norm_rope/dispatch.py): Qwen3's per-head
RMSNorm (q_norm / k_norm) followed by RoPE, `apply_rope(rms_norm(x, w, eps), cos, sin)` of
export/qwen3.py without its roundings to the dtype.

Needs NumPy only. The kernel repeats the eager ops' roundings, so on the GPU it is checked bit for bit
against those ops (bench/norm_rope_check.py); tests/test_norm_rope.py checks this reference against
them in float64.
"""

from __future__ import annotations

import numpy as np


def norm_rope(x: np.ndarray, w: np.ndarray, cos: np.ndarray, sin: np.ndarray, eps: float) -> np.ndarray:
    """x [S, T, H, D] normalized over D (x / sqrt(mean(x^2) + eps) * w), then rotated by cos, sin
    [S, T, D]: y = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]).
    Any float dtype in; float64 [S, T, H, D] out."""
    x = x.astype(np.float64)
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w.astype(np.float64)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-n[..., half:], n[..., :half]], -1)
    return n * cos.astype(np.float64)[:, :, None] + rotated * sin.astype(np.float64)[:, :, None]
