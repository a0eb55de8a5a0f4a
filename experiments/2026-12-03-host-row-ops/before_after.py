"""The demo pair on the host, built before and after the row-invariant flag, side by side in one process
(issue #24): decode tok/s of plain and of DFlash decoding, and drafted == plain, per build.

    .venv/bin/python experiments/2026-12-03-host-row-ops/before_after.py --before /tmp/rowinv/before \
        --after /tmp/rowinv/after --json experiments/2026-12-03-host-row-ops/before_after.json

Each round runs the prompts (bench/prompts/code.jsonl, greedy, --max-new-tokens) through the four arms
(build x plain/DFlash), the order rotated every round. tok/s is new tokens over the summed decode
time (GenerationResult.decode_s: first token to last, prefill excluded), per arm and round; the
medians over rounds are compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from dflash_iree.runtime.bench import read_prompts
    from dflash_iree.runtime.engine import Engine
    from dflash_iree.runtime.options import GenerateOptions

    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default=None, help="IREE device (default: the artifacts'; cuda on the H200)")
    args = ap.parse_args()
    t, d = str(ROOT / "models/demo/target"), str(ROOT / "models/demo/drafter")
    engines = {"before": Engine.load(args.before, t, d, args.device), "after": Engine.load(args.after, t, d, args.device)}
    prompts = [engines["after"].encode_prompt(p) for p in read_prompts(ROOT / "bench/prompts/code.jsonl", args.limit)]
    arms = [(b, s) for b in engines for s in (False, True)]
    name = lambda b, s: f"{b} {'DFlash' if s else 'plain'}"  # noqa: E731
    for b, s in arms:  # warm-up
        engines[b].generate(prompts[0], options=GenerateOptions(max_new_tokens=8, speculative=s))
    tok_s = {name(*a): [] for a in arms}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for b, s in order:
            o = GenerateOptions(max_new_tokens=args.max_new_tokens, speculative=s)
            res = [engines[b].generate(p, options=o) for p in prompts]
            tokens[name(b, s)] = [g.tokens for g in res]
            tok_s[name(b, s)].append(sum(len(g.tokens) - 1 for g in res) / sum(g.decode_s for g in res))
            print(json.dumps({"round": r, "arm": name(b, s), "tok_s": round(tok_s[name(b, s)][-1], 1)}), flush=True)
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    agree = {b: sum(x == y for x, y in zip(tokens[f"{b} DFlash"], tokens[f"{b} plain"])) for b in engines}
    agree_t1 = {}  # seeded sampling at T = 1 (top_p 0.95), once per build
    for b, e in engines.items():
        got = {s: [e.generate(p, options=GenerateOptions(max_new_tokens=args.max_new_tokens, speculative=s,
                                                          temperature=1.0, top_p=0.95, seed=i)).tokens
                   for i, p in enumerate(prompts)] for s in (False, True)}
        agree_t1[b] = sum(x == y for x, y in zip(got[True], got[False]))
    out = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "tok_s": tok_s,
           "median": med, "drafted_equals_plain": agree, "drafted_equals_plain_t1": agree_t1,
           "after_over_before": {s: med[f"after {s}"] / med[f"before {s}"] for s in ("plain", "DFlash")}}
    print("| build | plain tok/s | DFlash tok/s | drafted == plain, greedy | at T = 1 |\n|---|---|---|---|---|")
    for b in engines:
        print(f"| {b} | {med[f'{b} plain']:.1f} | {med[f'{b} DFlash']:.1f} | {agree[b]}/{len(prompts)} | "
              f"{agree_t1[b]}/{len(prompts)} |")
    print(json.dumps({"after_over_before": {k: round(v, 4) for k, v in out["after_over_before"].items()}}))
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
