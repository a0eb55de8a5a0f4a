"""On the GPU: the Qwen3-8B shape at MLX 4-bit with decode's RMSNorm in the packed GEMM's prologue
(.gpu/8b-q4-b16-sm_80, this tree) against the build before (.gpu/8b-q4before-sm_80, the product of
f41a583: IREE's norms), alternated in one process, with the bf16 build of the norm prologue
(.gpu/8b-b16np-sm_80) beside them for 4-bit's tok/s over bf16's.

    bash bench/on_device.sh python3 experiments/2026-12-07-q4-norm-prologue/run_8b.py --json out.json

Weights are random (experiments/2026-12-03-q4-gpu/run_8b.py `random_params`: the same packed tensors
for both 4-bit builds; bench/speed_8b.py's random modules for bf16). Steps as bench/speed_8b.py
`_iree_steps` times them; the arms q4, q4before, bf16 in turn, ROUNDS times, medians over rounds;
the first q4 arm with --profile (CUPTI kernel times). Also: the 16 decoded tokens of the two 4-bit
builds (equal unless the norm's bits differ from IREE's), and each build's verify against its decode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "experiments/2026-12-03-q4-gpu"))

import run_8b as q4run  # noqa: E402
import speed_8b  # noqa: E402
from common import copy_bandwidth, write_json  # noqa: E402

ARMS = {"q4": ROOT / ".gpu/8b-q4-b16-sm_80", "q4before": ROOT / ".gpu/8b-q4before-sm_80",
        "bf16": ROOT / ".gpu/8b-b16np-sm_80"}
KEYS = ("decode", "decode_ahead", "verify", "draft", "round_fused")


def main() -> None:
    import iree.runtime as rt
    import numpy as np
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    rec = {"device": torch.cuda.get_device_name(0), "copy": copy_bandwidth()}
    print(f"{rec['device']}, copy {rec['copy']['tb_per_s']} TB/s", flush=True)
    m4 = json.loads((ARMS["q4"] / "manifest.json").read_text())
    t_arrays = q4run.random_params(m4["parameters"]["target"], np.random.default_rng(0))
    q4_bytes = sum(a.nbytes for k, a in t_arrays.items() if not k.startswith("model.embed_tokens."))
    target, drafter = speed_8b._build(torch)
    embed = target.model.embed_tokens.weight
    bf16_bytes = speed_8b._bytes(target) - embed.numel() * embed.element_size()
    keep: list = []
    idx16 = speed_8b._indexes(target, drafter, keep)
    idx4 = {"target": q4run.index_of(t_arrays), "drafter": idx16["drafter"]}
    del target
    torch.cuda.empty_cache()
    rec["bytes"] = {"q4_target_read_per_step": q4_bytes, "bf16_target_read_per_step": bf16_bytes}
    device = rt.get_device("cuda")
    rows = -(-(speed_8b.PROMPT_LEN + speed_8b.STEPS + 3) // 32) * 32
    runs = {a: [] for a in ARMS}
    for r in range(args.rounds):
        for arm, folder in ARMS.items():
            res = speed_8b._iree_steps(folder, idx16 if arm == "bf16" else idx4, device, rows,
                                       profile=args.profile and r == 0 and arm == "q4")
            runs[arm].append(res)
            print(f"round {r + 1} {arm}: " + ", ".join(f"{k} {res[k]['median_ms']:.3f}" for k in KEYS if k in res)
                  + f", verify_agrees_with_decode {res['verify_agrees_with_decode']}", flush=True)
    rec["runs"] = runs
    med = {a: {k: statistics.median(x[k]["median_ms"] for x in rs) for k in KEYS if k in rs[0]} for a, rs in runs.items()}
    rec["median_ms"] = med
    rec["ratio_q4_over_before"] = {k: round(med["q4"][k] / med["q4before"][k], 4) for k in med["q4"]}
    bw = rec["copy"]["tb_per_s"] * 1e12
    rec["derived"] = {
        "q4_decode_tokens_equal_before": runs["q4"][0]["decode_tokens"] == runs["q4before"][0]["decode_tokens"],
        "q4_tok_s_over_bf16": med["bf16"]["decode_ahead"] / med["q4"]["decode_ahead"],
        "q4before_tok_s_over_bf16": med["bf16"]["decode_ahead"] / med["q4before"]["decode_ahead"],
        "q4_decode_ahead_frac_of_copy": q4_bytes / (med["q4"]["decode_ahead"] / 1e3) / bw,
        "bf16_decode_ahead_frac_of_copy": bf16_bytes / (med["bf16"]["decode_ahead"] / 1e3) / bw,
        "q4_verify16_over_decode": med["q4"]["verify"] / med["q4"]["decode"],
        "q4_verify16_over_decode_ahead": med["q4"]["verify"] / med["q4"]["decode_ahead"]}
    prof = runs["q4"][0].get("profile", {}).get("decode_ahead")
    if prof and prof.get("busy_ms"):
        rec["derived"]["q4_decode_kernel_ms"] = prof["busy_ms"]
        rec["derived"]["q4_decode_kernels_frac_of_copy"] = q4_bytes / (prof["busy_ms"] / 1e3) / bw
    print(json.dumps({"median_ms": med, "ratio_q4_over_before": rec["ratio_q4_over_before"], **rec["derived"]}, indent=1))
    write_json(args.json, rec)


if __name__ == "__main__":
    main()
