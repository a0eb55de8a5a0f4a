"""Build the target and drafter modules from HF checkpoint folders (config.json + safetensors).

Modules are built on the meta device, every expected key is checked against the safetensors
headers (dflash_iree.checkpoint), then tensors are read and assigned, cast to the requested dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dflash_iree.checkpoint import check_tensors, index_checkpoint
from dflash_iree.config import load_drafter_config, load_target_config
from dflash_iree.config_qwen35 import HybridConfig
from dflash_iree.dflash2 import check_selector_tensors
from dflash_iree.errors import DFlashError
from dflash_iree.manifest import COMPUTE_DTYPES, DTYPES

from .dflash import DFlashDrafter
from .dflash2 import drafter_class
from .qwen3 import Qwen3
from .qwen35 import Qwen35

TORCH_DTYPES = {name: getattr(torch, DTYPES[name].torch) for name in COMPUTE_DTYPES}


def torch_dtype(name: str) -> torch.dtype:
    """"bf16" | "f16" | "f32" -> torch dtype. Raises DFlashError for anything else."""
    if name not in TORCH_DTYPES:
        raise DFlashError(f"dtype '{name}' is not supported; use one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def expected_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter key -> shape, tied parameters once (the key that owns them)."""
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def load_weights(module: nn.Module, folder: str | Path) -> nn.Module:
    """Read every parameter of `module` from the safetensors files in `folder` (checked first).

    The module may live on the meta device; parameters are replaced by CPU tensors in the
    module's parameter dtype, and non-persistent buffers (KV caches) are allocated as zeros.

    Raises:
        DFlashError: listing every missing key and every mismatched shape.
    """
    expected = expected_shapes(module)
    infos = check_tensors(folder, expected)
    by_file: dict[Path, list[str]] = {}
    for key, info in infos.items():
        by_file.setdefault(info.file, []).append(key)
    params = dict(module.named_parameters())
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                owner, _, name = key.rpartition(".")
                sub = module.get_submodule(owner) if owner else module
                tensor = f.get_tensor(key).to(params[key].dtype)
                setattr(sub, name, nn.Parameter(tensor, requires_grad=False))
    for name, buf in list(module.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            sub.register_buffer(leaf, torch.zeros(buf.shape, dtype=buf.dtype), persistent=False)
    if isinstance(module, Qwen3) and module.cfg.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    if isinstance(module, Qwen35) and module.cfg.tie_word_embeddings:
        module.lm_head.weight = module.body.embed_tokens.weight
    return module.eval()


def load_target(folder: str | Path, max_context: int = 4096, dtype: str | None = None,
                tap_layer_ids=(), streams: int = 1, block_size: int = 16) -> Qwen3 | Qwen35:
    """A Qwen3 target, or a Qwen3.5-family hybrid (export/qwen35.py), from an HF checkpoint folder.

    Args:
        folder: folder with config.json and model.safetensors (or a sharded index).
        max_context: KV cache length in tokens.
        dtype: "bf16" | "f16" | "f32"; default the config's torch_dtype.
        tap_layer_ids: the drafter's target_layer_ids, or () for plain decoding.
        streams: leading stream dimension of the KV cache.
        block_size: a hybrid's recurrent state slots (the verify block size it rolls back within).

    Raises:
        DFlashError: bad config or checkpoint (see load_target_config, check_tensors).
    """
    cfg = load_target_config(folder)
    with torch.device("meta"):
        if isinstance(cfg, HybridConfig):
            module = Qwen35(cfg, max_context, tap_layer_ids, streams, torch_dtype(dtype or cfg.dtype),
                            state_slots=block_size)
        else:
            module = Qwen3(cfg, max_context, tap_layer_ids, streams, torch_dtype(dtype or cfg.dtype))
    return load_weights(module, folder)


def load_pair(target_folder: str | Path, drafter_folder: str | Path, max_context: int = 4096,
              dtype: str | None = None, block_size: int | None = None, streams: int = 1) -> tuple[Qwen3, DFlashDrafter]:
    """Target and drafter (a DFlashDrafter, or a DFlash2Drafter for a DFlash2 config), checked
    against each other; the target taps the drafter's layers.

    Args:
        block_size: verify block size, 2..the drafter's trained block_size; None: the trained one
            (DrafterConfig.block).

    Raises:
        DFlashError: bad configs or checkpoints, a drafter that does not fit the target, a DFlash2
            candidate selector that is missing or does not fit (dflash_iree/dflash2.py), or a
            block_size out of range.
    """
    tcfg = load_target_config(target_folder)
    dcfg = load_drafter_config(drafter_folder, tcfg)
    block = dcfg.block(block_size)
    target = load_target(target_folder, max_context, dtype, dcfg.target_layer_ids, streams, block)
    if dcfg.dflash2 is not None:  # its own one-line refusals before the list of check_tensors
        check_selector_tensors(drafter_folder, index_checkpoint(drafter_folder), dcfg.dflash2, dcfg.hidden_size,
                               tcfg.vocab_size)
    with torch.device("meta"):
        drafter = drafter_class(dcfg)(dcfg, max_context, block, streams, torch_dtype(dtype or tcfg.dtype))
    return target, load_weights(drafter, drafter_folder)
