"""The demo target in bf16 and 4-bit (MLX-written, compressed-tensors-written) with the bf16 demo drafter,
side by side in one process on one device (issue #28): plain and DFlash tok/s, τ, drafted == plain
(greedy and seeded T = 1), and where each 4-bit arm's tokens part from the bf16 target's.

    python3 experiments/2026-12-03-q4-gpu/demo_q4.py --device cuda --arm bf16 .gpu/demo-u16r-sm_80 models/demo/target \
        --arm mlx4 .gpu/demo-mlx4-sm_80 .gpu/demo-mlx4-target --json out.json

Each round runs the prompts (bench/prompts/code.jsonl, greedy, --max-new-tokens) through every (arm,
plain/DFlash), the order rotated every round; tok/s is new tokens over the summed decode time
(first token to last), medians over rounds. τ: accepted + 1 per round, over all rounds of the prompts.
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
    ap.add_argument("--arm", nargs=3, action="append", metavar=("NAME", "ARTIFACTS", "TARGET"), required=True)
    ap.add_argument("--drafter", default=str(ROOT / "models/demo/drafter"))
    ap.add_argument("--json", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    engines = {n: Engine.load(a, t, args.drafter, args.device) for n, a, t in args.arm}
    first = next(iter(engines.values()))
    prompts = [first.encode_prompt(p) for p in read_prompts(ROOT / "bench/prompts/code.jsonl", args.limit)]
    arms = [(b, s) for b in engines for s in (False, True)]
    name = lambda b, s: f"{b} {'DFlash' if s else 'plain'}"  # noqa: E731
    for b, s in arms:
        engines[b].generate(prompts[0], options=GenerateOptions(max_new_tokens=8, speculative=s))
    tok_s = {name(*a): [] for a in arms}
    tokens, tau = {}, {}
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for b, s in order:
            res = [engines[b].generate(p, options=GenerateOptions(max_new_tokens=args.max_new_tokens, speculative=s))
                   for p in prompts]
            tokens[name(b, s)] = [g.tokens for g in res]
            if s:
                taus = [t for g in res for t in g.tau]
                tau[b] = sum(taus) / len(taus)
            tok_s[name(b, s)].append(sum(len(g.tokens) - 1 for g in res) / sum(g.decode_s for g in res))
            print(json.dumps({"round": r, "arm": name(b, s), "tok_s": round(tok_s[name(b, s)][-1], 1)}), flush=True)
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    agree = {b: sum(x == y for x, y in zip(tokens[f"{b} DFlash"], tokens[f"{b} plain"])) for b in engines}
    agree_t1 = {}
    for b, e in engines.items():
        got = {s: [e.generate(p, options=GenerateOptions(max_new_tokens=args.max_new_tokens, speculative=s,
                                                          temperature=1.0, top_p=0.95, seed=i)).tokens
                   for i, p in enumerate(prompts)] for s in (False, True)}
        agree_t1[b] = sum(x == y for x, y in zip(got[True], got[False]))
    base = next(iter(engines))

    def first_split(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)

    parts = {b: [first_split(x, y) for x, y in zip(tokens[f"{b} plain"], tokens[f"{base} plain"])] for b in engines}
    out = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
           "arms": {n: {"artifacts": a, "target": t} for n, a, t in args.arm}, "tok_s": tok_s, "median": med,
           "tau": tau, "drafted_equals_plain": agree, "drafted_equals_plain_t1": agree_t1,
           "first_divergence_from_" + base: parts,
           "speedup": {b: med[f"{b} DFlash"] / med[f"{b} plain"] for b in engines},
           "over_" + base: {b: {s: med[f"{b} {s}"] / med[f"{base} {s}"] for s in ("plain", "DFlash")} for b in engines}}
    print("| target | plain tok/s | DFlash tok/s | DFlash / plain | τ | drafted == plain, greedy | at T = 1 |"
          f" plain tokens == {base}'s |\n|---|---|---|---|---|---|---|---|")
    for b in engines:
        same = sum(p is None for p in parts[b])
        print(f"| {b} | {med[f'{b} plain']:.1f} | {med[f'{b} DFlash']:.1f} | {out['speedup'][b]:.2f} | {tau[b]:.2f} | "
              f"{agree[b]}/{len(prompts)} | {agree_t1[b]}/{len(prompts)} | {same}/{len(prompts)} |")
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
