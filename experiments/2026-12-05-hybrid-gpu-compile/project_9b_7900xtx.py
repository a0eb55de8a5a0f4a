"""Bytes a token and tok/s on paper for the Qwen3.5-9B target and its DFlash drafter in bf16 on an
RX 7900 XTX (gfx1100, 24 GB, 960 GB/s): issue #26's "the 9B shape too" projection.

    .venv/bin/python experiments/2026-12-05-hybrid-gpu-compile/project_9b_7900xtx.py [--json OUT]

The counting is experiments/2026-12-04-q4-projection/project_27b.py's (`count`, imported from it):
every weight once a step (one embedding row), the attention layers' KV cache at CONTEXT tokens and
the DeltaNet state and conv window (f32, read and written). A DFlash round reads the target once
(verify of B rows, weight-bound at this shape), the drafter's layers and KV cache, and the target's
lm_head again for the draft's logits, and yields τ tokens. Also whether it fits: weights + KV cache
+ the recurrent state's per-row slots (B of them, export/recurrent_state.py) + the drafter's cache
against 24 GB. Nothing is measured on the chip (there is no AMD GPU here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests/fixtures/qwen3.5-9b"
DRAFTER = ROOT / "tests/fixtures/qwen3.5-9b-dflash"
BANDWIDTH = 960e9  # RX 7900 XTX, bytes/s (AMD's figure)
MEMORY = 24e9  # its VRAM, bytes
CONTEXT = 4096
TAU = (3.61, "experiments/2026-12-03-q4-gpu: the demo pair's bf16 τ on the H200 (T = 0, bench/prompts/code.jsonl)")
FRACTION = (0.567, "experiments/2026-12-03-gemm-m1-variants: the 8B bf16 decode step, 56.7% of copy on the H200")


def _project_27b():
    spec = importlib.util.spec_from_file_location(
        "project_27b", ROOT / "experiments/2026-12-04-q4-projection/project_27b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import torch

    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export.dflash import DFlashDrafter
    from dflash_iree.export.qwen35 import Qwen35

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(Path(__file__).with_name("project_9b_7900xtx.json")))
    args = ap.parse_args()
    count = _project_27b().count
    tcfg = load_target_config(TARGET)
    dcfg = load_drafter_config(DRAFTER, tcfg)
    B = dcfg.block_size
    with torch.device("meta"):
        target = Qwen35(tcfg, 64, tuple(dcfg.target_layer_ids), 1, torch.bfloat16, state_slots=B)
        drafter = DFlashDrafter(dcfg, 64, B, 1, torch.bfloat16)
    t, d = count(target, set()), count(drafter, set())
    lm = 2 * tcfg.vocab_size * tcfg.hidden_size
    attn = sum(1 for x in tcfg.layer_types if x == "full_attention")
    gdn = len(tcfg.layer_types) - attn
    kv = attn * 2 * tcfg.num_key_value_heads * tcfg.head_dim * 2 * CONTEXT
    hv, dk, dv = tcfg.linear_num_value_heads, tcfg.linear_key_head_dim, tcfg.linear_value_head_dim
    conv = 2 * tcfg.linear_num_key_heads * dk + hv * dv
    one_state = gdn * 4 * (hv * dk * dv + conv * (tcfg.linear_conv_kernel_dim - 1))
    dkv = dcfg.num_hidden_layers * 2 * dcfg.num_key_value_heads * dcfg.head_dim * 2 * (CONTEXT + B)
    weights_t = t["packed"] + t["bf16"] + 2 * tcfg.vocab_size * tcfg.hidden_size  # the whole embedding is held
    weights_d = d["packed"] + d["bf16"]
    step_t = t["packed"] + t["bf16"] + t["embedding_row"]
    plain = step_t + kv + 2 * one_state
    rnd = step_t + kv + 2 * one_state + weights_d + dkv + lm
    held = weights_t + weights_d + kv + B * one_state + dkv
    eff, tau = FRACTION[0], TAU[0]
    out = {"target": str(TARGET.relative_to(ROOT)), "drafter": str(DRAFTER.relative_to(ROOT)), "block_size": B,
           "bandwidth_bytes_s": BANDWIDTH, "memory_bytes": MEMORY, "context": CONTEXT,
           "bytes": {"target_weights_held": weights_t, "target_step_weights": step_t, "drafter_weights": weights_d,
                     "lm_head": lm, "kv_cache_at_context": kv, "gdn_state_one_step": one_state,
                     "gdn_state_slots": B * one_state, "drafter_kv_at_context": dkv},
           "held_bytes": held, "fits": held < MEMORY,
           "plain_bytes_per_token": plain, "round_bytes": rnd,
           "plain_tok_s_roof": BANDWIDTH / plain, "plain_tok_s_at_fraction": BANDWIDTH * eff / plain,
           "dflash_tok_s_roof": BANDWIDTH * tau / rnd, "dflash_tok_s_at_fraction": BANDWIDTH * eff * tau / rnd,
           "tau": {"value": tau, "source": TAU[1]}, "fraction_of_copy": {"value": eff, "source": FRACTION[1]}}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"held on the card: {held / 1e9:.2f} GB of 24 ({'fits' if out['fits'] else 'does NOT fit'}): weights "
          f"{(weights_t + weights_d) / 1e9:.2f}, KV {kv / 1e9:.3f}, state slots {B * one_state / 1e9:.3f}, "
          f"drafter KV {dkv / 1e9:.3f}")
    print("| | GB a token (plain) / a round (DFlash) | tok/s at the roof | tok/s at the H200's fraction (0.567) |")
    print("|---|---|---|---|")
    print(f"| plain | {plain / 1e9:.2f} | {out['plain_tok_s_roof']:.1f} | {out['plain_tok_s_at_fraction']:.1f} |")
    print(f"| DFlash, τ {tau} | {rnd / 1e9:.2f} | {out['dflash_tok_s_roof']:.1f} | {out['dflash_tok_s_at_fraction']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
