"""The demo pair on a GPU: plain decoding against drafted, with a round as two calls (`draft`, then
`verify`) and as one (`verify_draft`), for the GEMM splice as `make compile` does it and two variants.

    python experiments/2026-11-30-one-call-rounds/demo_rounds.py prepare --arch sm_80             # here: .gpu/demo-VARIANT-sm_80
    bash bench/on_device.sh python3 experiments/2026-11-30-one-call-rounds/demo_rounds.py run --json OUT   # there
    python experiments/2026-11-30-one-call-rounds/demo_rounds.py report OUT                       # here: the table

`prepare --attention fused|matmul` builds the variants with that attention form (export/qwen3.py
`attend` / `attend_matmul`) in place of the arch's own (folders `demo-VARIANT-ATTENTION-ARCH`,
`run --variants VARIANT-ATTENTION`), to compare the two on a GPU backend (the fused form also exports
the q/k norm + rope custom op, which has a kernel on GPU archs only). The results file
`demo_rounds_host_attention.json` was made when the host still exported the fused form by default:
its `gemm4m` is the fused form, `gemm4m-matmul` the matmul one.

Variants (export/splice.py): `gemm`, every bf16 weight matmul with 2 <= M <= 64 on the skinny-GEMM
dispatch; `gemm4m`, only weights of at least 4 MiB (here just the 6 MiB lm_head; the default since
this bench, GEMM_MIN_WEIGHT_BYTES); `none`, no GEMM splice (the top-K and norm + rope splices stay
in all three; `gemm` and `none` leave verify's attention to IREE).

`run`, per variant, in one process: the three arms alternated per prompt (rotating their order),
greedy, over the code prompts; the tokens of both drafted arms against plain decoding through the
verify graph (`exact`, equal bit for bit in any dtype); and the wall time of each step called
alone at a fixed position (decode, verify, draft, verify_draft; synchronous, tokens to the host),
so the speedups can be explained.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".gpu"
ARMS = ("plain", "two_calls", "fused")


def _variants() -> dict:
    from dflash_iree.export.splice import LOWERINGS, LINEAR_OP, LINEAR_RESIDUAL_OP, LINEAR_SWIGLU_OP, to_iree
    from dflash_iree.export.splice import ATTENTION_OP, lower_linear

    # the named ops must all be lowered: "none" gives the linears and the attention to IREE
    keep = {**LOWERINGS, "gemm": to_iree(LINEAR_OP, LINEAR_RESIDUAL_OP, LINEAR_SWIGLU_OP), "attention": to_iree(ATTENTION_OP)}
    return {"gemm": {**keep, "gemm": functools.partial(lower_linear, min_weight_bytes=0)},
            "gemm4m": LOWERINGS,
            "none": keep}


def folder(variant: str, arch: str) -> Path:
    return WORK / f"demo-{variant}-{arch}"


def prepare(arch: str, variants: list[str], attention: str | None = None) -> None:
    """Compile each variant, with the arch's attention form, or `attention` ("fused": IREE's fused
    attention op, "matmul": matmul + float32 softmax + matmul; export/qwen3.py) as VARIANT-ATTENTION."""
    from dflash_iree.export.compile import compile_artifacts

    for v in variants:
        name = v if attention is None else f"{v}-{attention}"
        compile_artifacts(arch, ROOT / "models/demo/target", ROOT / "models/demo/drafter", folder(name, arch),
                          max_context=512, splices=_variants()[v], attention=attention)


def _step_ms(engine, n: int = 50) -> dict:
    """Median wall ms of each step called alone (synchronous, tokens to the host), after a prefill."""
    m = engine.module
    m.set_sampling(0.0, 0, 1.0, 0)
    B = engine.block_size
    prompt = list(range(10, 110))
    first, taps = m.prefill(prompt)
    m.absorb(taps)
    start, block = len(prompt), [first] + [5] * (B - 1)
    _, vtaps = m.verify(block, start)
    steps = {"decode": lambda: m.decode(first, start), "verify": lambda: m.verify(block, start),
             "draft": lambda: m.draft(vtaps, start, B, 5, start + B),
             "verify_draft": lambda: m.verify_draft(block, start)}
    out = {}
    for name, fn in steps.items():
        for _ in range(5):
            fn()
        ms = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
        out[name] = round(statistics.median(ms), 4)
    return out


def run(device: str, out: str, arch: str, variants: list[str], n_prompts: int, max_new_tokens: int, runs: int,
        runtime_flags: list[str] = ()) -> dict:
    import iree.runtime as rt

    from dflash_iree.runtime.bench import read_prompts
    from dflash_iree.runtime.engine import Engine

    if runtime_flags:  # before the driver is created
        rt.flags.parse_flags(*runtime_flags)

    prompts = read_prompts(ROOT / "bench/prompts/code.jsonl", n_prompts)
    kwargs = {"plain": dict(speculative=False), "two_calls": {}, "fused": {}}
    seams = {"plain": {}, "two_calls": dict(fused_round=False), "fused": {}}  # Engine.with_seams
    result = {"device": device, "arch": arch, "runtime_flags": list(runtime_flags), "prompts": len(prompts), "runs": runs,
              "max_new_tokens": max_new_tokens, "variants": {}}
    for v in variants:
        f = folder(v, arch)
        if not (f / "manifest.json").is_file():
            print(f"skip {f}: not compiled", flush=True)
            continue
        engine = Engine.load(f, ROOT / "models/demo/target", ROOT / "models/demo/drafter", device)
        tok_s = {a: [] for a in ARMS}
        same = {"two_calls": 0, "fused": 0}
        accepted, redrafts = [], 0
        for r in range(runs):
            for i, p in enumerate(prompts):
                k = (i + r) % len(ARMS)
                gens = {a: engine.with_seams(**seams[a]).generate(p, max_new_tokens, **kwargs[a])
                        for a in ARMS[k:] + ARMS[:k]}
                for a in ARMS:
                    tok_s[a].append(gens[a].decode_tok_s)
                if r == 0:
                    exact = engine.generate(p, max_new_tokens, speculative=False, exact=True).tokens
                    for a in same:
                        same[a] += gens[a].tokens == exact
                    accepted += gens["fused"].accepted
                    redrafts += gens["fused"].redrafts
        med = {a: round(statistics.median(tok_s[a]), 1) for a in ARMS}
        m = engine.artifacts.manifest
        res = {"tok_s_median": med, "speedup_two_calls": round(med["two_calls"] / med["plain"], 3),
               "speedup_fused": round(med["fused"] / med["plain"], 3),
               "same_as_exact_plain": {a: f"{c}/{len(prompts)}" for a, c in same.items()},
               "tau_mean": round(sum(a + 1 for a in accepted) / max(1, len(accepted)), 3), "redrafts": redrafts,
               "step_ms": _step_ms(engine), "dispatches_per_call": m.stats["dispatches_per_call"],
               "gemm_spliced": sum(g.get("mms", g["ops"]) for g in m.splices.get("gemm", []))}
        result["variants"][v] = res
        print(f"{v}: {res}", flush=True)
        del engine
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    return result


def format_table(r: dict) -> str:
    lines = [f"demo pair on {r['device']} ({r['arch']}), {r['prompts']} code prompts x {r['runs']} runs, "
             f"{r['max_new_tokens']} new tokens, greedy", "",
             "| GEMM splice | plain tok/s | drafted, 2 calls | drafted, fused | speedup 2 calls | speedup fused | "
             "τ | same tokens (fused) | decode / verify / draft / verify_draft ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v, x in r["variants"].items():
        t, s = x["tok_s_median"], x["step_ms"]
        lines.append(f"| {v} ({x['gemm_spliced']} matmuls) | {t['plain']} | {t['two_calls']} | {t['fused']} | "
                     f"{x['speedup_two_calls']:.2f}x | {x['speedup_fused']:.2f}x | {x['tau_mean']:.2f} | "
                     f"{x['same_as_exact_plain']['fused']} | {s['decode']:.3f} / {s['verify']:.3f} / {s['draft']:.3f} / "
                     f"{s['verify_draft']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--arch", default="sm_80")
    p.add_argument("--variants", nargs="+", default=["gemm", "gemm4m", "none"])
    p.add_argument("--attention", choices=["fused", "matmul"],
                   help="an attention form in place of the arch's own (folders VARIANT-ATTENTION)")
    r = sub.add_parser("run")
    r.add_argument("--device", default="cuda")
    r.add_argument("--json", required=True)
    r.add_argument("--arch", default="sm_80")
    r.add_argument("--variants", nargs="+", default=["gemm", "gemm4m", "none"])
    r.add_argument("--prompts", type=int, default=16)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--runs", type=int, default=2)
    r.add_argument("--runtime-flag", action="append", default=[], dest="runtime_flags",
                   help="an iree.runtime driver flag, repeatable; write --runtime-flag=--cuda_use_streams=false")
    q = sub.add_parser("report")
    q.add_argument("json")
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.arch, args.variants, args.attention)
    elif args.cmd == "run":
        run(args.device, args.json, args.arch, args.variants, args.prompts, args.max_new_tokens, args.runs,
            args.runtime_flags)
    else:
        print(format_table(json.loads(Path(args.json).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
