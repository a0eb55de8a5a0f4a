"""solo == together on a GPU in bf16 (issue #29), on the demo pair compiled with --streams 4 under the
row-invariant lowerings (issue #24).

    bash bench/on_device.sh python3 experiments/2026-12-03-gpu-row-invariance/solo_together.py \
        --artifacts .gpu/demo-s4-ri-sm_80 --device cuda --json OUT.json

12 bench prompts (bench/prompts/code.jsonl), each with its own options: max_new_tokens 24..112,
greedy or seeded at T = 0.7 / 1.0 (top_p 0.95), drafted (DFlash) or plain. Together: all through one
BatchEngine, 4 at a time, so requests join and leave at different rounds. Solo: each alone
(concurrency 1). Every request's tokens must be the same; the script prints the count and writes them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from dflash_iree.runtime.batch import BatchEngine
    from dflash_iree.runtime.bench import read_prompts
    from dflash_iree.runtime.options import GenerateOptions

    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    b = BatchEngine.load(args.artifacts, str(ROOT / "models/demo/target"), str(ROOT / "models/demo/drafter"), args.device)
    prompts = read_prompts(ROOT / "bench/prompts/code.jsonl", 12)
    temps = (0.0, 0.7, 1.0)
    opts = [GenerateOptions(max_new_tokens=24 + 8 * i, temperature=temps[i % 3], top_p=0.95, seed=100 + i,
                            speculative=i % 4 != 3) for i in range(len(prompts))]
    together = b.generate_many(prompts, opts)
    solo = b.generate_many(prompts, opts, concurrency=1)
    same = [t.tokens == s.tokens for t, s in zip(together, solo)]
    out = {"artifacts": args.artifacts, "requests": len(prompts), "same": sum(same), "per_request": same,
           "options": [{"max_new_tokens": o.max_new_tokens, "temperature": o.temperature, "speculative": o.speculative}
                       for o in opts],
           "together_tokens": [t.tokens for t in together], "solo_tokens": [s.tokens for s in solo]}
    print(f"solo == together: {sum(same)}/{len(prompts)}")
    Path(args.json).write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
