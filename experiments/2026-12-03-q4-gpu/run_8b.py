"""On the GPU: the Qwen3-8B shape at MLX 4-bit (.gpu/8b-q4-b16-sm_80, prepare_8b.py) against the bf16 build
(.gpu/8b-b8-u16r-sm_80, the same GEMM kernel's bf16 form), in one process (issue #28).

    bash bench/on_device.sh python3 experiments/2026-12-03-q4-gpu/run_8b.py --json out.json

- Weights: the 4-bit module's parameters random in the shapes its manifest lists (packed words
  uniform; scales in [1/128, 3/128); MLX biases -8 scales about; norms 1), the bf16 build's from
  bench/speed_8b.py's random modules; the drafter bf16 random in both.
- Steps as bench/speed_8b.py `_iree_steps` measures them (decode, plain decoding's decode_ahead per
  token, verify, draft, a round), the arms q4, bf16, q4, bf16 in turn (medians of each arm's two);
  `--profile`: the 4-bit decode step's kernels (CUPTI), for the time split.
- Device memory of the 4-bit module: cudaMemGetInfo's used bytes before binding and after its steps,
  against its packed bytes (words, scales, biases, norms) + the KV cache's (manifest state).
- The peer: our eager Qwen3 with export/quantized.py's QuantLinear layers on the same packed tensors
  (dequantize + matmul each call), under torch.compile reduce-overhead, after ours, ours freed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import speed_8b  # noqa: E402
from common import copy_bandwidth, write_json  # noqa: E402

Q4 = ROOT / ".gpu/8b-q4-b16-sm_80"
BF16 = ROOT / ".gpu/8b-b8-u16r-sm_80"
Q4_TARGET = ROOT / ".gpu/q4-8b-target"


def random_params(table: dict, rng) -> dict:
    """Host arrays for a manifest's parameter table (key -> {shape, dtype}) of an MLX 4-bit module."""
    import ml_dtypes
    import numpy as np

    out = {}
    for key, p in table.items():
        shape, dt = p["shape"], p["dtype"]
        if dt in ("u32", "i32"):
            a = rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
            a = a if dt == "u32" else a.view(np.int32)
        elif key.endswith(".scales"):
            a = ((rng.random(shape, dtype=np.float32) + 0.5) / 64).astype(ml_dtypes.bfloat16)
        elif key.endswith(".biases"):
            a = (-8 * (rng.random(shape, dtype=np.float32) + 0.5) / 64).astype(ml_dtypes.bfloat16)
        else:
            a = np.ones(shape, dtype=ml_dtypes.bfloat16)
        out[key] = np.ascontiguousarray(a)
    return out


def index_of(arrays: dict):
    import iree.runtime as rt
    import numpy as np

    index = rt.ParameterIndex()
    for key, a in arrays.items():
        index.add_buffer(key, a.view(np.int16) if a.dtype.name == "bfloat16" else a)
    return index


def main() -> None:
    import iree.runtime as rt
    import numpy as np
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--bf16", type=Path, default=BF16, help="the bf16 build's artifacts")
    ap.add_argument("--q4", type=Path, default=Q4, help="the 4-bit build's artifacts")
    args = ap.parse_args()
    q4 = args.q4
    rec = {"device": torch.cuda.get_device_name(0), "copy": copy_bandwidth()}
    print(f"copy {rec['copy']['tb_per_s']} TB/s", flush=True)
    m4 = json.loads((q4 / "manifest.json").read_text())
    rng = np.random.default_rng(0)
    t_arrays = random_params(m4["parameters"]["target"], rng)
    q4_bytes = sum(a.nbytes for k, a in t_arrays.items() if not k.startswith("model.embed_tokens."))
    kv_bytes = sum(g["bytes"] for g in m4["state"]["globals"].values())  # the target's and the drafter's caches
    target, drafter = speed_8b._build(torch)  # bf16 target (the bf16 arm) and the drafter (both arms)
    embed = target.model.embed_tokens.weight
    bf16_bytes = speed_8b._bytes(target) - embed.numel() * embed.element_size()
    keep: list = []
    idx16 = speed_8b._indexes(target, drafter, keep)
    idx4 = {"target": index_of(t_arrays), "drafter": idx16["drafter"]}
    rec["bytes"] = {"q4_target_read_per_step": q4_bytes, "bf16_target_read_per_step": bf16_bytes,
                    "q4_over_bf16": q4_bytes / bf16_bytes, "state": m4["state"]}
    del target
    torch.cuda.empty_cache()
    device = rt.get_device("cuda")
    rows = -(-(speed_8b.PROMPT_LEN + speed_8b.STEPS + 3) // 32) * 32
    bound = sum(a.nbytes for a in t_arrays.values()) + speed_8b._bytes(drafter)  # all the module binds
    rec["q4_memory"] = memory(q4, idx4, device, bound, kv_bytes)
    print("q4 memory", json.dumps(rec["q4_memory"]), flush=True)
    arms = {"q4": [], "bf16": []}
    for i, (name, folder, idx) in enumerate([("q4", q4, idx4), ("bf16", args.bf16, idx16), ("q4", q4, idx4),
                                             ("bf16", args.bf16, idx16)]):
        r = speed_8b._iree_steps(folder, idx, device, rows, profile=args.profile and i == 0)
        arms[name].append(r)
        print(f"{name}: decode {r['decode']['median_ms']:.3f} ms, decode_ahead {r['decode_ahead']['median_ms']:.3f} ms, "
              f"verify {r['verify']['median_ms']:.3f} ms, draft {r['draft']['median_ms']:.3f} ms, "
              f"verify_agrees_with_decode {r['verify_agrees_with_decode']}", flush=True)
    rec["runs"] = arms
    med = {name: {k: statistics.median(r[k]["median_ms"] for r in rs) for k in
                  ("decode", "decode_ahead", "verify", "draft", "round", "round_fused") if k in rs[0]}
           for name, rs in arms.items()}
    rec["median_ms"] = med
    bw = rec["copy"]["tb_per_s"] * 1e12
    rec["derived"] = {
        "q4_decode_ahead_frac_of_copy": q4_bytes / (med["q4"]["decode_ahead"] / 1e3) / bw,
        "bf16_decode_ahead_frac_of_copy": bf16_bytes / (med["bf16"]["decode_ahead"] / 1e3) / bw,
        "q4_tok_s_over_bf16": med["bf16"]["decode_ahead"] / med["q4"]["decode_ahead"],
        "q4_verify16_over_decode": med["q4"]["verify"] / med["q4"]["decode"],
        "q4_verify16_over_decode_ahead": med["q4"]["verify"] / med["q4"]["decode_ahead"]}
    if args.profile and "profile" in arms["q4"][0]:
        prof = arms["q4"][0]["profile"]["decode_ahead"]
        rec["derived"]["q4_decode_kernel_ms"] = prof.get("busy_ms")
        if prof.get("busy_ms"):
            rec["derived"]["q4_decode_kernels_frac_of_copy"] = q4_bytes / (prof["busy_ms"] / 1e3) / bw
    print(json.dumps(rec["derived"], indent=1), flush=True)
    del idx4, idx16, keep
    if not args.no_peer:
        rec["peer"] = torch_peer(torch, m4, t_arrays, rows)
        print("peer", json.dumps(rec["peer"]), flush=True)
        rec["derived"]["q4_tok_s_over_torch_compile"] = rec["peer"].get("step_ms", 0) / med["q4"]["decode_ahead"]
    write_json(args.json, rec)


def memory(folder: Path, indexes, device, weight_bytes: int, kv_bytes) -> dict:
    """Device bytes the module holds (cudaMemGetInfo's used, before binding and after a prefill and a
    few steps of each kind, the module still bound) against weights + KV cache."""
    import gc

    import torch

    from dflash_iree.runtime.artifacts import Artifacts

    gc.collect()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    arts = Artifacts.load(folder)
    pair = arts.bind_indexes(device, indexes)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(speed_8b.PROMPT_LEN)]
    first, taps = pair.prefill(prompt)
    pair.absorb(taps)
    tok = first
    for i in range(4):
        tok = pair.decode(tok, speed_8b.PROMPT_LEN + i)
    B = arts.block_size
    _, vt = pair.verify([first] * B, speed_8b.PROMPT_LEN)
    pair.draft(vt, speed_8b.PROMPT_LEN, B, first, speed_8b.PROMPT_LEN + B)
    list(pair.decode_ahead(first, speed_8b.PROMPT_LEN, 16))
    torch.cuda.synchronize()
    used = free0 - torch.cuda.mem_get_info()[0]
    del pair, arts
    gc.collect()
    out = {"used_bytes": used, "weight_bytes_bound": weight_bytes, "kv_and_state_bytes": kv_bytes}
    if kv_bytes:
        out["used_over_weights_plus_kv"] = used / (weight_bytes + kv_bytes)
    return out


def torch_peer(torch, m4, t_arrays, rows) -> dict:
    """torch.compile reduce-overhead of our Qwen3 with QuantLinear layers on the same packed tensors."""
    from dflash_iree.checkpoint import index_checkpoint
    from dflash_iree.config import load_target_config
    from dflash_iree.export.load import TORCH_DTYPES
    from dflash_iree.export.quantized import float_shapes, swap_quantized
    from dflash_iree.export.qwen3 import Qwen3
    from dflash_iree.quant import find_layers, read_format

    if not (Q4_TARGET / "model.safetensors").is_file():
        sys.path.insert(0, str(Path(__file__).parent))
        import prepare_8b

        prepare_8b.write_checkpoint()
    cfg = load_target_config(speed_8b.TARGET)
    raw = json.loads((Q4_TARGET / "config.json").read_text())
    fmt = read_format(raw, Q4_TARGET / "config.json")
    from dflash_iree.export.quantized import QuantLinear

    with torch.device("cuda"):  # buffers (RoPE tables, the cache) made as the module makes them
        model = Qwen3(cfg, speed_8b.MAX_CONTEXT, (), 1, torch.bfloat16)
    index = index_checkpoint(Q4_TARGET)
    layers = find_layers(index, fmt, float_shapes(model), Q4_TARGET)
    dtypes = {k: TORCH_DTYPES.get(i.dtype, torch.int32) for k, i in index.items()}
    swap_quantized(model, layers, dtypes, torch.bfloat16)  # the float linears freed, packed ones on meta
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.to_empty(device="cuda", recurse=False)
    torch.cuda.empty_cache()
    with torch.no_grad():
        for key, p in model.named_parameters():
            a = t_arrays[key]
            t = torch.from_numpy(a.view("int16") if a.dtype.name == "bfloat16" else a.view("int32")).cuda()
            p.copy_(t.view(p.dtype) if a.dtype.name == "bfloat16" else t)
    model.eval().requires_grad_(False)
    try:
        return speed_8b._torch_decode(torch, model, "reduce-overhead", rows)
    except Exception as e:
        return {"mode": "reduce-overhead", "error": f"{type(e).__name__}: {str(e)[:400]}"}


if __name__ == "__main__":
    main()
