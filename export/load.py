"""Build the target and drafter modules from HF checkpoint folders (config.json + safetensors).

Modules are built on the meta device, every expected key is checked against the safetensors
headers (dflash_iree.checkpoint), then tensors are read and assigned, cast to the requested dtype.
A 4-bit checkpoint (dflash_iree/quant.py) gets its packed layers as export/quantized.py's modules,
whose integer tensors and scales keep their stored dtypes; `bits=4` quantizes a float one on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dflash_iree import quant
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
from .quantized import QuantEmbedding, QuantLinear as QuantLinearBase, float_shapes, quantize_on_load, swap_quantized

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
                tensor = f.get_tensor(key)
                # MLX's uint32 words as int32, the same bits (torch has no arithmetic on uint32)
                tensor = tensor.view(torch.int32) if tensor.dtype == torch.uint32 else tensor.to(params[key].dtype)
                setattr(sub, name, nn.Parameter(tensor, requires_grad=False))
    for name, buf in list(module.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            sub.register_buffer(leaf, torch.zeros(buf.shape, dtype=buf.dtype), persistent=False)
    return tie_embeddings(module).eval()


def tie_embeddings(module: nn.Module) -> nn.Module:
    """A tied target's lm_head on its embedding's parameters (the float weight, or a packed
    embedding's tensors as a QuantLinear), after the parameters were replaced or swapped. Returns it."""
    if isinstance(module, Qwen3) and module.cfg.tie_word_embeddings:
        if isinstance(module.model.embed_tokens, QuantEmbedding):
            module.lm_head = module.model.embed_tokens.as_linear()
        else:
            module.lm_head.weight = module.model.embed_tokens.weight
    if isinstance(module, Qwen35) and module.cfg.tie_word_embeddings:
        module.lm_head.weight = module.body.embed_tokens.weight
    return module


def read_quantized(module: nn.Module, folder: str | Path, compute_dtype: torch.dtype) -> nn.Module:
    """Swap `module`'s layers that the checkpoint at `folder` stores packed for their 4-bit modules
    (a float checkpoint: unchanged). Returns `module`.

    Raises:
        DFlashError: a format dflash_iree/quant.py does not read, or packed tensors of the wrong shape.
    """
    folder = Path(folder)
    fmt = quant.read_format(json.loads((folder / "config.json").read_text()), folder / "config.json")
    if fmt is None:
        return module
    index = index_checkpoint(folder)
    layers = quant.find_layers(index, fmt, float_shapes(module), folder)
    if isinstance(module, Qwen3) and module.cfg.tie_word_embeddings:
        layers.pop("lm_head", None)  # tied: the embedding's packed tensors, shared after loading
    dtypes = {k: TORCH_DTYPES.get(i.dtype, torch.int64 if i.dtype == "i64" else torch.int32) for k, i in index.items()}
    return swap_quantized(module, layers, dtypes, compute_dtype)


def quant_record(module: nn.Module, fmt: "quant.QuantFormat | None") -> dict | None:
    """The manifest's `quantization` entry of a module `read_quantized` or `swap_on_load` swapped to
    the format `fmt` (None: no packed layer): the format (`QuantFormat.to_dict`), the quantized
    layer prefixes, and the bytes the module binds, split into packed weights, scales, zeros (MLX
    biases or compressed-tensors zero points) and the float parameters left in their stored dtype."""
    layers = {n: m for n, m in module.named_modules() if isinstance(m, QuantLinearBase)}
    if fmt is None or not layers:
        return None
    sizes = {"packed": 0, "scales": 0, "zeros": 0, "shapes": 0, "float": 0}
    owned = {}
    for prefix, m in layers.items():
        for role, name in m.roles.items():
            owned[f"{prefix}.{name}"] = {"biases": "zeros", "shape": "shapes"}.get(role, role)
    for key, p in module.named_parameters():
        sizes[owned.get(key, "float")] += p.numel() * p.element_size()
    return {**fmt.to_dict(), "layers": sorted(n for n in layers if n != "lm_head" or not getattr(
                module, "cfg", None) or not module.cfg.tie_word_embeddings),
            "bytes": sizes}


def _bits_on_load(module: nn.Module, bits: int | None, option: str, stored_dtype: str) -> nn.Module:
    """Quantize a loaded float module on load (`bits` 4) or leave it (None); refuses other bits."""
    if quant.check_bits(bits, option) is not None:
        if any(isinstance(m, QuantLinearBase) for m in module.modules()):
            raise DFlashError(f"{option} {bits}: the checkpoint is already 4-bit; leave {option} out")
        quantize_on_load(module, torch_dtype(stored_dtype))
    return module


def load_target(folder: str | Path, max_context: int = 4096, dtype: str | None = None,
                tap_layer_ids=(), streams: int = 1, block_size: int = 16, bits: int | None = None) -> Qwen3 | Qwen35:
    """A Qwen3 target, or a Qwen3.5-family hybrid (export/qwen35.py), from an HF checkpoint folder.

    Args:
        folder: folder with config.json and model.safetensors (or a sharded index).
        max_context: KV cache length in tokens.
        dtype: "bf16" | "f16" | "f32"; default the config's torch_dtype.
        tap_layer_ids: the drafter's target_layer_ids, or () for plain decoding.
        streams: leading stream dimension of the KV cache.
        block_size: a hybrid's recurrent state slots (the verify block size it rolls back within).
        bits: 4 to quantize a float checkpoint on load (--target-bits); None keeps it as stored.

    Raises:
        DFlashError: bad config or checkpoint (see load_target_config, check_tensors, read_quantized),
            or bits other than 4.
    """
    cfg = load_target_config(folder)
    quant.check_bits(bits, "--target-bits")
    compute = torch_dtype(dtype or cfg.dtype)
    if isinstance(cfg, HybridConfig):
        if bits is not None:
            raise DFlashError(f"{folder}/config.json: --target-bits is not implemented for {cfg.family} "
                              "(Qwen3.5-family) targets yet; leave it out")
        with torch.device("meta"):
            module = Qwen35(cfg, max_context, tap_layer_ids, streams, compute, state_slots=block_size)
        return load_weights(module, folder)
    with torch.device("meta"):
        # tied before loading, as build_pair does: a packed embedding leaves lm_head its own (unread) weight
        module = tie_embeddings(read_quantized(Qwen3(cfg, max_context, tap_layer_ids, streams, compute), folder,
                                               compute))
    return _bits_on_load(load_weights(module, folder), bits, "--target-bits", cfg.dtype)


def load_pair(target_folder: str | Path, drafter_folder: str | Path, max_context: int = 4096,
              dtype: str | None = None, block_size: int | None = None, streams: int = 1,
              target_bits: int | None = None, drafter_bits: int | None = None) -> tuple[Qwen3, DFlashDrafter]:
    """Target and drafter (a DFlashDrafter, or a DFlash2Drafter for a DFlash2 config), checked
    against each other; the target taps the drafter's layers.

    Args:
        block_size: verify block size, 2..the drafter's trained block_size; None: the trained one
            (DrafterConfig.block).
        target_bits, drafter_bits: 4 to quantize that float checkpoint on load (affine, group 64);
            None keeps it as stored (a 4-bit checkpoint is read packed either way).

    Raises:
        DFlashError: bad configs or checkpoints, a drafter that does not fit the target, a DFlash2
            candidate selector that is missing or does not fit (dflash_iree/dflash2.py), a
            block_size out of range, or bits other than 4.
    """
    tcfg = load_target_config(target_folder)
    dcfg = load_drafter_config(drafter_folder, tcfg)
    block = dcfg.block(block_size)
    quant.check_bits(drafter_bits, "--drafter-bits")
    target = load_target(target_folder, max_context, dtype, dcfg.target_layer_ids, streams, block, target_bits)
    if dcfg.dflash2 is not None:  # its own one-line refusals before the list of check_tensors
        check_selector_tensors(drafter_folder, index_checkpoint(drafter_folder), dcfg.dflash2, dcfg.hidden_size,
                               tcfg.vocab_size)
    compute = torch_dtype(dtype or tcfg.dtype)
    with torch.device("meta"):
        drafter = read_quantized(drafter_class(dcfg)(dcfg, max_context, block, streams, compute), drafter_folder,
                                 compute)
    return target, _bits_on_load(load_weights(drafter, drafter_folder), drafter_bits, "--drafter-bits", dcfg.dtype)
