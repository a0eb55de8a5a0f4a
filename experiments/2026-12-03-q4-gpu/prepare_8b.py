"""Here: the Qwen3-8B shape as an MLX affine 4-bit checkpoint (group 64: every linear, the embedding and the
lm_head, as mlx-lm's `convert -q` makes them) with no weights, and its compile for sm_80 (block 16).

    .venv/bin/python experiments/2026-12-03-q4-gpu/prepare_8b.py     # .gpu/q4-8b-target, .gpu/8b-q4-b16-sm_80

The checkpoint is tests/fixtures/qwen3-8b's config.json with `quantization: {group_size: 64, bits: 4}`
and one safetensors file whose header names every tensor with the dtype and shape mlx-lm writes
(X.weight u32 [N, K / 8], X.scales and X.biases bf16 [N, K / 64]; norms bf16) and whose data is a
sparse run of zeros: the compile reads headers only, and on the GPU run_8b.py binds random tensors
of those shapes (an 8B-shape benchmark, like bench/speed_8b.py's random bf16 weights; not a test of a
reader, which tests/test_quant_compile.py does on checkpoints mlx-lm writes).
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests/fixtures/qwen3-8b"
DRAFTER = ROOT / "tests/fixtures/qwen3-8b-dflash-b16"
OUT = ROOT / ".gpu/q4-8b-target"
ARTIFACTS = ROOT / ".gpu/8b-q4-b16-sm_80"
GROUP = 64


def header(cfg) -> dict:
    import torch

    from dflash_iree.export.qwen3 import Qwen3
    from dflash_iree.export.quantized import float_shapes

    with torch.device("meta"):
        model = Qwen3(cfg, 64, (), 1, torch.bfloat16)
    shapes = float_shapes(model)
    tensors = {}
    for prefix, (N, K) in shapes.items():
        tensors[f"{prefix}.weight"] = ("U32", [N, K // 8], 4)
        tensors[f"{prefix}.scales"] = ("BF16", [N, K // GROUP], 2)
        tensors[f"{prefix}.biases"] = ("BF16", [N, K // GROUP], 2)
    for key, p in model.named_parameters():
        if key.rpartition(".")[0] not in shapes:
            tensors[key] = ("BF16", list(p.shape), 2)
    head, off = {}, 0
    for key in sorted(tensors):
        dt, shape, size = tensors[key]
        n = size
        for d in shape:
            n *= d
        head[key] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    return head


def write_checkpoint() -> None:
    """The config and the sparse safetensors file (also made on the GPU machine by run_8b.py: a
    sparse file does not travel)."""
    from dflash_iree.config import load_target_config

    OUT.mkdir(parents=True, exist_ok=True)
    raw = json.loads((TARGET / "config.json").read_text())
    raw.pop("_provenance", None)
    raw["quantization"] = {"group_size": GROUP, "bits": 4}
    (OUT / "config.json").write_text(json.dumps(raw, indent=1))
    head = header(load_target_config(TARGET))
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    size = max(v["data_offsets"][1] for v in head.values())
    with open(OUT / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + size)  # sparse: no data on disk
    print(f"{OUT}: {len(head)} tensors, {size / 1e9:.2f} GB of data (sparse)", flush=True)


def main() -> None:
    from dflash_iree.export.compile import compile_artifacts

    write_checkpoint()
    t = time.time()
    compile_artifacts("sm_80", OUT, DRAFTER, ARTIFACTS, block_size=16, dtype="bf16")
    print(f"compiled in {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
