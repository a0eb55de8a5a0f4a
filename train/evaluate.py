"""Evaluate the committed demo pair with the eager reference on the CPU.

    .venv/bin/python train/evaluate.py --models models/demo --out train/results/eval.json
    .venv/bin/python train/evaluate.py --models models/demo-qwen35 --out train/results/eval_qwen35.json

The target is whatever MODELS/target's config.json names (`load_target`/`load_pair`): the Qwen3
demo target or the hybrid (qwen3_5_text) one, whose cache-free forward runs the chunked delta rule.

- target: held-out loss and perplexity of the shipped (bf16) weights, computed in float32 over
  non-overlapping 512-token windows of the held-out stream (the device log's number is the same
  measure on the fp32 master weights under bf16 autocast);
- every drafter folder: greedy decoding of each prompt of bench/prompts/code.jsonl, 128 new
  tokens, with `generate_dflash` and with `generate_plain`; checks the tokens are equal and
  reports τ (mean over all rounds, bonus token counted), its histogram, per-prompt τ and the
  eager wall-clock ratio plain/dflash (CPU eager: says little about compiled speed);
- a few greedy completions (text) for the model cards.
`--dtype` picks the compute dtype (default: the checkpoint's, bf16). `--drafters drafter,drafter2` picks
folders; `--temperature T` decodes with seeded sampling (seed = the prompt's index), where
drafted == plain still holds token for token.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from dflash_iree.export.load import load_pair, load_target
from dflash_iree.export.reference import SamplingConfig, generate_dflash, generate_plain


@torch.no_grad()
def heldout_loss(target_dir: Path, data: Path, seq: int = 512, batch: int = 16, limit: int | None = None) -> dict:
    """Token-weighted mean next-token loss over non-overlapping seq-token windows, float32."""
    model = load_target(target_dir, max_context=seq, dtype="f32")
    ids = torch.from_numpy(np.fromfile(data / "heldout.bin", dtype=np.uint16).astype(np.int64))
    n = (ids.numel() - 1) // seq
    n = min(n, limit) if limit else n
    total, count = 0.0, 0
    for i in range(0, n, batch):
        w = torch.stack([ids[j * seq: j * seq + seq + 1] for j in range(i, min(n, i + batch))])
        _, logits, _ = model(w[:, :-1], torch.zeros(w.shape[0], dtype=torch.int64), use_cache=False)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    loss = total / count
    return {"heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 3), "windows": n, "tokens": count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="models/demo")
    ap.add_argument("--data", default=".train-data")
    ap.add_argument("--prompts", default="bench/prompts/code.jsonl")
    ap.add_argument("--limit", type=int, help="first N prompts only")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "f32"], help="default: the checkpoint's torch_dtype")
    ap.add_argument("--samples", type=int, default=3, help="completions to keep as text")
    ap.add_argument("--skip-loss", action="store_true")
    ap.add_argument("--drafters", help="comma-separated drafter folder names (default: every drafter* folder)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: seeded sampling, seed = prompt index")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads; 1 because on a shared 2-core machine every multi-threaded op "
                         "waited ~8 ms on its thread pool (450 ms per decode step, against 8 ms on one thread)")
    ap.add_argument("--out", default="train/results/eval.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = Path(args.models)
    tdir = models / "target"
    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    rows = [json.loads(line) for line in open(args.prompts)][: args.limit]
    result = {"prompts": args.prompts, "threads": args.threads, "n_prompts": len(rows), "max_new_tokens": args.max_new_tokens,
              "dtype": args.dtype or "checkpoint (bf16)", "torch": torch.__version__,
              "temperature": args.temperature}
    if not args.skip_loss:
        result["target"] = heldout_loss(tdir, Path(args.data))
        print(json.dumps(result["target"]), flush=True)

    plain_cache: dict[int, object] = {}
    result["drafters"] = {}
    names = args.drafters.split(",") if args.drafters else None
    for ddir in sorted(models.glob("drafter*")):
        if names is not None and ddir.name not in names:
            continue
        target, drafter = load_pair(tdir, ddir, max_context=512, dtype=args.dtype)
        B = drafter.block_size
        accepted, per_prompt, mismatches, t_plain, t_spec, samples = [], [], [], 0.0, 0.0, []
        for i, row in enumerate(rows):
            prompt = tok.encode(row["prompt"]).ids
            sampling = SamplingConfig(temperature=args.temperature, seed=i)
            if i not in plain_cache:
                plain_cache[i] = generate_plain(target, prompt, args.max_new_tokens, sampling)
            plain = plain_cache[i]
            spec = generate_dflash(target, drafter, prompt, args.max_new_tokens, sampling)
            t_plain += plain.decode_s
            t_spec += spec.decode_s
            accepted += spec.accepted
            per_prompt.append(round(spec.tau_mean, 3))
            if spec.tokens != plain.tokens:
                mismatches.append(row["id"])
            if i < args.samples:
                samples.append({"id": row["id"], "prompt": row["prompt"], "completion": tok.decode(plain.tokens),
                                "tau": round(spec.tau_mean, 3)})
        hist = [0] * B
        for a in accepted:
            hist[a] += 1
        tau = sum(a + 1 for a in accepted) / len(accepted)
        entry = {"block_size": B, "tau_mean": round(tau, 3), "rounds": len(accepted), "histogram": hist,
                 "tau_per_prompt_mean": round(sum(per_prompt) / len(per_prompt), 3),
                 "tau_per_prompt_min": min(per_prompt), "tau_per_prompt_max": max(per_prompt),
                 "tokens_equal_plain": not mismatches, "mismatched_prompts": mismatches,
                 "eager_cpu_decode_s_plain": round(t_plain, 2), "eager_cpu_decode_s_dflash": round(t_spec, 2),
                 "eager_cpu_speedup": round(t_plain / t_spec, 3), "samples": samples}
        result["drafters"][ddir.name] = entry
        print(json.dumps({k: v for k, v in entry.items() if k != "samples"}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
