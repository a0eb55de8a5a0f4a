"""Tiny random checkpoints in the real on-disk formats, for tests (and, run as a script, for
bench/gpu_check.py prepare).

The target is written by `transformers` itself (Qwen3ForCausalLM.save_pretrained), so reading it
tests our checkpoint reader against the reference format. The drafter is written in the published
DFlash format: config.json with dflash_config, and fc / hidden_norm / norm / layers.N.* tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=1024,
)


def make_target(folder: Path, tie: bool = False, dtype: str = "float32", seed: int = 0, **overrides) -> Path:
    """A random Qwen3 target saved by transformers; no eos id, so generations run to the budget."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**TINY, **overrides}, tie_word_embeddings=tie, initializer_range=0.25,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, dtype))
    with torch.no_grad():  # norms away from 1 so that their weights are tested too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def drafter_config(target_dir: Path, block_size: int = 8, layers: int = 2, taps=(0, 2), mask_token_id: int = 511,
                   block_in_dflash_config: bool = False, **overrides) -> dict:
    t = json.loads((Path(target_dir) / "config.json").read_text())
    dflash = {"mask_token_id": mask_token_id}
    if taps is not None:
        dflash["target_layer_ids"] = list(taps)
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_target_layers": t["num_hidden_layers"],
        "dflash_config": dflash,
        **{k: t[k] for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                             "head_dim", "rms_norm_eps")},
        "rope_theta": 10000.0,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        "torch_dtype": t.get("dtype", t.get("torch_dtype", "float32")),
        "tie_word_embeddings": False,
    }
    if block_in_dflash_config:
        dflash["block_size"] = block_size
    else:
        cfg["block_size"] = block_size
    cfg.update(overrides)
    return cfg


def drafter_tensors(cfg: dict, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random weights with the published DFlash key set (3 + 11 * layers tensors)."""
    g = torch.Generator().manual_seed(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_taps = len(cfg["dflash_config"].get("target_layer_ids") or [0] * cfg["num_hidden_layers"])

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)

    def norm(n):
        return (0.5 + torch.rand(n, generator=g)).to(dtype)

    out = {"fc.weight": w(H, n_taps * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": w(nq * hd, H),
            p + "self_attn.k_proj.weight": w(nkv * hd, H),
            p + "self_attn.v_proj.weight": w(nkv * hd, H),
            p + "self_attn.o_proj.weight": w(H, nq * hd),
            p + "self_attn.q_norm.weight": norm(hd),
            p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": w(I, H),
            p + "mlp.up_proj.weight": w(I, H),
            p + "mlp.down_proj.weight": w(H, I),
        })
    return out


def make_drafter(folder: Path, target_dir: Path, seed: int = 0, dtype=torch.float32, **kw) -> Path:
    """A random DFlash drafter for `target_dir`, in the published format."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = drafter_config(target_dir, **kw)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(drafter_tensors(cfg, seed, dtype), str(folder / "model.safetensors"))
    return folder


DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=16)


def dflash2_tensors(cfg: dict, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random weights of the tensors DFlash2 adds (dflash_iree/dflash2.py `expected_tensors`), large
    enough that the convolution and the selector's pair term change the draft."""
    g = torch.Generator().manual_seed(seed + 100)
    d, H, V = cfg["dflash_config"], cfg["hidden_size"], cfg["vocab_size"]
    k, r = d["conv_kernel_size"], d["selector_rank"]
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (0.5 * torch.randn(2, k, H, generator=g)).to(dtype)
            rows = 2 * k * (H // d["conv_group_size"])
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (torch.randn(rows, H, generator=g) * 0.3 * H**-0.5).to(dtype)
    out["candidate_selector.hidden_projection.weight"] = (torch.randn(r, H, generator=g) * H**-0.5).to(dtype)
    for name in ("predecessor_codebook", "successor_codebook"):
        out[f"candidate_selector.{name}"] = torch.randn(V, r, generator=g).to(dtype)
    return out


def make_dflash2_drafter(folder: Path, target_dir: Path, seed: int = 0, dtype=torch.float32, dflash2=None,
                         **kw) -> Path:
    """A random DFlash2 drafter for `target_dir`, in the published format (DFLASH2's fields unless given)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = drafter_config(target_dir, **kw)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(DFLASH2 if dflash2 is None else dflash2)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({**drafter_tensors(cfg, seed, dtype), **dflash2_tensors(cfg, seed, dtype)}, str(folder / "model.safetensors"))
    return folder


if __name__ == "__main__":  # python tests/tiny.py DIR: the tiny float32 pair in DIR/target, DIR/drafter
    import sys

    out = Path(sys.argv[1])
    make_drafter(out / "drafter", make_target(out / "target"))
