"""CPU check of the committed checkpoints: the formats load where they must, and agree.

    .venv/bin/python train/check_export.py --models models/demo
    .venv/bin/python train/check_export.py --models models/demo-qwen35

- the target loads in `transformers` (Qwen3ForCausalLM, or Qwen3_5ForCausalLM for the hybrid's
  qwen3_5_text) and its float32 logits equal those of our `load_target` module on held-out text,
  cache-free and through the cache (a hybrid's: the chunked delta rule and its state) (also the
  tokenizer loads with AutoTokenizer);
- every drafter folder loads with our `load_pair`, and one greedy DFlash generation equals the
  plain one token for token.
Exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import torch

from dflash_iree.export.load import load_pair, load_target
from dflash_iree.export.reference import generate_dflash, generate_plain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="models/demo")
    ap.add_argument("--data", default=".train-data")
    args = ap.parse_args()
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3ForCausalLM

    models = Path(args.models)
    tdir = models / "target"
    ok = True
    ids = torch.from_numpy(np.fromfile(Path(args.data) / "heldout.bin", dtype=np.uint16)[1000:1256].astype(np.int64))[None]

    hybrid = json.loads((tdir / "config.json").read_text())["model_type"] == "qwen3_5_text"
    hf_class = Qwen3_5ForCausalLM if hybrid else Qwen3ForCausalLM
    hf = hf_class.from_pretrained(tdir, dtype=torch.float32).eval()
    ours = load_target(tdir, max_context=512, dtype="f32")
    with torch.no_grad():
        ref = hf(ids).logits
        _, got, _ = ours(ids, torch.zeros(1, dtype=torch.int64), use_cache=False)
        _, cached, _ = ours(ids, torch.zeros(1, dtype=torch.int64), read_len=ids.shape[1])
    for name, x in (("cache-free", got), ("cached", cached)):
        diff = (x - ref).abs().max().item()
        agree = (x.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"target vs transformers ({name} forward): max |logit diff| {diff:.2e}, argmax agreement {agree:.4f}")
        ok &= diff < 1e-3
    tok = AutoTokenizer.from_pretrained(tdir)
    text = "def add(a, b):\n    return a + b\n"
    ok &= tok(text)["input_ids"] == ours_encode(tdir, text)
    print(f"AutoTokenizer loads; eos {tok.eos_token!r} = {tok.eos_token_id}, mask {tok.mask_token!r} = {tok.mask_token_id}")

    prompt = ours_encode(tdir, 'def is_even(n):\n    """Return True if n is even."""')
    for ddir in sorted(models.glob("drafter*")):
        target, drafter = load_pair(tdir, ddir, max_context=512)
        plain = generate_plain(target, prompt, 48)
        spec = generate_dflash(target, drafter, prompt, 48)
        same = plain.tokens == spec.tokens
        print(f"{ddir.name}: load_pair ok (block {drafter.block_size}, taps {target.tap_layer_ids}); "
              f"dflash == plain: {same}; tau {spec.tau_mean:.2f}")
        ok &= same
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def ours_encode(tdir: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tdir / "tokenizer.json")).encode(text).ids


if __name__ == "__main__":
    sys.exit(main())
