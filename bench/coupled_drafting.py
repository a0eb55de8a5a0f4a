"""Coupled drafting at T > 0: the drafter's draft chosen with the target's own keyed noise, against a
greedy draft and against noise of another seed, on the same prompts and seeds.

`eager` (the host, torch, float32) runs the eager reference decoder (export/reference.py) per arm
and reports, per temperature: τ, the first-draft match rate (rounds whose first draft token was
accepted) and, beside it, the mean of the coupling bound (1 - TV) / (1 + TV) (Daliri, Musco and
Suresh 2024), with TV the total variation between the drafter's and the target's distributions of
the first drafted token, computed at the same positions (each after the request's top-k / top-p:
the target's kept set, and the drafter's whole distribution, or its own kept set where the draft is
cut: export/sampling.py `DRAFT_CUT`). For greedy
drafting the matching figure is p_target(draft), the probability that the target draws it. With a
top-k or top-p, a fourth arm drafts with the same noise over the other range than `DRAFT_CUT` picks:
"coupled-cut" over the drafter's own top-k / top-p kept set when the draft ranges over the whole
vocabulary (the default), "coupled-vocab" otherwise: the measurement behind `DRAFT_CUT`.

`compiled` runs compiled artifacts (the host, or a GPU through bench/on_device.sh) with the arms
alternated per prompt (coupled, greedy, other, coupled, ...), every arm as separate `draft` and
`verify` calls (one graph for all three, so tok/s compare like with like), plus the default fused
round of coupled drafting; it reports τ, the first-draft rate and decode tok/s (median over prompts),
and checks that every arm gives the same tokens.

    python bench/coupled_drafting.py eager --target models/demo/target --drafter models/demo/drafter --json F
    python bench/coupled_drafting.py compiled --artifacts compiled/host --json F
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("coupled", "greedy", "other")


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default=str(ROOT / "bench/prompts/code.jsonl"))
    p.add_argument("--limit", type=int, default=16, help="prompts to use (the first ones)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0.6,1.0")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--json", required=True, help="write the result here")


def _prompts(args) -> list:
    from dflash_iree.runtime.bench import read_prompts

    return read_prompts(args.prompts, args.limit)


def _kept_probs(logits, temperature: float, top_k: int, top_p: float):
    """softmax(logits / T) over the tokens that survive top-k and top-p, renormalised (float64 [V])."""
    import torch

    scores = logits.double() / temperature
    probs = torch.softmax(scores, -1)
    order = torch.argsort(scores, descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        mass = torch.cumsum(probs[order], 0)
        keep[order[1:][mass[:-1] >= top_p]] = False  # the smallest prefix reaching top_p
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def eager(args) -> int:
    import torch

    from dflash_iree.export import reference as ref
    from dflash_iree.export.load import load_pair
    from dflash_iree.export import sampling as sampling_module
    from dflash_iree.export.sampling import DRAFT_CUT
    from dflash_iree.runtime.text import TextCodec

    torch.set_num_threads(max(1, torch.get_num_threads()))
    target, drafter = load_pair(args.target, args.drafter, max_context=args.max_context, dtype="f32")
    codec = TextCodec(args.target)
    prompts = [codec.encode(p) if isinstance(p, str) else p for p in _prompts(args)]
    rows = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        sampling = ref.SamplingConfig(temperature, args.top_k, args.top_p)
        flip = "coupled-vocab" if DRAFT_CUT else "coupled-cut"
        arms = ARMS + ((flip,) if args.top_k or args.top_p < 1.0 else ())
        per_arm = {arm: {"tau": [], "first": [], "bound": [], "p_draft": [], "tokens": []} for arm in arms}
        for i, prompt in enumerate(prompts):
            for arm in arms:
                s = ref.SamplingConfig(temperature, args.top_k, args.top_p, seed=i)
                cut = (not DRAFT_CUT) if arm == flip else DRAFT_CUT
                sampling_module.DRAFT_CUT = cut  # read by draft_tokens at each call
                proposer = ref.DrafterProposer(target, drafter, ref.draft_sampling(s.tensors(), arm.split("-")[0]))
                proposer.block_size = drafter.block_size
                firsts = []
                propose = proposer.propose

                def recording(tokens, new_taps, ctx_start, propose=propose, firsts=firsts):
                    draft = propose(tokens, new_taps, ctx_start)
                    firsts.append((len(tokens) - 1, proposer.last_logits[0].clone(), draft[0]))
                    return draft

                proposer.propose = recording
                r = ref.generate_dflash(target, proposer, prompt, args.max_new_tokens, s)
                a = per_arm[arm]
                a["tau"] += [k + 1 for k in r.accepted]
                a["first"] += [k > 0 for k in r.accepted]
                a["tokens"].append(r.tokens)
                # the target's distributions at the anchors, from one cache-free forward of the sequence
                seq = torch.tensor([list(prompt) + r.tokens])
                with torch.no_grad():
                    _, logits, _ = target(seq, torch.zeros(1, dtype=torch.int64), use_cache=False)
                for anchor, d_logits, d0 in firsts:
                    p = _kept_probs(logits[0, anchor], temperature, args.top_k, args.top_p)
                    q = _kept_probs(d_logits, temperature, args.top_k if cut else 0, args.top_p if cut else 1.0)
                    tv = 0.5 * float((p - q).abs().sum())
                    a["bound"].append((1 - tv) / (1 + tv))
                    a["p_draft"].append(float(p[d0]))
            print(f"T={temperature} prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
        sampling_module.DRAFT_CUT = DRAFT_CUT
        same = all(per_arm[arm]["tokens"] == per_arm["coupled"]["tokens"] for arm in arms)
        for arm in arms:
            a = per_arm[arm]
            rows.append({"temperature": temperature, "arm": arm, "tau": statistics.mean(a["tau"]),
                         "rounds": len(a["tau"]), "first_draft_match": statistics.mean(a["first"]),
                         "coupling_bound": statistics.mean(a["bound"]),
                         "p_target_of_draft": statistics.mean(a["p_draft"]), "same_tokens": same})
    result = {"bench": "coupled_drafting", "mode": "eager", "target": args.target, "drafter": args.drafter,
              "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "top_k": args.top_k, "top_p": args.top_p, "draft_cut": DRAFT_CUT, "rows": rows}
    _finish(args, result, ("temperature", "arm", "tau", "first_draft_match", "coupling_bound",
                           "p_target_of_draft", "rounds", "same_tokens"))
    return 0


def compiled(args) -> int:
    from dflash_iree.runtime.engine import Engine

    engine = Engine.load(args.artifacts, device=args.device)
    prompts = _prompts(args)
    arms = {arm: engine.with_seams(fused_round=False, draft_noise=arm) for arm in ARMS}
    arms["coupled-fused"] = engine
    rows = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        got = {arm: {"tau": [], "first": [], "tok_s": [], "tokens": []} for arm in arms}
        kw = dict(temperature=temperature, top_k=args.top_k, top_p=args.top_p)
        for e in arms.values():  # warm every graph
            e.generate(prompts[0], 8, seed=0, **kw)
        for i, prompt in enumerate(prompts):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))  # alternate, so drift hits all alike
            for arm in order:
                r = arms[arm].generate(prompt, args.max_new_tokens, seed=i, **kw)
                g = got[arm]
                g["tau"] += [k + 1 for k in r.accepted]
                g["first"] += [k > 0 for k in r.accepted]
                g["tok_s"].append(r.decode_tok_s)
                g["tokens"].append(r.tokens)
            print(f"T={temperature} prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
        same = all(got[arm]["tokens"] == got["coupled"]["tokens"] for arm in arms)
        for arm, g in got.items():
            rows.append({"temperature": temperature, "arm": arm, "tau": statistics.mean(g["tau"]),
                         "rounds": len(g["tau"]), "first_draft_match": statistics.mean(g["first"]),
                         "decode_tok_s": statistics.median(g["tok_s"]), "same_tokens": same})
    result = {"bench": "coupled_drafting", "mode": "compiled", "artifacts": str(args.artifacts),
              "arch": engine.artifacts.manifest.arch, "device": args.device, "prompts": args.prompts,
              "limit": args.limit, "max_new_tokens": args.max_new_tokens, "top_k": args.top_k,
              "top_p": args.top_p, "rows": rows}
    _finish(args, result, ("temperature", "arm", "tau", "first_draft_match", "decode_tok_s", "rounds", "same_tokens"))
    return 0


def _finish(args, result: dict, columns: tuple) -> None:
    result["date"] = time.strftime("%Y-%m-%d")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(" | ".join(columns))
    for row in result["rows"]:
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    greedy = {r["temperature"]: r["tau"] for r in result["rows"] if r["arm"] == "greedy"}
    for r in result["rows"]:
        if r["arm"].startswith("coupled"):
            print(f"T={r['temperature']} {r['arm']}: tau {r['tau']:.3f} = {r['tau'] / greedy[r['temperature']]:.2f}x "
                  "the greedy draft's")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eager")
    _options(e)
    e.add_argument("--target", default=str(ROOT / "models/demo/target"))
    e.add_argument("--drafter", default=str(ROOT / "models/demo/drafter"))
    e.add_argument("--max-context", type=int, default=512)
    c = sub.add_parser("compiled")
    _options(c)
    c.add_argument("--artifacts", default=str(ROOT / "compiled/host"))
    c.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    return eager(args) if args.cmd == "eager" else compiled(args)


if __name__ == "__main__":
    sys.exit(main())
