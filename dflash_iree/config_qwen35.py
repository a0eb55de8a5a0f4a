"""Read a Qwen3.5-family hybrid target's `config.json`: Gated DeltaNet + gated attention layers.

Torch-free. The authority is transformers' `models/qwen3_5/configuration_qwen3_5.py` (5.24.0):
- `model_type` "qwen3_5" is the vision-language wrapper: the text model's fields sit in
  `text_config`, its weights under `model.language_model.*`; the vision tower (`model.visual.*`)
  and the multi-token-prediction head (`mtp.*`) are not read, and loading says so once;
- `model_type` "qwen3_5_text" is the text-only model, weights under `model.*`;
- `layer_types` mixes "linear_attention" (Gated DeltaNet) and "full_attention" (gated attention);
  absent, every `full_attention_interval`-th layer (default 4) is attention;
- RoPE covers the first `partial_rotary_factor` of each attention head (default 0.25), plain or YaRN.

The MoE sibling (`qwen3_5_moe`) and Qwen3-Next (`qwen3_next`) are refused by `refuse_family`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from . import rope
from .config import TargetConfig
from .errors import DFlashError

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_text")
LAYER_TYPES = ("linear_attention", "full_attention")
REFUSED_FAMILIES = {
    "qwen3_5_moe": "Qwen3.5 mixture-of-experts targets are not implemented; use a dense Qwen3.5 model "
                   "(model_type qwen3_5 or qwen3_5_text)",
    "qwen3_next": "Qwen3-Next (fused in_proj_qkvz / in_proj_ba, MoE layers) is not implemented; use a dense "
                  "Qwen3.5 model (model_type qwen3_5 or qwen3_5_text) or a Qwen3 model",
}


def refuse_family(family, path: Path) -> None:
    """Raise DFlashError naming `path` for a family this engine refuses on purpose (MoE, Qwen3-Next)."""
    if family in REFUSED_FAMILIES:
        raise DFlashError(f"{path}: model_type '{family}': {REFUSED_FAMILIES[family]}")


def text_fields(raw: dict, path: Path) -> tuple[dict, str, list[str]]:
    """The text model's fields of a qwen3_5 or qwen3_5_text config, the weight prefix and the notes
    on what loading ignores.

    Returns:
        (text config dict, with the wrapper's dtype / tie flag where the text config lacks them;
        "model.language_model." or "model."; notes for the user).

    Raises:
        DFlashError: a wrapper without text_config, or one whose text_config is not qwen3_5_text.
    """
    if raw.get("model_type") == "qwen3_5_text":
        notes = ["mtp.* (the multi-token-prediction head) is not used"] if raw.get("mtp_num_hidden_layers") else []
        return raw, "model.", notes
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise DFlashError(f"{path}: model_type 'qwen3_5' needs a text_config object; none is there")
    inner = text.get("model_type", "qwen3_5_text")
    refuse_family(inner, path)
    if inner != "qwen3_5_text":
        raise DFlashError(f"{path}: text_config.model_type '{inner}' is not supported; expected qwen3_5_text")
    merged = dict(text)
    for key in ("torch_dtype", "dtype", "tie_word_embeddings", "eos_token_id"):
        if key not in merged and key in raw:
            merged[key] = raw[key]
    notes = []
    if "vision_config" in raw:
        notes.append("the vision tower (model.visual.*) is not loaded: text only")
    if text.get("mtp_num_hidden_layers"):
        notes.append("mtp.* (the multi-token-prediction head) is not used")
    return merged, "model.language_model.", notes


def layer_types(text: dict, n_layers: int, path: Path) -> tuple[str, ...]:
    """`layer_types`, or its default from `full_attention_interval` (transformers' __post_init__).

    Raises:
        DFlashError: a length other than num_hidden_layers, an unknown layer type, or no attention layer.
    """
    types = text.get("layer_types")
    if types is None:
        every = int(text.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise DFlashError(f"{path}: layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
    for t in types:
        if t not in LAYER_TYPES:
            raise DFlashError(f"{path}: layer_types entry '{t}' is not supported; use {' or '.join(LAYER_TYPES)}")
    return tuple(types)


def note_ignored(path: Path, notes: list[str]) -> None:
    """One line on load naming what of the checkpoint is not used (vision tower, MTP head)."""
    if notes:
        from .guard import DFlashWarning  # guard imports the config module

        warnings.warn(f"{path}: {'; '.join(notes)}", DFlashWarning, stacklevel=3)


@dataclass(frozen=True)
class HybridConfig(TargetConfig):
    """A Qwen3.5-family hybrid target: `TargetConfig`'s fields (the attention layers' shape, the
    MLP, vocabulary) plus the Gated DeltaNet layers' and the partial, possibly YaRN, RoPE."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    weight_prefix: str = "model."  # "model.language_model." for the qwen3_5 wrapper

    family = "qwen3_5"

    @property
    def rotary_dim(self) -> int:
        """Rotated dims of each attention head (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v of in_proj_qkv."""
        return 2 * self.key_dim + self.value_dim

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    def state_shapes(self, streams: int = 1) -> dict:
        """The recurrent state of one step: name -> (shape, dtype), dtype "f32" or the model's."""
        n = len(self.gdn_layers)
        return {
            "gdn_state": ((streams, n, self.linear_num_value_heads, self.linear_key_head_dim,
                           self.linear_value_head_dim), "f32"),
            "conv_state": ((streams, n, self.linear_conv_kernel_dim - 1, self.conv_dim), self.dtype),
        }


def load_hybrid_config(folder: Path, raw: dict, eos_ids: tuple[int, ...]) -> HybridConfig:
    """A `HybridConfig` of a qwen3_5 or qwen3_5_text `config.json` (already read as `raw`).

    Raises:
        DFlashError: a missing field, an unknown layer type, an activation other than silu, an
            unsupported dtype or RoPE type, or MoE fields.
    """
    from .config import _dtype, _need

    path = folder / "config.json"
    text, prefix, notes = text_fields(raw, path)
    if text.get("num_experts"):
        refuse_family("qwen3_5_moe", path)
    if text.get("hidden_act", "silu") != "silu":
        raise DFlashError(f"{path}: hidden_act '{text['hidden_act']}' is not supported; Qwen3.5 layers use silu")
    n_layers = int(_need(text, "num_hidden_layers", path))
    heads = int(_need(text, "num_attention_heads", path))
    hidden = int(_need(text, "hidden_size", path))
    max_pos = int(text.get("max_position_embeddings", 32768))
    params, _ = rope.rope_dict(text)
    theta = rope.rope_theta(text, path)
    partial = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    head_dim = int(text.get("head_dim") or hidden // heads)
    if not 0 < int(head_dim * partial) <= head_dim or int(head_dim * partial) % 2:
        raise DFlashError(f"{path}: partial_rotary_factor {partial} rotates {int(head_dim * partial)} of "
                          f"{head_dim} dims; it must rotate an even number from 2 to head_dim")
    if not eos_ids and text.get("eos_token_id") is not None:
        value = text["eos_token_id"]
        eos_ids = tuple(int(v) for v in (value if isinstance(value, list) else [value]))
    hk, hv = int(text.get("linear_num_key_heads", 16)), int(text.get("linear_num_value_heads", 32))
    if hv % hk:
        raise DFlashError(f"{path}: linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}")
    note_ignored(path, notes)
    return HybridConfig(
        hidden_size=hidden,
        intermediate_size=int(_need(text, "intermediate_size", path)),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        attention_bias=bool(text.get("attention_bias", False)),
        vocab_size=int(_need(text, "vocab_size", path)),
        dtype=_dtype(text, path),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        max_position_embeddings=max_pos,
        folder=str(folder),
        raw=raw,
        layer_types=layer_types(text, n_layers, path),
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        partial_rotary_factor=partial,
        yarn=rope.rope_scaling(text, path),
        weight_prefix=prefix,
    )
