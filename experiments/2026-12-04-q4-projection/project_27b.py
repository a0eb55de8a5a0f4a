"""Bytes a token and tok/s on paper for the Qwen3.5-27B target and its DFlash drafter at 4-bit on a
gfx1151 (212 GB/s), plain and DFlash (issue #28, "gfx1151, by inspection and on paper").

    .venv/bin/python experiments/2026-12-04-q4-projection/project_27b.py [--json OUT]

Shapes: tests/fixtures/qwen3.5-27b and qwen3.5-27b-dflash (config.json only; the modules are built on
the meta device, so every parameter is counted as the module holds it). 4-bit: MLX affine group 64, as
mlx-lm `convert -q` makes it (every nn.Linear and the embedding: u32 words of 8 values, a bf16 scale
and a bf16 bias a group, 4.5 bits a weight); the rest (norms, A_log, dt_bias, conv1d) as stored, bf16.
The drafter shares the target's embedding and lm_head (z-lab's DFlash); `--drafter-bits 4` quantizes
its own linears (export/quantized.py `on_load_prefixes`: not the lm_head, which is the target's).

A step reads: every weight once (decode: one row of the embedding), the KV cache up to the context,
and the DeltaNet state and conv window of every linear-attention layer (read and written, float32).
A DFlash round reads the target once (verify of B rows, weight-bound at these shapes: 2 * 27e9 * 16
flop is about 0.9 TFLOP, far below what the weights' read time allows on this chip), the drafter's
layers once and the shared lm_head again, and yields τ tokens. tok/s = bandwidth x efficiency / bytes
a token, at efficiency 1 (the roof) and at the fraction of copy measured on the H200 (bf16: the 8B decode
step's; 4-bit: the 4-bit GEMM's alone, so an upper bound for its step).
τ: the demo pair's (experiments named in the JSON), the only measured τ of a 4-bit target here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests/fixtures/qwen3.5-27b"
DRAFTER = ROOT / "tests/fixtures/qwen3.5-27b-dflash"
BANDWIDTH = 212e9  # gfx1151 (Strix Halo) LPDDR5X, bytes/s: the second document's figure
GROUP = 64
CONTEXT = 4096  # tokens in the KV cache when the step runs (a mid-length chat)
TAU = {  # the demo pair's measured τ (T = 0, bench/prompts/code.jsonl)
    "bf16 drafter on the mlx-lm 4-bit target (H200)": (3.65, "experiments/2026-12-03-q4-gpu/demo_q4_first_h200.json"),
}
# The step's fraction of copy bandwidth on the H200 (measured): bf16 plain decoding at the 8B shape,
# and the 4-bit GEMM alone (its step's share is lower still: attention, norms and gaps).
FRACTION = {"bf16": (0.567, "experiments/2026-12-03-gemm-m1-variants: the 8B bf16 decode step, 56.7% of copy"),
            "4-bit": (0.27, "experiments/2026-12-04-q4-superchunk: the 4-bit GEMM launched directly (CuPy, CUDA graphs) at 12288x4096, M = 1: 24.8 us")}


def packed_bytes(n: int, k: int) -> int:
    """MLX affine 4-bit, group 64: n * k / 2 bytes of words + 2 bf16 (scale, bias) a group."""
    return n * k // 2 + 2 * 2 * n * k // GROUP


def count(module, quantized: set[str]) -> dict:
    """Bytes of module's parameters: linears/embeddings in `quantized` 4-bit, the rest as held (bf16)."""
    import torch.nn as nn

    out = {"packed": 0, "bf16": 0, "embedding_row": 0}
    for name, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            n, k = (m.out_features, m.in_features) if isinstance(m, nn.Linear) else (m.num_embeddings, m.embedding_dim)
            if isinstance(m, nn.Embedding):
                out["embedding_row"] = packed_bytes(1, k) if name in quantized else 2 * k
                continue  # a step reads one row of the embedding
            out["packed" if name in quantized else "bf16"] += packed_bytes(n, k) if name in quantized else 2 * n * k
            if m.bias is not None:
                out["bf16"] += 2 * m.bias.numel()
    for name, p in module.named_parameters():
        owner = name.rpartition(".")[0]
        if not isinstance(module.get_submodule(owner), (nn.Linear, nn.Embedding)):
            out["bf16"] += 2 * p.numel()
    return out


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn as nn

    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export.dflash import DFlashDrafter
    from dflash_iree.export.qwen35 import Qwen35
    from dflash_iree.export.quantized import on_load_prefixes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(Path(__file__).with_name("project_27b.json")))
    args = ap.parse_args()
    tcfg = load_target_config(TARGET)
    dcfg = load_drafter_config(DRAFTER, tcfg)
    with torch.device("meta"):
        target = Qwen35(tcfg, 64, tuple(dcfg.target_layer_ids), 1, torch.bfloat16, state_slots=dcfg.block_size)
        drafter = DFlashDrafter(dcfg, 64, dcfg.block_size, 1, torch.bfloat16)
    t_lin = {n for n, m in target.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    t4, t16 = count(target, t_lin), count(target, set())
    d4, d16 = count(drafter, set(on_load_prefixes(drafter))), count(drafter, set())
    lm_head = next(m for n, m in target.named_modules() if n.endswith("lm_head"))
    lm4, lm16 = packed_bytes(lm_head.out_features, lm_head.in_features), 2 * lm_head.out_features * lm_head.in_features
    # KV cache of the attention layers at CONTEXT (bf16 K and V), and the DeltaNet state + conv window
    # (f32, read and written a step).
    attn = sum(1 for t in tcfg.layer_types if t == "full_attention")
    gdn = len(tcfg.layer_types) - attn
    kv = attn * 2 * tcfg.num_key_value_heads * tcfg.head_dim * 2 * CONTEXT
    hv, dk, dv = tcfg.linear_num_value_heads, tcfg.linear_key_head_dim, tcfg.linear_value_head_dim
    conv_ch = 2 * tcfg.linear_num_key_heads * dk + hv * dv
    state = gdn * 2 * 4 * (hv * dk * dv + conv_ch * (tcfg.linear_conv_kernel_dim - 1))
    dkv = dcfg.num_hidden_layers * 2 * dcfg.num_key_value_heads * dcfg.head_dim * 2 * (CONTEXT + dcfg.block_size)

    def step(w):
        return w["packed"] + w["bf16"] + w["embedding_row"]

    rows = []
    for label, tgt, drf, lm, kind in (("bf16 target, bf16 drafter", t16, d16, lm16, "bf16"),
                                      ("4-bit target, bf16 drafter", t4, d16, lm4, "4-bit"),
                                      ("4-bit target, 4-bit drafter", t4, d4, lm4, "4-bit")):
        eff = FRACTION[kind][0]
        plain = step(tgt) + kv + state
        rnd = step(tgt) + kv + state + step(drf) + dkv + lm  # verify + draft (the drafter's logits: the lm_head)
        row = {"arms": label, "plain_bytes_per_token": plain, "round_bytes": rnd,
               "fraction_of_copy": eff, "plain_tok_s_roof": BANDWIDTH / plain,
               "plain_tok_s_at_fraction": BANDWIDTH * eff / plain}
        for name, (tau, _) in TAU.items():
            row[f"dflash_tok_s_roof (τ {tau})"] = BANDWIDTH * tau / rnd
            row[f"dflash_tok_s_at_fraction (τ {tau})"] = BANDWIDTH * eff * tau / rnd
        rows.append(row)
    out = {"target": str(TARGET.relative_to(ROOT)), "drafter": str(DRAFTER.relative_to(ROOT)),
           "bandwidth_bytes_s": BANDWIDTH, "context": CONTEXT, "group": GROUP,
           "bytes": {"target_4bit": t4, "target_bf16": t16, "drafter_4bit": d4, "drafter_bf16": d16,
                     "lm_head_4bit": lm4, "lm_head_bf16": lm16, "kv_cache_at_context": kv,
                     "gdn_state_read_and_written": state, "drafter_kv_at_context": dkv},
           "tau": {k: {"tau": v[0], "source": v[1]} for k, v in TAU.items()},
           "fraction_of_copy": {k: {"value": v[0], "source": v[1]} for k, v in FRACTION.items()},
           "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print("| arms | plain GB a token | plain tok/s (roof / at the H200 fraction) | DFlash round GB | "
          "DFlash tok/s at τ 3.65 (roof / at the fraction) |")
    print("|---|---|---|---|---|")
    for r in rows:
        k1, k2 = [k for k in r if k.startswith("dflash_tok_s")]
        print(f"| {r['arms']} | {r['plain_bytes_per_token'] / 1e9:.2f} | {r['plain_tok_s_roof']:.1f} / "
              f"{r['plain_tok_s_at_fraction']:.1f} ({r['fraction_of_copy']}) | {r['round_bytes'] / 1e9:.2f} | "
              f"{r[k1]:.1f} / {r[k2]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
