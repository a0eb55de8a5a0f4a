"""Tiny random Qwen3.5-family hybrid checkpoints, written by transformers itself, for tests.

`make_hybrid` saves a `Qwen3_5ForCausalLM` (model_type qwen3_5_text, weights under `model.*`);
`as_wrapper` rewrites such a folder in the vision-language wrapper's layout (model_type qwen3_5, the
text config under text_config, weights under `model.language_model.*`, plus stand-in
`model.visual.*` and `mtp.*` tensors that loading must ignore).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY_HYBRID = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # GDN, GDN, GDN, attention (full_attention_interval 4)
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def hf_config(yarn: bool = False, **overrides):
    """A transformers Qwen3_5TextConfig of TINY_HYBRID (partial rotary 0.25 of 16: 4 dims... 
    raised to 0.5 so that 8 dims rotate), YaRN factor 4 over 256 positions when `yarn`."""
    from transformers import Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if yarn:
        rope = {**rope, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    return Qwen3_5TextConfig(**{**TINY_HYBRID, **overrides}, rope_parameters=rope, initializer_range=0.25,
                             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def make_hybrid(folder: Path, seed: int = 0, yarn: bool = False, dtype: str = "float32", **overrides) -> Path:
    """A random tiny qwen3_5_text target saved by transformers (f32; norms away from their identity)."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hf_config(yarn, **overrides)).to(getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if "linear_attn.norm" not in name else p.uniform_(0.5, 1.5)
            if name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def hf_model(folder: Path):
    """The transformers reference of a `make_hybrid` folder, eager attention, f32, eval mode."""
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def as_wrapper(text_folder: Path, folder: Path) -> Path:
    """`text_folder` in the qwen3_5 wrapper's layout, in `folder` (see the module docstring)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = json.loads((Path(text_folder) / "config.json").read_text())
    text["mtp_num_hidden_layers"] = 1
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": text, "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
           "tie_word_embeddings": False, "image_token_id": 5}
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for key, t in load_file(str(Path(text_folder) / "model.safetensors")).items():
        tensors[key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key] = t
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(folder / "model.safetensors"))
    for extra in ("generation_config.json",):
        if (Path(text_folder) / extra).is_file():
            shutil.copy(Path(text_folder) / extra, folder / extra)
    return folder
