"""Train the hybrid demo target (models/demo-qwen35/target): a small `qwen3_5_text` model with
Gated DeltaNet and gated attention layers, on the same stdlib corpus and tokenizer as models/demo/.

    python3 train/train_target_qwen35.py --data .train-data --out $OUT/target --log $OUT/target_log.json --seed 0

The loop is train_target.py's (same options, bf16 autocast, AdamW, best held-out weights written to
--out); the model is `export.qwen35.Qwen35` itself, cache-free (`use_cache=False`: 512-token windows
run the chunked delta rule, attention through SDPA). --out also gets config.json and
generation_config.json, so the folder loads as a target (`load_target`) once the tokenizer files
are copied in (train/package.py's job for models/demo/). Runs on the CPU too (smoke tests).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from dflash_iree.config import load_target_config
from dflash_iree.export.qwen35 import Qwen35

from common import EOS_ID, SEQ_LEN, VOCAB_SIZE, generation_config_dict
import train_target

LAYERS = 8  # 3 DeltaNet + 1 attention, twice


def hybrid_config_dict() -> dict:
    """The hybrid demo target's config.json (Qwen3_5ForCausalLM, tied embeddings, 17.3M parameters)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": VOCAB_SIZE, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": LAYERS,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu",
        "max_position_embeddings": SEQ_LEN, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(LAYERS)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_num_key_heads": 3, "linear_num_value_heads": 6,
        "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": None,
        "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "torch_dtype": "bfloat16",
    }


def init_hybrid(model: Qwen35, std: float = 0.02) -> None:
    """GPT-2 style init as train/common.py `init_weights`, with transformers' Qwen3.5 choices for
    the rest: zero-centred norms at 0 (scale 1), the gated norm at 1, dt_bias 1, A_log = log U(1, 16)."""
    layers = model.cfg.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                nn.init.ones_(p)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif p.dim() == 1:
                nn.init.zeros_(p)
            elif name.endswith("conv1d.weight"):
                nn.init.normal_(p, 0.0, 1 / math.sqrt(p.shape[-1]))
            elif name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, std)


def hybrid_model(device) -> tuple[Qwen35, int]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hybrid_config_dict()))
        cfg = load_target_config(tmp)
    model = Qwen35(cfg, SEQ_LEN, (), dtype=torch.float32, device=device, attention="fused")
    init_hybrid(model)
    return model, LAYERS


def main() -> None:
    train_target.main(hybrid_model, "train the hybrid (Gated DeltaNet + gated attention) demo target")
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    (out / "config.json").write_text(json.dumps(hybrid_config_dict(), indent=1) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config_dict(), indent=1) + "\n")


if __name__ == "__main__":
    main()
