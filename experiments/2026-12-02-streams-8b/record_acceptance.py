"""Record the demo pair's per-round accepted counts on the bench code prompts (host, eager, bf16,
greedy, block 8): the acceptance sequences the 8B-shape projection replays.

    .venv/bin/python experiments/2026-12-02-streams-8b/record_acceptance.py --limit 16 --out acceptance_demo.json
"""

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import SamplingConfig, generate_dflash

ap = argparse.ArgumentParser()
ap.add_argument("--models", default="models/demo")
ap.add_argument("--prompts", default="bench/prompts/code.jsonl")
ap.add_argument("--limit", type=int, default=16)
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--out", required=True)
args = ap.parse_args()
torch.set_num_threads(1)
tok = Tokenizer.from_file(str(Path(args.models) / "target" / "tokenizer.json"))
target, drafter = load_pair(Path(args.models) / "target", Path(args.models) / "drafter", max_context=512)
rows = [json.loads(line) for line in open(args.prompts)][: args.limit]
out = {"pair": args.models, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "block_size": drafter.block_size,
       "where": "host, eager, bf16, greedy", "sequences": []}
for row in rows:
    r = generate_dflash(target, drafter, tok.encode(row["prompt"]).ids, args.max_new_tokens, SamplingConfig())
    out["sequences"].append({"id": row["id"], "prompt_tokens": len(tok.encode(row["prompt"]).ids),
                             "new_tokens": len(r.tokens), "accepted": r.accepted})
taus = [a + 1 for s in out["sequences"] for a in s["accepted"]]
out["tau_mean"] = round(sum(taus) / len(taus), 3)
Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
print("tau", out["tau_mean"], "rounds", len(taus))
