"""Float64 NumPy reference of the block attention (kernels/attention/dispatch.py, head-major form),
and the gated output's bf16 roundings.

Needs NumPy only. The kernel's bf16 result is checked against this on the GPU by
bench/attention_bench.py; tests/test_attention.py checks this reference against torch's
scaled_dot_product_attention, and the gated rule against eager bf16 torch.
"""

from __future__ import annotations

import numpy as np

from ..gemm.reference import bf16_bits, bf16_to_f32


def bf16_round(a: np.ndarray) -> np.ndarray:
    """a rounded to float32, then to bf16 (nearest even), as float32 values."""
    return bf16_to_f32(bf16_bits(np.asarray(a, dtype=np.float32)))


def sigmoid_bf16(gate: np.ndarray) -> np.ndarray:
    """bf16(sigmoid(x)) of bf16 values x (float32 values): sigmoid in float64, rounded to f32, then to
    bf16, as eager torch's bf16 sigmoid (f32 arithmetic, one rounding to bf16). float32 values."""
    g = np.asarray(gate, dtype=np.float64)
    with np.errstate(over="ignore"):
        return bf16_round(1.0 / (1.0 + np.exp(-g)))


def gate_output(o: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """The gated output's roundings, bf16(f32(bf16(o)) * f32(bf16(sigmoid(gate)))): eager bf16's
    `attention * torch.sigmoid(gate)` given the attention o (any float dtype, rounded to f32 and then
    bf16, as the kernel rounds its f32 result) and the gate's bf16 values (float32), of one shape.
    Returns float32 values (bf16: `bits` gives their patterns). The product of two bf16 values is
    exact in f32, so it rounds once."""
    return bf16_round(bf16_round(o) * sigmoid_bf16(gate))


def bits(a: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 values that are bf16 values (or rounded to them)."""
    return bf16_bits(np.asarray(a, dtype=np.float32))


def attention(q: np.ndarray, cache: np.ndarray, mask: np.ndarray, layer: int, scale: float | None = None,
              gate: np.ndarray | None = None) -> np.ndarray:
    """softmax(q k^T * scale, mask) v over the first N = mask.shape[-1] cache rows of `layer`, times
    sigmoid(gate) with the bf16 roundings (`gate_output`) when a gate is given.

    q: [S, Hkv, R, D] (the R query rows of each KV head); cache: [S, L, 2, C, Hkv * D] (keys at
    [:, layer, 0], values at [:, layer, 1], head h at columns [h*D, (h+1)*D)); mask: bool
    [S, 1, R, N], True where a key is visible (every row sees at least one); scale: default D^-0.5.
    Any float dtype in (bf16 as float32: kernels/gemm/reference.py `bf16_to_f32`). gate: None, or
    the gate's bf16 values [S, Hkv, R, D] (float32; row r of KV head h is query head h * g + r % g
    of token r // g, as q's rows). Returns float64 [S, Hkv, R, D]; with a gate, float32 bf16 values.
    Raises ValueError for a gate of another shape than q.
    """
    if gate is not None and np.shape(gate) != np.shape(q):
        raise ValueError(f"gate {np.shape(gate)} is not of q's shape {np.shape(q)}")
    S, H, R, D = q.shape
    N = mask.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    rows = cache[:, layer, :, :N].astype(np.float64).reshape(S, 2, N, H, D).transpose(0, 1, 3, 2, 4)
    k, v = rows[:, 0], rows[:, 1]  # [S, H, N, D]
    scores = np.einsum("shrd,shnd->shrn", q.astype(np.float64), k) * scale
    scores = np.where(mask.astype(bool), scores, -np.inf)  # [S, 1, R, N] broadcasts over the heads
    p = np.exp(scores - scores.max(-1, keepdims=True))
    o = np.einsum("shrn,shnd->shrd", p / p.sum(-1, keepdims=True), v)
    return o if gate is None else gate_output(o, gate)
