"""How high τ at T > 0 can go for a pair, whatever the draft's coupling with the target's sample.

Issue 23's goal is τ at T = 1 of 1.5x the greedy draft's (1.5 x 1.497 = 2.25 on the demo pair, host
f32). A drafted token d_k whose marginal is the drafter's distribution q_k (every coupled or sampled
draft; a greedy draft is a point mass) equals the target's sample x_k ~ p_k with probability at most
1 - TV(q_k, p_k), the maximal coupling. So a round's expected τ is at most
1 + sum_k prod_{j<=k} (1 - TV_j), with TV_j between the drafter's position-j distribution and the
target's distribution at that position given the tokens before it.

This script measures those TVs along the target's own sampled continuation (seeded plain sampling,
as the engine's; eager, float32, on the host): at each round's anchor of a coupled-drafting run, the
drafter's block logits (all block_size - 1 positions, one forward) against the target's logits at
the same positions from one cache-free forward of the finished sequence. It prints, per draft
position, the mean TV and mean 1 - TV, and the ceiling above, beside the measured coupled τ.

    .venv/bin/python experiments/2026-12-05-coupling-ceiling/ceiling.py --json experiments/2026-12-05-coupling-ceiling/ceiling_demo_t1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from coupled_drafting import _kept_probs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(ROOT / "models/demo/target"))
    ap.add_argument("--drafter", default=str(ROOT / "models/demo/drafter"))
    ap.add_argument("--prompts", default=str(ROOT / "bench/prompts/code.jsonl"))
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()

    import torch

    from dflash_iree.export import reference as ref
    from dflash_iree.export.load import load_pair
    from dflash_iree.runtime.bench import read_prompts
    from dflash_iree.runtime.text import TextCodec

    target, drafter = load_pair(args.target, args.drafter, max_context=1024, dtype="f32")
    codec = TextCodec(args.target)
    prompts = [codec.encode(p) if isinstance(p, str) else p for p in read_prompts(args.prompts, args.limit)]
    B = drafter.block_size
    tv_at = [[] for _ in range(B - 1)]
    ceilings, taus = [], []
    for i, prompt in enumerate(prompts):
        s = ref.SamplingConfig(args.temperature, 0, 1.0, seed=i)
        proposer = ref.DrafterProposer(target, drafter, ref.draft_sampling(s.tensors(), "coupled"))
        proposer.block_size = B
        rounds = []
        propose = proposer.propose

        def recording(tokens, new_taps, ctx_start, propose=propose, rounds=rounds):
            draft = propose(tokens, new_taps, ctx_start)
            rounds.append((len(tokens) - 1, proposer.last_logits.clone()))
            return draft

        proposer.propose = recording
        r = ref.generate_dflash(target, proposer, prompt, args.max_new_tokens, s)
        taus += [k + 1 for k in r.accepted]
        seq = torch.tensor([list(prompt) + r.tokens])
        with torch.no_grad():
            _, logits, _ = target(seq, torch.zeros(1, dtype=torch.int64), use_cache=False)
        end = seq.shape[1] - 1  # the target's distribution at position anchor + k needs its logits row there
        for anchor, d_logits in rounds:
            keep, ceiling = 1.0, 1.0
            for k in range(B - 1):
                if anchor + k >= end:
                    break
                p = _kept_probs(logits[0, anchor + k], args.temperature, 0, 1.0)
                q = _kept_probs(d_logits[k], args.temperature, 0, 1.0)
                tv = 0.5 * float((p - q).abs().sum())
                tv_at[k].append(tv)
                keep *= 1 - tv
                ceiling += keep
            ceilings.append(ceiling)
        print(f"prompt {i + 1}/{len(prompts)}: tau so far {statistics.mean(taus):.3f}, ceiling "
              f"{statistics.mean(ceilings):.3f}", file=sys.stderr, flush=True)
    rows = [{"draft_position": k + 1, "mean_tv": round(statistics.mean(v), 4), "mean_1_minus_tv":
             round(1 - statistics.mean(v), 4), "n": len(v)} for k, v in enumerate(tv_at) if v]
    def shown(path: str) -> str:
        return str(Path(path).resolve().relative_to(ROOT)) if Path(path).resolve().is_relative_to(ROOT) else path

    out = {"target": shown(args.target), "drafter": shown(args.drafter), "temperature": args.temperature, "limit": args.limit,
           "max_new_tokens": args.max_new_tokens, "coupled_tau": round(statistics.mean(taus), 4),
           "rounds": len(taus), "ceiling_tau": round(statistics.mean(ceilings), 4), "positions": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"T={args.temperature}: coupled tau {out['coupled_tau']}, ceiling (maximal coupling at every position) "
          f"{out['ceiling_tau']}")
    for row in rows:
        print(f"  position {row['draft_position']}: TV {row['mean_tv']:.3f}, 1 - TV {row['mean_1_minus_tv']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
