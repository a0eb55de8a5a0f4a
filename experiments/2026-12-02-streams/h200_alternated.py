"""On the H200: 1-stream DFlash on the 4-stream module against the 1-stream module, alternated in one
process, and solo == together on the 4-stream module (issue #29).

    bash bench/on_device.sh python3 experiments/2026-12-02-streams/h200_alternated.py --json $OUT/alternated_h200.json

Artifacts: .gpu/demo-s4d-sm_80 (the demo pair --streams 4, no depth cost file: every round verifies
the whole block) and .gpu/demo-sm_80 (one stream). Each of --rounds rounds runs
runtime/bench_parallel.py `run_parallel` at one stream on both modules, the order swapped every
round; the medians' ratio is the check (within 3%). Then each group of 4 prompts is decoded
together on the 4-stream module (greedy, and seeded T = 1) and each prompt alone on it, and the
tokens are compared (bf16: they can part at a near-tie, issue #24).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from dflash_iree.runtime.batch import BatchEngine
    from dflash_iree.runtime.bench import read_prompts
    from dflash_iree.runtime.bench_parallel import run_parallel
    from dflash_iree.runtime.engine import Engine
    from dflash_iree.runtime.options import GenerateOptions

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    prompts = read_prompts(ROOT / "bench/prompts/code.jsonl", 16)
    t, d = ROOT / "models/demo/target", ROOT / "models/demo/drafter"
    engines = {"s4": Engine.load(ROOT / ".gpu/demo-s4d-sm_80", t, d, "cuda"),
               "s1": Engine.load(ROOT / ".gpu/demo-sm_80", t, d, "cuda")}
    tok_s = {k: [] for k in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            res = run_parallel(engines[name], prompts, [1], 128, runs=1, log=None)
            tok_s[name].append(res["levels"]["1"]["dflash"]["aggregate_tok_s"])
            print(json.dumps({"round": r, "module": name, "dflash_tok_s": round(tok_s[name][-1], 1)}), flush=True)
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    out = {"dflash_tok_s": tok_s, "median": med, "s4_over_s1": med["s4"] / med["s1"]}
    batch = BatchEngine(engines["s4"])
    ids = [batch.encode_prompt(p) for p in prompts]
    solo = {}
    for label, opts in (("greedy", GenerateOptions(max_new_tokens=128)),
                        ("t1", GenerateOptions(max_new_tokens=128, temperature=1.0, seed=7))):
        together = []
        for g in range(0, len(ids), 4):
            together += [r.tokens for r in batch.generate_many(ids[g:g + 4], opts)]
        alone = [batch.generate_many([i], opts)[0].tokens for i in ids]
        solo[label] = sum(a == b for a, b in zip(together, alone))
        print(json.dumps({"solo_equals_together": label, "equal": solo[label], "of": len(ids)}), flush=True)
    out["solo_equals_together"] = {k: f"{v}/{len(ids)}" for k, v in solo.items()}
    print(json.dumps({"median": med, "s4_over_s1": round(out["s4_over_s1"], 4)}))
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
