"""Shared pieces of the demo training: the demo configs, weight init, the optimizer, the LR schedule
and the training loop both stages run, the SDPA attention used on the GPU, and safetensors weight
files.

Runs here (CPU, the repo's `.venv`) and on the device, both with `dflash_iree` installed (on the
device the wheels of bench/pack_device.py, installed by bench/on_device.sh).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_iree.config import DrafterConfig, TargetConfig, load_drafter_config, load_target_config
from dflash_iree.export import gdn as gdn_module
from dflash_iree.export import qwen3 as qwen3_module

VOCAB_SIZE, EOS_ID, MASK_ID = 8192, 0, 1
SEQ_LEN = 512  # target training context, also max_position_embeddings


def tap_layers(num_layers: int) -> list[int]:
    """The decoder layers a demo drafter taps: every other layer, counted back from the last one,
    which is always included ([1, 3, 5] of the 6-layer Qwen3 target, see its MODEL_CARD; [1, 3, 5, 7]
    of the 8-layer hybrid). The last tap is the final-norm hidden state (HF's hidden_states[L]), so
    the target's own logits are lm_head(last tap) (train_drafter.py `target_logits`)."""
    return list(range((num_layers - 1) % 2, num_layers, 2))


TAP_LAYERS = tap_layers(6)  # the 6-layer Qwen3 demo target's


def target_config_dict() -> dict:
    """The demo target's HF `config.json` (Qwen3ForCausalLM, ~12.6M parameters, tied embeddings)."""
    layers = 6
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": layers,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": SEQ_LEN,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
    }


# The demo DFlash2 drafter's added fields: the published k, group and top-k; rank 64 for the demo's
# hidden 384 (the 27B example's 256 is for hidden 5120)
DEMO_DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 64, "selector_top_k": 16}


def drafter_config_dict(block_size: int, dflash2: bool = False, target: dict | None = None) -> dict:
    """A demo drafter's `config.json` in the published DFlash format (2 layers, ~3.0M parameters),
    or with `dflash2` the DFlash2 format (DEMO_DFLASH2's fields added). `target` is the target's
    config.json (default: the Qwen3 demo target's): it sets hidden_size, num_target_layers and the
    taps (`tap_layers`)."""
    cfg = _v1_drafter_config_dict(block_size, target or target_config_dict())
    if dflash2:
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(DEMO_DFLASH2)
    return cfg


def _v1_drafter_config_dict(block_size: int, t: dict) -> dict:
    layers = 2
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": tap_layers(t["num_hidden_layers"])},
        "num_target_layers": t["num_hidden_layers"],
        "num_hidden_layers": layers,
        "hidden_size": t["hidden_size"],
        "intermediate_size": 768,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "max_position_embeddings": SEQ_LEN,
        "layer_types": ["full_attention"] * layers,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def generation_config_dict() -> dict:
    return {"eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "do_sample": False}


def target_dict(folder: Path | None = None) -> dict:
    """The config.json of a target weights folder: the folder's own when it has one
    (train_target_qwen35.py writes it; a packaged target has it), else the Qwen3 demo target's
    (train_target.py writes weights only)."""
    path = Path(folder) / "config.json" if folder is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else target_config_dict()


def parse_configs(block_size: int = 8, dflash2: bool = False,
                  target: dict | None = None) -> tuple[TargetConfig, DrafterConfig]:
    """The demo configs read through the project's own config readers (same path as inference):
    the target of config dict `target` (default: the Qwen3 demo target's; a qwen3_5_text dict gives
    a `HybridConfig`) and its drafter of `block_size`."""
    target = target or target_config_dict()
    with tempfile.TemporaryDirectory() as tmp:
        t, d = Path(tmp, "target"), Path(tmp, "drafter")
        t.mkdir(), d.mkdir()
        (t / "config.json").write_text(json.dumps(target))
        (t / "generation_config.json").write_text(json.dumps(generation_config_dict()))
        (d / "config.json").write_text(json.dumps(drafter_config_dict(block_size, dflash2, target)))
        tcfg = load_target_config(t)
        return tcfg, load_drafter_config(d, tcfg)


def init_weights(module: nn.Module, num_layers: int, std: float = 0.02) -> None:
    """GPT-2 style init: N(0, std) for linears and embeddings, o_proj / down_proj scaled by
    1/sqrt(2 * layers) (they add into the residual stream), norms at 1."""
    for name, p in module.named_parameters():
        if p.dim() == 1:
            nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * num_layers))
        else:
            nn.init.normal_(p, 0.0, std)


def init_dflash2(module: nn.Module) -> None:
    """DFlash2's added tensors start the drafter as a v1 drafter: each convolution the identity
    (base tap 0 = 1, the rest 0, no dynamic deltas), and the selector's pair term near zero."""
    for name, p in module.named_parameters():
        if name.endswith("base_kernel"):
            with torch.no_grad():
                p.zero_()
                p[:, 0] = 1.0
        elif name.endswith("kernel_projection.weight"):
            nn.init.zeros_(p)


def adamw(module: nn.Module, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) with `weight_decay` on the matrices (dim >= 2) and none on the norms."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    rest = [p for p in module.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=fused)


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup, then cosine decay to floor * peak at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def optimizer_step(opt: torch.optim.Optimizer, module: nn.Module, loss: torch.Tensor, lr: float) -> None:
    """One update of `module` from `loss` at learning rate `lr`, gradients clipped to norm 1."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()


def train(first_step: int, steps: int, eval_every: int, time_limit: float, t_start: float,
          step: Callable[[int], object], evaluate: Callable[[int, object], None], compress: bool = False) -> None:
    """The training loop of both stages.

    Per step: the schedule's clock (the step; with `compress`, the step the time budget has reached
    when that is further, so that the LR schedule ends by `time_limit`), then `step(clock)`, one
    update of every model, which returns its stats. Every `eval_every` steps and at the last one,
    `evaluate(steps_done, stats)`. It stops after `steps`, when the clock reaches `steps`, or once
    `time_limit` seconds have passed since `t_start` (time.time()).
    """
    t_loop = time.time()
    budget = time_limit - (t_loop - t_start)
    for i in range(first_step, steps):
        clock = i
        if compress:
            clock = max(i, first_step + int((time.time() - t_loop) / budget * (steps - first_step)))
        stats = step(clock)
        last = i + 1 == steps or clock + 1 >= steps or time.time() - t_start > time_limit
        if (i + 1) % eval_every == 0 or last:
            evaluate(i + 1, stats)
        if last:
            break


CAUSAL_HINT = False  # set by use_sdpa(causal_hint=True) in the target trainer


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`export.qwen3.attend` for training: the same `F.scaled_dot_product_attention`, with the KV heads
    repeated per query head (what PyTorch's flash kernels take) and the causal hint.

    Same function (GQA, mask, softmax scale hd**-0.5); q: [S, T, Hq, hd]; k, v: [S, N, Hkv, hd];
    visible: bool [S, T, N]; returns [S, T, Hq * hd]. When CAUSAL_HINT is set and T == N the mask is
    the causal one (the target's cache-free training forward), and flash attention is used instead.
    """
    S, T, Hq, hd = q.shape
    g = Hq // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(g, 1)
    vh = v.transpose(1, 2).repeat_interleave(g, 1)
    if CAUSAL_HINT and T == k.shape[1]:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible[:, None])
    return out.transpose(1, 2).reshape(S, T, Hq * hd)


def float32_rule(rule: Callable) -> Callable:
    """A Gated DeltaNet rule of export/gdn.py run with autocast off: the rule is float32 in the
    modules (eager and compiled), and bf16 autocast would run its matmuls, the chunk's triangular
    inverse among them, in bf16. Tensor arguments are made float32 (the state already is)."""

    def run(*args, **kwargs):
        with torch.autocast(args[0].device.type, enabled=False):
            return rule(*(a.float() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)

    return run


def use_sdpa(causal_hint: bool = False) -> None:
    """Route the modules' attention through SDPA in this process, and run the hybrid target's
    DeltaNet rules in float32 under autocast (`float32_rule`) (training only; export/ is untouched)."""
    global CAUSAL_HINT
    CAUSAL_HINT = causal_hint
    # cuDNN attention builds a plan per new shape: decoding, whose key length grows every step,
    # paid that each step; flash / memory-efficient kernels have no such cost
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    # both models look `attend` up in export/qwen3.py when they run (`attention_fn`)
    qwen3_module.attend = sdpa_attend
    # GatedDeltaNet.forward looks its rules up in export/gdn.py when it runs
    if not getattr(gdn_module.chunked_rule, "float32", False):
        for name in ("chunked_rule", "recurrent_rule"):
            setattr(gdn_module, name, float32_rule(getattr(gdn_module, name)))
            getattr(gdn_module, name).float32 = True


def save_sharded(tensors: dict[str, torch.Tensor], folder: Path, max_bytes: int = 15_000_000,
                 metadata: dict | None = None) -> list[Path]:
    """Write tensors as HF safetensors: `model.safetensors`, or shards plus
    `model.safetensors.index.json` when the total passes max_bytes. Tensors are saved as given
    (make them bf16 first), contiguous and on the CPU."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = sum(size(t) for t in tensors.values())
    if total <= max_bytes:
        path = folder / "model.safetensors"
        save_file(tensors, str(path), metadata=meta)
        return [path]
    shards, current, used = [], {}, 0
    for key, t in tensors.items():  # insertion order: embed, layers in order, norm
        if current and used + size(t) > max_bytes:
            shards.append(current)
            current, used = {}, 0
        current[key] = t
        used += size(t)
    shards.append(current)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=meta)
        weight_map.update({k: name for k in shard})
        paths.append(folder / name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    return paths


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's `model.safetensors` or shards (CPU, as stored)."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def file_metadata(folder: Path) -> dict:
    """The string metadata of the first safetensors file in folder (step counts for resuming)."""
    from safetensors import safe_open

    path = sorted(Path(folder).glob("*.safetensors"))[0]
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def param_state(module: nn.Module, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Parameter name -> tensor in `dtype`, tied parameters once (the HF key set)."""
    return {name: p.detach().to(dtype) for name, p in module.named_parameters()}
