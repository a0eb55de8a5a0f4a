"""The RoPE fields of a `config.json`: rope_theta and, when set, YaRN scaling.

Torch-free; shared by the Qwen3 target and drafter reader (config.py) and the Qwen3.5 hybrid reader
(config_qwen35.py). The tables themselves are computed in torch by export/rope.py. Read as
transformers 5.24.0 reads them (`PreTrainedConfig.convert_rope_params_to_dict` and
`standardize_rope_params`, `modeling_rope_utils._compute_yarn_parameters`):
- the dict is `rope_scaling` when set (the older spelling, `type` or `rope_type`), else
  `rope_parameters` (transformers >= 5, with `rope_theta` inside);
- rope_theta: the dict's, else `rope_parameters.rope_theta`, else the top-level `rope_theta`;
- YaRN's original context: a top-level `original_max_position_embeddings` first, then the dict's,
  then `max_position_embeddings` (default 32768, Qwen3Config's and Qwen3_5TextConfig's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .errors import DFlashError

DEFAULT_MAX_POSITIONS = 32768  # transformers' Qwen3Config / Qwen3_5TextConfig max_position_embeddings


@dataclass(frozen=True)
class YaRN:
    """YaRN RoPE scaling (Peng et al. 2023, arXiv:2309.00071): the fields transformers'
    `modeling_rope_utils._compute_yarn_parameters` reads. The frequencies are computed in torch,
    in float32 as there (export/rope.py `yarn_inv_freq`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by (transformers' `attention_scaling`): `attention_factor`
        when set, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
        0.1 ln(factor) + 1 (1 for factor <= 1)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def m(scale, ms=1.0):
            return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim))
        return m(self.factor)


def rope_dict(cfg: dict) -> tuple[dict, str]:
    """The RoPE dict transformers reads from a config's fields and its name: `rope_scaling` when
    set, else `rope_parameters` ({} and "rope_parameters" when neither is)."""
    if cfg.get("rope_scaling"):
        return dict(cfg["rope_scaling"]), "rope_scaling"
    return dict(cfg.get("rope_parameters") or {}), "rope_parameters"


def rope_scaling(cfg: dict, path: Path) -> YaRN | None:
    """The RoPE scaling of a config's fields (a config.json, or a wrapper's text_config): None for
    plain RoPE (no dict, or rope_type / type "default").

    Raises:
        DFlashError: a rope_type other than default and yarn (linear, dynamic, llama3, longrope, ...),
            or a yarn dict without `factor`; one line naming `path` and the field.
    """
    params, where = rope_dict(cfg)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise DFlashError(f"{path}: {where}.rope_type '{kind}' is not implemented (plain RoPE and yarn are); "
                          "use a checkpoint with one of those")
    if params.get("factor") is None:
        raise DFlashError(f"{path}: {where}.factor is missing; YaRN needs it")
    for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise DFlashError(f"{path}: {where}.{key} is {value!r}; it must be a number > 0")
    original = (cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or cfg.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS)
    if isinstance(original, float) and original.is_integer():
        original = int(original)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise DFlashError(f"{path}: {where}.original_max_position_embeddings is {original!r}; it must be an "
                          "integer >= 1")
    return YaRN(
        factor=float(params["factor"]),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), truncate=bool(params.get("truncate", True)))


def rope_theta(cfg: dict, path: Path) -> float:
    """rope_theta of a config's fields: the RoPE dict's (`rope_dict`), else
    `rope_parameters.rope_theta`, else the top-level field.

    Raises:
        DFlashError: none of them is set.
    """
    params, _ = rope_dict(cfg)
    theta = params.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta")))
    if theta is None:
        raise DFlashError(f"{path}: neither 'rope_theta' nor 'rope_parameters.rope_theta' is set")
    return float(theta)
