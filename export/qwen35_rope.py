"""RoPE tables of Qwen3.5-family attention: partial rotation, plain or YaRN frequencies.

As transformers 5.24.0 computes them (`Qwen3_5TextRotaryEmbedding`, whose multimodal sections
collapse to one position per token for text, and `modeling_rope_utils._compute_yarn_parameters`),
in float32, so that the tables agree with it bit for bit.
"""

from __future__ import annotations

import math

import torch

from dflash_iree.config_qwen35 import HybridConfig, YaRN


def yarn_inv_freq(yarn: YaRN, dim: int, theta: float, device=None) -> torch.Tensor:
    """float32 [dim / 2]: YaRN's blend of interpolated (1 / (factor * theta^(2i/dim))) and original
    frequencies, a linear ramp between the dims turning beta_fast and beta_slow times over the
    original context (Peng et al. 2023, arXiv:2309.00071, §3.2)."""

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


def inv_freq(cfg: HybridConfig, device=None) -> tuple[torch.Tensor, float]:
    """float32 [rotary_dim / 2] inverse frequencies (on `device`) and the factor cos and sin are scaled by."""
    dim = cfg.rotary_dim
    if cfg.yarn is None:
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)), 1.0
    return yarn_inv_freq(cfg.yarn, dim, cfg.rope_theta, device), cfg.yarn.cos_sin_scale()


def rope_tables(positions: torch.Tensor, cfg: HybridConfig, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, T, rotary_dim] in dtype for int64 positions [S, T] (NEOX halves)."""
    # computed on positions' device: a CPU table moved there would export as prims.device_put,
    # which IREE's torch import cannot legalize
    freq, scale = inv_freq(cfg, positions.device)
    freqs = positions[..., None].to(torch.float32) * freq
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
