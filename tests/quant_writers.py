"""4-bit test checkpoints written by the formats' own libraries (never by dflash-iree's code).

- `write_mlx`: mlx-lm's `convert` (the `mlx_lm.convert -q` of users) quantizes a float checkpoint to
  MLX affine 4-bit: every linear, the embedding and the lm_head, group `group_size`.
- `write_compressed_tensors`: compressed-tensors applies a W4A16 group scheme to a transformers
  model, takes each group's scale and zero point from its min and max (`calculate_qparams`, the
  library's; llm-compressor's min-max observer does the same), compresses it `pack-quantized`
  (`ModelCompressor.compress_model`) and writes config.json's quantization_config
  (`update_config`). The lm_head is left unquantized (`ignore`), as llm-compressor recipes do.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_mlx(src: Path, out: Path, group_size: int = 64) -> Path:
    """MLX affine 4-bit of the float checkpoint `src`, by mlx-lm, into `out`."""
    from mlx_lm import convert

    convert(str(src), mlx_path=str(out), quantize=True, q_group_size=group_size, q_bits=4)
    return out


def write_compressed_tensors(src: Path, out: Path, symmetric: bool, group_size: int = 32, dtype: str = "bfloat16") -> Path:
    """compressed-tensors pack-quantized W4A16 of the float target `src` into `out` (group 32: the tiny
    target's 64-wide layers hold no group of 128), the model held in `dtype` (its scales and the
    unquantized layers are written in it)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    cfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                             ignore=["lm_head"], format="pack-quantized")
    apply_quantization_config(model, cfg)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight_scale"):
                g = m.weight.float().reshape(m.weight.shape[0], -1, group_size)
                scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
                m.weight_scale.copy_(scale.to(m.weight_scale.dtype))
                if hasattr(m, "weight_zero_point"):
                    m.weight_zero_point.copy_(zero.to(m.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


def library_dequantized(folder: Path) -> dict:
    """prefix -> float32 weight [N, K] of every packed layer of `folder`, dequantized by the format's
    own library (mlx's `dequantize` with float32 scales; compressed-tensors' `decompress`)."""
    cfg = json.loads((folder / "config.json").read_text())
    if "quantization" in cfg:
        import mlx.core as mx
        import numpy as np
        import torch

        w, q = mx.load(str(folder / "model.safetensors")), cfg["quantization"]
        return {k[:-len(".scales")]: torch.from_numpy(np.array(mx.dequantize(
                    w[k[:-len(".scales")] + ".weight"], w[k].astype(mx.float32),
                    w[k[:-len(".scales")] + ".biases"].astype(mx.float32), group_size=q["group_size"], bits=q["bits"])))
                for k in w if k.endswith(".scales")}
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
    weights = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    out = {}
    for key in sd:
        if key.endswith(".weight_packed"):
            p = key[:-len(".weight_packed")]
            part = {k[len(p) + 1:]: v for k, v in sd.items() if k.startswith(p + ".")}
            part["weight_scale"] = part["weight_scale"].float()
            out[p] = PackedQuantizationCompressor.decompress(part, scheme)["weight"].float()
    return out


def cut_tensor(src: Path, out: Path, key: str, rows: int) -> Path:
    """A copy of the MLX checkpoint folder src at out whose tensor `key` keeps only its first `rows`
    rows: a packed tensor of the wrong shape, for the refusal tests."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors[key] = tensors[key][:rows].copy()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "mlx"})
    return out
