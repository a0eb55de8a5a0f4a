"""τ of the demo pair with the drafter quantized on load (--drafter-bits 4: MLX affine, group 64)
against the bf16 drafter, on the host with the eager reference (export/reference.py
generate_dflash), bf16 (and float32: `--dtype f32`), greedy (T = 0), 128 new tokens, the first 16
held-out prompts of bench/prompts/code.jsonl. The same two drafters also against the demo target
written 4-bit by mlx-lm (tests/quant_writers.py write_mlx, group 64, into a temporary folder).

    .venv/bin/python experiments/2026-12-04-drafter-bits/tau.py --out experiments/2026-12-04-drafter-bits/tau_bf16.json
    .venv/bin/python experiments/2026-12-04-drafter-bits/tau.py --dtype f32 --out experiments/2026-12-04-drafter-bits/tau_f32.json

One torch thread (train/evaluate.py says why: on a shared 2-core machine multi-threaded ops wait on
the pool). Plain decoding is not run: τ needs only the drafted run; the tokens of the two drafters
against one target are compared instead (drafted output is the target's either way: equal in
float32; in bf16 the eager verify rows may round a near-tie otherwise for other accepted lengths,
issue #24, so a few prompts part and their τ is over another continuation).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # quant_writers: mlx-lm's own writer


def run(target_dir: Path, drafter_bits, prompts: list, max_new_tokens: int, dtype: str) -> dict:
    from dflash_iree.export.load import load_pair
    from dflash_iree.export.reference import SamplingConfig, generate_dflash

    target, drafter = load_pair(target_dir, ROOT / "models/demo/drafter", max_context=512, dtype=dtype,
                                drafter_bits=drafter_bits)
    accepted, per_prompt, tokens, t0 = [], [], [], time.time()
    for prompt in prompts:
        gen = generate_dflash(target, drafter, prompt, max_new_tokens, SamplingConfig())
        accepted += gen.accepted
        per_prompt.append(round(gen.tau_mean, 3))
        tokens.append(gen.tokens)
    hist = [0] * drafter.block_size
    for a in accepted:
        hist[a] += 1
    return {"drafter_bits": drafter_bits, "tau_mean": round(sum(a + 1 for a in accepted) / len(accepted), 3),
            "rounds": len(accepted), "histogram": hist, "tau_per_prompt": per_prompt,
            "wall_s": round(time.time() - t0, 1), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-mlx-target", action="store_true", help="only the bf16 target")
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16", help="compute dtype (default bf16)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bf16 = ROOT / "models/demo/target"
    tok = Tokenizer.from_file(str(bf16 / "tokenizer.json"))
    rows = [json.loads(line) for line in open(ROOT / "bench/prompts/code.jsonl")][: args.prompts]
    prompts = [tok.encode(r["prompt"]).ids for r in rows]
    result = {"prompts": "bench/prompts/code.jsonl", "n_prompts": len(prompts), "ids": [r["id"] for r in rows],
              "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "dtype": args.dtype, "threads": 1,
              "torch": torch.__version__, "targets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        targets = {"bf16": bf16}
        if not args.no_mlx_target:
            from quant_writers import write_mlx

            targets["mlx-4bit"] = write_mlx(bf16, Path(tmp) / "mlx")
        for name, folder in targets.items():
            runs = {}
            for bits in (None, 4):
                runs["bf16" if bits is None else "4bit-on-load"] = r = run(folder, bits, prompts, args.max_new_tokens, args.dtype)
                print(json.dumps({"target": name, "drafter_bits": bits, "tau": r["tau_mean"], "rounds": r["rounds"],
                                  "wall_s": r["wall_s"]}), flush=True)
            same = sum(a == b for a, b in zip(runs["bf16"]["tokens"], runs["4bit-on-load"]["tokens"]))
            result["targets"][name] = {"drafters": {k: {x: y for x, y in v.items() if x != "tokens"}
                                                    for k, v in runs.items()},
                                       "same_tokens_across_drafters": f"{same}/{len(prompts)}"}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
