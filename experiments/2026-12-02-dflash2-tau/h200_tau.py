"""On the H200: the demo target with its v1 drafter and with its DFlash2 drafter (models/demo/drafter2),
τ, tok/s and drafted == exact plain on the held-out code prompts, greedy and seeded T = 1.

    bash bench/on_device.sh python3 experiments/2026-12-02-dflash2-tau/h200_tau.py --json $OUT/tau_h200.json

Artifacts: .gpu/demo-sm_80 (v1) and .gpu/demo2-sm_80 (DFlash2), compiled here with
`dflash-iree compile --arch sm_80 --target models/demo/target --drafter models/demo/drafter{,2}
--out .gpu/demo{,2}-sm_80 --max-context 512`. Both engines live in one process; the two drafters'
benchmarks alternate `--rounds` times (runtime/bench.py `run_bench`: plain and DFlash alternated
per prompt, drafted == exact plain checked on the first run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from dflash_iree.runtime.bench import read_prompts, run_bench
    from dflash_iree.runtime.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    prompts = read_prompts(ROOT / "bench/prompts/code.jsonl", args.prompts)
    target = ROOT / "models/demo/target"
    engines = {name: Engine.load(ROOT / ".gpu" / art, target, ROOT / "models/demo" / d, args.device)
               for name, art, d in (("v1", "demo-sm_80", "drafter"), ("dflash2", "demo2-sm_80", "drafter2"))}
    result = {"device": args.device, "prompts": len(prompts), "max_new_tokens": 128, "runs": []}
    t0 = time.time()
    for r in range(args.rounds):
        for temperature in (0.0, 1.0):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                b = run_bench(engines[name], prompts, 128, temperature=temperature, seed=0, runs=1, log=None)
                result["runs"].append({"round": r, "drafter": name, "temperature": temperature, **b})
                print(json.dumps({"round": r, "drafter": name, "T": temperature, "same_tokens": b["same_tokens"],
                                  "tau": round(b["dflash"]["tau_mean"], 3), "speedup": round(b["speedup"], 3),
                                  "dflash_tok_s": round(b["dflash"]["decode_tok_s"]["median"], 1)}), flush=True)
    result["wall_s"] = round(time.time() - t0, 1)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
