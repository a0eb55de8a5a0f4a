"""Exactness and speed of the compiled runtime on a GPU (the lent H200), against the eager CPU reference.

    python bench/gpu_check.py prepare --arch sm_89            # here: checkpoints, artifacts, eager tokens
                                    [--every-gemm]            # (the demo's matmuls all take the GEMM splice)
                                    [--pair qwen35]           # the hybrid pairs instead (issue #26)
    bash bench/on_device.sh python3 bench/gpu_check.py run --device cuda --json OUT.json [--pair qwen35]   # on the GPU machine
    python bench/gpu_check.py report OUT.json [--pair qwen35] # here: top-2 margins at divergences, table

`prepare` writes `.gpu/` (git-ignored; carry it to the device): a tiny float32 pair, both pairs
compiled for the arch, and the eager reference's tokens for the tiny pair. `--pair qwen35` takes
the Qwen3.5-family hybrid pairs: the tests' tiny float32 hybrid (tests/tiny_qwen35.py, 3 Gated
DeltaNet layers and a gated attention one, with a block-8 DFlash drafter) and models/demo-qwen35. `run` needs only
iree.runtime and NumPy. It checks:
- tiny float32 pair: compiled-on-GPU plain, exact and drafted tokens == eager-on-CPU tokens,
  greedy and seeded T=1, short and long, prompts of 1 to 150 tokens (two prefill chunks);
- the demo pair (bf16): drafted against plain through the verify graph (`exact`, must be equal
  bit for bit) and against plain through the decode graph (normal mode: the first divergence is
  reported; `report` adds the target's top-2 logit margin there, from the float32 eager model);
- the demo pair's speed: `dflash-iree bench`'s plain and drafted arms, alternated, greedy.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, WORK, main
# the last: 150 tokens, two whole prefill chunks of 64 (the prefill entry point) and the rest by verify
TINY_PROMPTS = [[7, 300, 12, 99, 5], list(range(40, 73)), [200], [(i * 37) % 500 + 3 for i in range(150)]]
# per pair: the folder names under .gpu/ (tiny checkpoints, artifacts "{name}-{arch}", expected
# tokens) and the demo pair's checkpoints
PAIRS = {"qwen3": {"tiny": "tiny", "demo": "demo", "expected": "expected.json", "models": ROOT / "models/demo"},
         "qwen35": {"tiny": "tiny35", "demo": "demo35", "expected": "expected35.json",
                    "models": ROOT / "models/demo-qwen35"}}
TINY_CASES = [("greedy", 0.0, 0), ("t1-seed3", 1.0, 3)]
LENGTHS = (4, 90)


def _tiny_pair(pair: str) -> tuple[Path, Path]:
    """The tiny float32 pair's checkpoint folders under .gpu/, written when missing (transformers
    writes the targets, tests/tiny.py the drafters)."""
    folder = WORK / PAIRS[pair]["tiny"]
    target, drafter = folder / "target", folder / "drafter"
    if target.exists():
        return target, drafter
    if pair == "qwen3":
        subprocess.run([sys.executable, str(ROOT / "tests" / "tiny.py"), str(folder)], check=True)
        return target, drafter
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import make_drafter
    from tiny_qwen35 import make_hybrid

    make_hybrid(target, seed=4)  # tests/conftest.py's hybrid_pair
    make_drafter(drafter, target, block_size=8, taps=(1, 3), mask_token_id=511)
    return target, drafter


def prepare(arch: str, every_gemm: bool = False, pair: str = "qwen3") -> None:
    """EVERY_GEMM: the demo pair's matmuls all take the skinny-GEMM splice (no 4 MiB floor: its
    384-wide weights are below it), to check the kernel, grouped dispatches included, in a model.
    PAIR: "qwen3" or "qwen35" (`PAIRS`)."""
    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_artifacts
    from dflash_iree.export.load import load_target
    from dflash_iree.export.reference import SamplingConfig, generate_plain

    WORK.mkdir(exist_ok=True)
    names = PAIRS[pair]
    target, drafter = _tiny_pair(pair)
    compile_artifacts(arch, target, drafter, WORK / f"{names['tiny']}-{arch}", max_context=256)
    splices = {**splice.LOWERINGS, "gemm": functools.partial(splice.lower_linear, min_weight_bytes=0)} if every_gemm else None
    compile_artifacts(arch, names["models"] / "target", names["models"] / "drafter", WORK / f"{names['demo']}-{arch}",
                      max_context=512, splices=splices)
    eager = load_target(target, 256)
    expected = {}
    for name, t, seed in TINY_CASES:
        for n in LENGTHS:
            for i, p in enumerate(TINY_PROMPTS):
                expected[f"{name}/{n}/{i}"] = generate_plain(eager, p, n, SamplingConfig(t, seed=seed)).tokens
    (WORK / names["expected"]).write_text(json.dumps({"arch": arch, "pair": pair, "tokens": expected}))


def _first_div(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _top_k_check(result, k: int) -> dict:
    """A greedy drafted result with draft_top_k = k: each round's top-1 ids are its draft tokens, so they
    equal the committed tokens on the accepted rows and differ from the target's token at the first
    rejected row; log-probs are <= 0, descending, and their total probability is <= 1."""
    c, top1_ok, lp_ok = 1, True, True  # tokens[0] came from prefill
    for accepted, tk in zip(result.accepted, result.draft_top_k):
        top1 = [row[0] for row in tk.ids]
        top1_ok &= top1[:accepted] == result.tokens[c:c + accepted]
        if accepted < len(top1) and c + accepted < len(result.tokens):
            top1_ok &= top1[accepted] != result.tokens[c + accepted]
        for lps in tk.logprobs:
            lp_ok &= all(a >= b for a, b in zip(lps, lps[1:])) and lps[0] <= 0
            lp_ok &= sum(math.exp(v) for v in lps) <= 1 + 1e-4
        c += accepted + 1
    return {"rounds": len(result.draft_top_k), "k": k, "top1_is_draft": top1_ok, "logprobs_ok": lp_ok}


def run(device: str, out: str, n_prompts: int, max_new_tokens: int, runs: int, tiny_only: bool = False,
        arch: str | None = None, pair: str = "qwen3") -> None:
    from dflash_iree.runtime.bench import read_prompts, run_bench
    from dflash_iree.runtime.engine import Engine

    names = PAIRS[pair]
    exp = json.loads((WORK / names["expected"]).read_text())
    arch = arch or exp["arch"]  # the expected tokens are the eager CPU reference's, the same for every arch
    result = {"device": device, "arch": arch, "pair": pair, "tiny": [], "demo": []}
    t0 = time.time()
    tiny_dir = WORK / names["tiny"]
    tiny = Engine.load(WORK / f"{names['tiny']}-{arch}", tiny_dir / "target", tiny_dir / "drafter", device)
    for name, t, seed in TINY_CASES:
        for n in LENGTHS:
            for i, p in enumerate(TINY_PROMPTS):
                want = exp["tokens"][f"{name}/{n}/{i}"]
                got = {mode: tiny.generate(p, n, temperature=t, seed=seed, **kw).tokens for mode, kw in
                       (("plain", dict(speculative=False)), ("exact", dict(speculative=False, exact=True)),
                        ("dflash", {}))}
                result["tiny"].append({"case": f"{name}/{n}/{i}", **{m: got[m] == want for m in got},
                                       "first_div": {m: _first_div(got[m], want) for m in got}})
    if tiny_only:
        Path(out).write_text(json.dumps(result) + "\n")
        print(summary(result))
        return
    demo_dir = WORK / f"{names['demo']}-{arch}"
    demo = Engine.load(demo_dir, names["models"] / "target", names["models"] / "drafter", device)
    # what the demo build spliced (prepare --every-gemm takes every matmul): part of the result
    result["demo_splices"] = json.loads((demo_dir / "manifest.json").read_text()).get("splices", {})
    prompts = read_prompts(ROOT / "bench/prompts/code.jsonl", n_prompts)
    for i, p in enumerate(prompts):
        plain = demo.generate(p, max_new_tokens, speculative=False).tokens
        exact = demo.generate(p, max_new_tokens, speculative=False, exact=True).tokens
        d = demo.generate(p, max_new_tokens)
        result["demo"].append({"prompt": i, "prompt_ids": demo.encode_prompt(p), "plain": plain, "exact": exact,
                               "dflash": d.tokens, "exact_equal": exact == d.tokens,
                               "plain_first_div": _first_div(plain, d.tokens), "tau_mean": d.tau_mean})
        if demo.artifacts.manifest.draft_top_k:
            tk = demo.generate(p, max_new_tokens, draft_top_k=4)
            result["demo"][-1]["draft_top_k"] = {**_top_k_check(tk, 4), "tokens_unchanged": tk.tokens == d.tokens}
    result["bench"] = run_bench(demo, prompts, max_new_tokens, runs=runs, log=None)
    result["wall_s"] = time.time() - t0
    Path(out).write_text(json.dumps(result) + "\n")
    print(summary(result))


def summary(result: dict) -> str:
    tiny = result["tiny"]
    lines = [f"{result['device']} ({result['arch']}): tiny float32 pair, {len(tiny)} cases: "
             + ", ".join(f"{m} == eager {sum(c[m] for c in tiny)}/{len(tiny)}" for m in ("plain", "exact", "dflash"))]
    demo = result["demo"]
    if not demo:
        return lines[0]
    lines.append(f"demo pair (bf16), {len(demo)} prompts: dflash == exact plain {sum(d['exact_equal'] for d in demo)}"
                 f"/{len(demo)}; dflash == plain (decode graph) {sum(d['plain_first_div'] is None for d in demo)}/{len(demo)}")
    tk = [d["draft_top_k"] for d in demo if "draft_top_k" in d]
    if tk:
        ok = sum(t["tokens_unchanged"] and t["top1_is_draft"] and t["logprobs_ok"] for t in tk)
        lines.append(f"draft_top_k=4: tokens unchanged, top-1 == draft tokens, log-probs sound: {ok}/{len(tk)} prompts "
                     f"({sum(t['rounds'] for t in tk)} rounds)")
    b = result["bench"]
    lines.append(f"demo speed: plain {b['plain']['decode_tok_s']['median']:.1f} tok/s, dflash "
                 f"{b['dflash']['decode_tok_s']['median']:.1f} tok/s, speedup {b['speedup']:.2f}x, tau {b['dflash']['tau_mean']:.2f}")
    return "\n".join(lines)


def report(path: str) -> None:
    """Add the target's float32 top-2 margin at every plain/drafted divergence of the demo pair."""
    from dflash_iree.export.load import load_target
    from dflash_iree.export.reference import top2_margin

    result = json.loads(Path(path).read_text())
    target = load_target(PAIRS[result.get("pair", "qwen3")]["models"] / "target", 512, dtype="f32")
    for d in result["demo"]:
        i = d["plain_first_div"]
        d["plain_div_margin"] = None if i is None else top2_margin(target, d["prompt_ids"] + d["dflash"][:i])
    Path(path).write_text(json.dumps(result) + "\n")
    print(summary(result))
    margins = [d["plain_div_margin"] for d in result["demo"] if d["plain_div_margin"] is not None]
    if margins:
        print(f"decode-graph divergences: {len(margins)}, top-2 margin there (f32 logits): max {max(margins):.4f}, "
              f"median {sorted(margins)[len(margins) // 2]:.4f}")


def _prepare_options(a) -> None:
    a.add_argument("--arch", default="sm_89")
    a.add_argument("--every-gemm", action="store_true", help="the demo's matmuls all take the skinny-GEMM splice")
    a.add_argument("--pair", choices=sorted(PAIRS), default="qwen3", help="the Qwen3 pairs or the hybrid ones")


def _run_options(r) -> None:
    r.add_argument("--device", default="cuda")
    r.add_argument("--json", required=True)
    r.add_argument("--prompts", type=int, default=16)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--runs", type=int, default=2)
    r.add_argument("--tiny-only", action="store_true", help="only the tiny float32 pair")
    r.add_argument("--arch", help="the artifacts .gpu/tiny-ARCH and .gpu/demo-ARCH (default: the prepared arch)")
    r.add_argument("--pair", choices=sorted(PAIRS), default="qwen3", help="as prepared")


if __name__ == "__main__":
    sys.exit(main(__doc__, {
        "prepare": (lambda a: prepare(a.arch, a.every_gemm, a.pair), _prepare_options),
        "run": (lambda a: run(a.device, a.json, a.prompts, a.max_new_tokens, a.runs, a.tiny_only, a.arch, a.pair),
                _run_options),
        "report": (lambda a: report(a.json), lambda s: s.add_argument("json"))}))
