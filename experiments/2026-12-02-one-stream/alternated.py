"""1-stream DFlash on a module of S streams, through its one-stream form and through the S-stream
calls, against the one-stream module: alternated in one process (issue #29: medians within 3%).

    .venv/bin/python experiments/2026-12-02-one-stream/alternated.py --s4 /tmp/one/demo-s4-host \
        --s1 /tmp/one/demo-host --json experiments/2026-12-02-one-stream/host.json
    (on the H200: --device cuda --s4 .gpu/demo-s4-sm_80 --s1 .gpu/demo-sm_80, run_device.sh; --target and
    --drafter: the checkpoints, default the demo pair)

Each of --rounds rounds decodes the prompts one at a time (drafted, greedy, --max-new-tokens) with
each arm, the arms' order rotated every round: `s4_one` (BatchEngine on the S-stream module, its
one-stream calls), `s4_all` (the same module, one_stream=False: every round computes all S slots,
the behaviour before) and `s1` (the one-stream module). Reported per arm: tok/s of each round
(new tokens over the arm's wall time, prefills included) and the median; the check is
median(s4_one) / median(s1) >= 0.97. The tokens of the three arms are compared too (float32 on the
host: equal; bf16 can part at a near-tie).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from dflash_iree.runtime.batch import BatchEngine
    from dflash_iree.runtime.bench import read_prompts
    from dflash_iree.runtime.engine import Engine
    from dflash_iree.runtime.options import GenerateOptions

    ap = argparse.ArgumentParser()
    ap.add_argument("--s4", required=True, help="artifacts of the demo pair compiled with --streams 4")
    ap.add_argument("--s1", required=True, help="artifacts of the demo pair compiled with --streams 1")
    ap.add_argument("--target", default=str(ROOT / "models/demo/target"))
    ap.add_argument("--drafter", default=str(ROOT / "models/demo/drafter"))
    ap.add_argument("--device", default=None, help="IREE device (default: the artifacts'; cuda on the H200)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=8, help="prompts of bench/prompts/code.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    prompts = read_prompts(ROOT / "bench/prompts/code.jsonl", args.limit)
    t, d = args.target, args.drafter
    e4 = Engine.load(args.s4, t, d, args.device)
    e1 = Engine.load(args.s1, t, d, args.device)
    arms = {"s4_one": BatchEngine(e4), "s4_all": BatchEngine(e4, one_stream=False), "s1": BatchEngine(e1)}
    assert arms["s4_one"].calls.one_stream and not arms["s4_all"].calls.one_stream, "the S=4 module lacks the one-stream form"
    if e1.codec is None:  # a pair without a tokenizer (the tests' tiny pair): made-up prompts of ids
        ids = [[(37 * i + 11 * j) % 500 + 1 for j in range(8 + 3 * i)] for i in range(args.limit)]
    else:
        ids = [arms["s1"].encode_prompt(p) for p in prompts]
    o = GenerateOptions(max_new_tokens=args.max_new_tokens)
    for b in arms.values():  # warm-up: first calls pay one-time setup
        b.generate_many(ids[:1], GenerateOptions(max_new_tokens=8))
    tok_s = {k: [] for k in arms}
    tokens = {}
    names = list(arms)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            res = arms[name].generate_many(ids, o, concurrency=1)
            wall = time.perf_counter() - t0
            tokens[name] = [g.tokens for g in res]
            tok_s[name].append(sum(len(g.tokens) for g in res) / wall)
            print(json.dumps({"round": r, "arm": name, "tok_s": round(tok_s[name][-1], 1)}), flush=True)
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    out = {"s4": args.s4, "s1": args.s1, "device": args.device, "host": platform.node(), "prompts": len(ids),
           "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "tok_s": tok_s, "median": med,
           "s4_one_over_s1": med["s4_one"] / med["s1"], "s4_all_over_s1": med["s4_all"] / med["s1"],
           "same_tokens": {k: sum(a == b for a, b in zip(tokens[k], tokens["s1"])) for k in ("s4_one", "s4_all")}}
    print(json.dumps({"median": {k: round(v, 1) for k, v in med.items()},
                      "s4_one_over_s1": round(out["s4_one_over_s1"], 4),
                      "s4_all_over_s1": round(out["s4_all_over_s1"], 4), "same_tokens": out["same_tokens"]}))
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
