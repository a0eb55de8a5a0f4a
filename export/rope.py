"""RoPE tables: the inverse frequencies, plain or YaRN, and the cos / sin tables of positions.

As transformers 5.24.0 computes them (`Qwen3RotaryEmbedding`, `Qwen3_5TextRotaryEmbedding` and
`modeling_rope_utils._compute_yarn_parameters`), in float32, so that the tables agree with it bit for
bit (tests/test_yarn.py, tests/test_qwen35.py). Qwen3 targets and DFlash drafters rotate the whole
head (`rope_tables`); Qwen3.5's attention rotates its first `rotary_dim` dims (export/qwen35_rope.py).
The YaRN fields are read by dflash_iree/rope.py.
"""

from __future__ import annotations

import math

import torch

from dflash_iree.rope import YaRN


def yarn_inv_freq(yarn: YaRN, dim: int, theta: float, device=None) -> torch.Tensor:
    """float32 [dim / 2] inverse frequencies (on `device`): YaRN's blend of interpolated
    (1 / (factor * theta^(2i/dim))) and original frequencies, a linear ramp between the dims turning
    beta_fast and beta_slow times over the original context (Peng et al. 2023, arXiv:2309.00071,
    §3.2; transformers `modeling_rope_utils._compute_yarn_parameters`, op for op)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def inv_freq(dim: int, theta: float, yarn: YaRN | None = None, device=None) -> tuple[torch.Tensor, float]:
    """float32 [dim / 2] inverse frequencies of `dim` rotated dims (on `device`) and the factor cos
    and sin are scaled by: plain RoPE (1 / theta^(2i/dim), 1.0) when `yarn` is None, else
    (`yarn_inv_freq`, `YaRN.cos_sin_scale()`, transformers' `attention_scaling`)."""
    if yarn is None:
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)), 1.0
    return yarn_inv_freq(yarn, dim, theta, device), yarn.cos_sin_scale()


def cos_sin(positions: torch.Tensor, freq: torch.Tensor, dtype, scale: float | None = None):
    """cos, sin [*positions.shape, 2 * len(freq)] in `dtype` of int64 `positions` at the float32
    inverse frequencies `freq` (NEOX layout: both halves share a frequency), computed in float32 and
    multiplied by `scale` before the cast unless it is None."""
    freqs = positions[..., None].to(torch.float32) * freq
    emb = torch.cat([freqs, freqs], -1)
    if scale is None:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype,
                yarn: YaRN | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, T, head_dim] in `dtype` for int64 positions [S, T], the whole head rotated (Qwen3
    targets, DFlash drafters), plain or YaRN-scaled RoPE (`inv_freq`), computed on positions' device.

    Plain RoPE (`yarn` None) exports the same graph as before YaRN existed (no scale multiply); YaRN
    multiplies cos and sin by `YaRN.cos_sin_scale()` in float32, as transformers' `Qwen3RotaryEmbedding`.
    """
    # on positions' device: a CPU table moved there would export as prims.device_put, which IREE's
    # torch import cannot legalize
    freq, scale = inv_freq(head_dim, theta, yarn, positions.device)
    return cos_sin(positions, freq, dtype, None if yarn is None else scale)
