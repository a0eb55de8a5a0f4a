"""Read and check the two `config.json` files: a Qwen3 target and a DFlash drafter.

Torch-free, so that the compiler front end and the runtime share one reading of a checkpoint
folder. Field names follow Hugging Face's Qwen3 config and the published DFlash format
(z-lab/dflash `dflash/model.py`): `dflash_config.target_layer_ids`, `dflash_config.mask_token_id`,
`block_size` at the top level or inside `dflash_config`, `num_target_layers`. RoPE: rope_theta, and
YaRN scaling when `rope_scaling` / `rope_parameters` asks for it (dflash_iree/rope.py; other types are
refused).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import dflash2, quant, rope, validate
from .dflash2 import DFlash2Shape
from .errors import DFlashError
from .manifest import CONFIG_DTYPES as DTYPES  # a config's torch_dtype -> short name
from .rope import YaRN

SUPPORTED_FAMILIES = ("qwen3",)  # drafters' layers; targets also qwen3_5 / qwen3_5_text (config_qwen35.py)


@dataclass(frozen=True)
class LayerShape:
    """The Qwen3 decoder-layer fields shared by target and drafter."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    vocab_size: int
    dtype: str  # "bf16" | "f16" | "f32": the checkpoint's torch_dtype
    yarn: YaRN | None = None  # YaRN RoPE scaling (dflash_iree/rope.py); None: plain RoPE

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True)
class TargetConfig(LayerShape):
    """A Qwen3 dense target, read from its HF `config.json` (and `generation_config.json`)."""

    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 40960
    folder: str = ""
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def context_limit(self) -> tuple[int, str]:
        """The longest context (tokens) to build for, and what sets it (for a refusal's message):
        max_position_embeddings, or with YaRN original_max_position_embeddings x factor when that is
        larger (vLLM's max_model_len rule for yarn: Qwen3's 32768 x 4 = 131072 over a
        max_position_embeddings of 40960)."""
        if self.yarn is not None:
            scaled = int(self.yarn.original_max_position_embeddings * self.yarn.factor)
            if scaled > self.max_position_embeddings:
                return scaled, (f"YaRN's original_max_position_embeddings {self.yarn.original_max_position_embeddings}"
                                f" x factor {self.yarn.factor:g}")
        return self.max_position_embeddings, "the target's max_position_embeddings"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw")
        return d


@dataclass(frozen=True)
class DrafterConfig(LayerShape):
    """A DFlash drafter: a small Qwen3-layer stack fed by taps of the target's hidden states."""

    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = ()
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0  # logits * m, then the softcap (both optional, for v1 too)
    final_logit_softcapping: float = 0.0  # cap > 0: logits = tanh(logits / cap) * cap; 0: none
    dflash2: DFlash2Shape | None = None  # the DFlash2 fields (dflash_iree/dflash2.py); None: a v1 drafter
    # per layer: 0 full_attention (bidirectional in the block), W sliding_attention (causal, window W);
    # () when every layer is full_attention (export/draft_window.py)
    layer_windows: tuple[int, ...] = ()
    folder: str = ""
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def block(self, requested: int | None, option: str = "block_size") -> int:
        """The verify block to build for: `requested`, or the trained block_size when None.

        The one range check of a block size: compile's plan and the eager loader both ask here, and
        what they return travels on (Plan, DFlashDrafter, the manifest) without being checked again.
        option: the name to refuse it by ("--block-size" from the command line).

        Raises:
            DFlashError: not an integer, or outside 2..block_size (a block holds the anchor and at
                least one draft; the drafter was trained to fill at most block_size).
        """
        if requested is None:
            return self.block_size
        return validate.integer(requested, option, 2, self.block_size, fix=" (the drafter's trained block_size)")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw")
        return d


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise DFlashError(f"{what}: {path} does not exist; point to a Hugging Face checkpoint folder that has a config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{what}: {path} is not valid JSON ({e})") from None


def config_hash(raw: dict) -> str:
    """sha256 of a config dict in canonical JSON form (sorted keys): names a config in manifests."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def _need(raw: dict, key: str, path: Path):
    if key not in raw:
        raise DFlashError(f"{path}: field '{key}' is missing")
    return raw[key]


def _dtype(raw: dict, path: Path) -> str:
    name = raw.get("torch_dtype", raw.get("dtype", "float32"))
    if name not in DTYPES:
        raise DFlashError(f"{path}: torch_dtype '{name}' is not supported; use bfloat16, float16 or float32")
    return DTYPES[name]


def _layer_types(raw: dict, path: Path) -> list[str]:
    """Each layer's attention type: `layer_types`, or, when absent, Hugging Face Qwen3Config's rule
    (sliding_attention for layers >= max_window_layers when use_sliding_window is set)."""
    n = int(_need(raw, "num_hidden_layers", path))
    types = raw.get("layer_types")
    if types is None:
        slide = bool(raw.get("use_sliding_window")) and raw.get("sliding_window") is not None
        first = int(raw.get("max_window_layers", 28))
        return ["sliding_attention" if slide and i >= first else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise DFlashError(f"{path}: layer_types must list one type per layer ({n}), got {types!r}")
    bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise DFlashError(f"{path}: layer_types {bad} are not supported; use full_attention or sliding_attention")
    return types


def _layer_windows(raw: dict, path: Path) -> tuple[int, ...]:
    """A drafter's per-layer window: 0 for full_attention, sliding_window for sliding_attention."""
    types = _layer_types(raw, path)
    if "sliding_attention" not in types:
        return ()
    w = raw.get("sliding_window")
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise DFlashError(f"{path}: sliding_window is {w!r}; a sliding_attention layer needs an integer window >= 1")
    return tuple(w if t == "sliding_attention" else 0 for t in types)


def _layer_shape(raw: dict, path: Path, sliding: bool = False) -> dict:
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise DFlashError(
            f"{path}: model_type '{family}' is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if not sliding and "sliding_attention" in _layer_types(raw, path):
        raise DFlashError(f"{path}: sliding-window attention layers are implemented for drafters only; "
                          "use a target whose layers are all full_attention")
    heads = int(_need(raw, "num_attention_heads", path))
    hidden = int(_need(raw, "hidden_size", path))
    return dict(
        hidden_size=hidden,
        intermediate_size=int(_need(raw, "intermediate_size", path)),
        num_hidden_layers=int(_need(raw, "num_hidden_layers", path)),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.rope_theta(raw, path),
        attention_bias=bool(raw.get("attention_bias", False)),
        vocab_size=int(_need(raw, "vocab_size", path)),
        dtype=_dtype(raw, path),
        yarn=rope.rope_scaling(raw, path),
    )


def _eos_ids(folder: Path, raw: dict) -> tuple[int, ...]:
    gen = folder / "generation_config.json"
    value = None
    if gen.is_file():
        value = _read_json(gen, "target generation config").get("eos_token_id")
    if value is None:
        value = raw.get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def is_drafter_config(raw: dict) -> bool:
    """Whether a parsed config.json is a DFlash drafter's (a `dflash_config` block, or the
    `DFlashDraftModel` architecture) rather than a target's."""
    return "dflash_config" in raw or "DFlashDraftModel" in (raw.get("architectures") or [])


def load_target_config(folder: str | Path) -> TargetConfig:
    """Read a Qwen3 target's `config.json` (and `generation_config.json` for eos ids); a Qwen3.5
    hybrid's (model_type qwen3_5 or qwen3_5_text) gives a `config_qwen35.HybridConfig`.

    Raises:
        DFlashError: the folder or config.json is missing, the family is not qwen3,
            or a field is missing or unsupported (RoPE scaling other than YaRN, sliding-window layers, dtype,
            a 4-bit format dflash_iree/quant.py does not read).
    """
    folder = Path(folder)
    path = folder / "config.json"
    quant.refuse_gguf(folder)
    raw = _read_json(path, "target")
    quant.read_format(raw, path)  # a 4-bit format it cannot read is refused here, by name
    if is_drafter_config(raw):
        raise DFlashError(f"{path}: this is a DFlash drafter config; pass it as the drafter and a Qwen3 or "
                          "Qwen3.5-family model as the target")
    from . import config_qwen35  # imports this module

    config_qwen35.refuse_family(raw.get("model_type"), path)
    if raw.get("model_type") in config_qwen35.HYBRID_FAMILIES:
        return config_qwen35.load_hybrid_config(folder, raw, _eos_ids(folder, raw))
    return TargetConfig(
        **_layer_shape(raw, path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(folder, raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
        folder=str(folder),
        raw=raw,
    )


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The published fallback for drafters whose config has no `target_layer_ids`.

    One tap at L//2 when `num_taps` == 1; otherwise `num_taps` ids spread evenly (rounded) from 1 to
    L-3 (z-lab/dflash `build_target_layer_ids`; [1, 9, 17, 25, 33] for L=36, n=5).
    """
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_taps - 1))) for i in range(num_taps)]


def _number(dcfg: dict, raw: dict, key: str, default: float, path: Path) -> float:
    """An optional float field of dflash_config (or the top level); null reads as the default."""
    value = dcfg.get(key, raw.get(key))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        raise DFlashError(f"{path}: dflash_config.{key} is {value!r}; it must be a number >= 0")
    return float(value)


def load_drafter_config(folder: str | Path, target: TargetConfig) -> DrafterConfig:
    """Read a DFlash drafter's `config.json` and check that it fits `target`.

    Raises:
        DFlashError: the config is missing or unsupported (an unknown layer type, a sliding
            layer without an integer sliding_window, an explicit is_causal; a DFlash2 drafter's
            fields, dflash_iree/dflash2.py `read_dflash2`),
            `mask_token_id` is absent, or the drafter does not fit the target (hidden size,
            vocabulary, tap ids out of range, `num_target_layers`), naming both values.
    """
    folder = Path(folder)
    path = folder / "config.json"
    quant.refuse_gguf(folder)
    raw = _read_json(path, "drafter")
    if raw.get("model_type") in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_next"):
        raise DFlashError(f"{path}: this is a {raw['model_type']} model, not a DFlash drafter (its MTP head is not "
                          "supported as a drafter); pass a DFlash drafter as the drafter")
    quant.read_format(raw, path)
    dcfg = raw.get("dflash_config") or {}
    shape = _layer_shape(raw, path, sliding=True)
    windows = _layer_windows(raw, path)
    if dcfg.get("causal") or raw.get("is_causal") or (raw.get("is_causal") is False and windows):
        raise DFlashError(f"{path}: is_causal overrides are not implemented; a drafter's full_attention layers attend "
                          "bidirectionally in the block and its sliding_attention layers causally: drop the field")
    if "mask_token_id" not in dcfg and "mask_token_id" not in raw:
        if not is_drafter_config(raw):
            raise DFlashError(f"{path}: this is not a DFlash drafter config (no dflash_config; model_type "
                              f"{raw.get('model_type')!r}): pass a Qwen3 or Qwen3.5-family model as the target and a DFlash drafter "
                              "as the drafter")
        raise DFlashError(f"{path}: dflash_config.mask_token_id is missing")
    mask = int(dcfg.get("mask_token_id", raw.get("mask_token_id")))
    block = int(dcfg.get("block_size", raw.get("block_size", 16)))
    n_target = raw.get("num_target_layers", dcfg.get("num_target_layers"))
    taps = dcfg.get("target_layer_ids", raw.get("target_layer_ids"))
    if taps is None:
        taps = build_target_layer_ids(target.num_hidden_layers, shape["num_hidden_layers"])
        warnings.warn(
            f"{path}: dflash_config.target_layer_ids is absent; using the fallback rule, taps {taps}. "
            "Published drafters set it explicitly; the fallback may tap the wrong layers.",
            stacklevel=2,
        )
    taps = tuple(int(t) for t in taps)

    def refuse(what: str, drafter_value, target_value):
        raise DFlashError(
            f"drafter {path} does not fit target {target.folder}/config.json: "
            f"{what} is {drafter_value} in the drafter but {target_value} in the target"
        )

    if shape["hidden_size"] != target.hidden_size:
        refuse("hidden_size", shape["hidden_size"], target.hidden_size)
    if shape["vocab_size"] != target.vocab_size:
        refuse("vocab_size", shape["vocab_size"], target.vocab_size)
    if n_target is not None and int(n_target) != target.num_hidden_layers:
        refuse("num_target_layers", int(n_target), f"num_hidden_layers={target.num_hidden_layers}")
    if not taps or any(not 0 <= t < target.num_hidden_layers for t in taps):
        refuse("target_layer_ids", list(taps), f"layers 0..{target.num_hidden_layers - 1}")
    if not 0 <= mask < target.vocab_size:
        refuse("mask_token_id", mask, f"vocab_size={target.vocab_size}")
    if block < 2:
        raise DFlashError(f"{path}: block_size is {block}; a drafter block needs at least 2 tokens")
    v2 = None
    if dflash2.is_dflash2(raw):
        from .kernels.topk import MAX_K  # torch-free; imported here so config readers skip the kernel tables

        v2 = dflash2.read_dflash2(raw, path, shape["hidden_size"], target.vocab_size, block, MAX_K)
    return DrafterConfig(
        **shape,
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=taps,
        num_target_layers=None if n_target is None else int(n_target),
        input_embedding_scale=float(dcfg.get("input_embedding_scale", raw.get("input_embedding_scale", 1.0))),
        output_multiplier=_number(dcfg, raw, "output_multiplier", 1.0, path),
        final_logit_softcapping=_number(dcfg, raw, "final_logit_softcapping", 0.0, path),
        dflash2=v2,
        layer_windows=windows,
        folder=str(folder),
        raw=raw,
    )
