"""RoPE tables of Qwen3.5-family attention: partial rotation, plain or YaRN frequencies.

As transformers 5.24.0 computes them (`Qwen3_5TextRotaryEmbedding`, whose multimodal sections
collapse to one position per token for text, and `modeling_rope_utils._compute_yarn_parameters`),
in float32, so that the tables agree with it bit for bit. The frequencies are export/rope.py's,
shared with Qwen3 targets and DFlash drafters.
"""

from __future__ import annotations

import torch

from dflash_iree.config_qwen35 import HybridConfig

from .rope import cos_sin, inv_freq


def rope_tables(positions: torch.Tensor, cfg: HybridConfig, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, T, rotary_dim] in dtype for int64 positions [S, T] (NEOX halves), scaled by YaRN's
    attention factor (1.0 for plain RoPE, multiplied all the same, as transformers does)."""
    # computed on positions' device: a CPU table moved there would export as prims.device_put,
    # which IREE's torch import cannot legalize
    freq, scale = inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.yarn, positions.device)
    return cos_sin(positions, freq, dtype, scale)
