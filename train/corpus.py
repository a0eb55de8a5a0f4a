"""Build the demo corpus, tokenizer and held-out prompts from the Python standard library (CPU).

Run here, before any device work:

    .venv/bin/python train/corpus.py --out .train-data --bench bench/prompts/code.jsonl

What it does, deterministically:
- collects every `.py` file of the running interpreter's stdlib (site-packages excluded);
- splits by file: held-out when sha256(relative path) mod 20 == 0 (about 5%), else train;
- trains a byte-level BPE (8192 ids, `<|endoftext|>` = 0 and `<|mask|>` = 1) on the train split;
- writes `train.bin` / `heldout.bin`: uint16 token ids of each split, every file followed by
  `<|endoftext|>`, files in sorted path order; plus `tokenizer.json`, `tokenizer_config.json`
  and `meta.json` (file lists, counts, interpreter version);
- writes `train_prompts.npz` / `heldout_prompts.npz`: every function header + docstring of each
  split, tokenized (prompts for the drafter's training data);
- cuts `bench/prompts/code.jsonl` from held-out files: a function's header and docstring, ending
  at the docstring's closing quotes (see function_prompts).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS, MASK = "<|endoftext|>", "<|mask|>"
VOCAB_SIZE = 8192


def stdlib_files(root: Path) -> list[Path]:
    """Sorted stdlib .py files under `root`, without site-packages."""
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def is_heldout(rel: str) -> bool:
    """The split: a hash of the relative path, so it does not depend on file order or content."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little") % 20 == 0


def read_sources(root: Path) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(train, heldout) maps of relative path -> text, and the paths skipped (not UTF-8)."""
    train, heldout, skipped = {}, {}, []
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # a few test files are deliberately latin-1 / broken
            skipped.append(rel)
            continue
        (heldout if is_heldout(rel) else train)[rel] = text
    return train, heldout, skipped


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE with the two special tokens first (ids 0 and 1)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast (no BOS, EOS = <|endoftext|>)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "added_tokens_decoder": {
            "0": {"content": EOS, "special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
            "1": {"content": MASK, "special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
        },
    }


def encode_split(tok: Tokenizer, sources: dict[str, str]) -> np.ndarray:
    """uint16 [N]: the files in sorted order, each followed by <|endoftext|>."""
    eos = tok.token_to_id(EOS)
    names = sorted(sources)
    out = []
    for enc in tok.encode_batch([sources[n] for n in names]):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.uint16)


def function_prompts(rel: str, text: str, trailing_newline: bool) -> list[dict]:
    """Header + docstring of each function with a docstring in `text`, dedented.

    The bench prompts end at the closing quotes (trailing_newline=False): with this byte-level BPE
    a newline and the next line's indentation form one token, so a prompt that ends in a lone
    "\n" token suggests top-level code next, and the target then tends to start a new block
    instead of the function body. The drafter's training prompts were cut with the newline
    (trailing_newline=True); they are kept that way so the shipped drafters stay reproducible.
    """
    try:
        tree = ast.parse(text)
    except SyntaxError:  # some test data files are deliberately invalid
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(node.body) < 2:  # nothing to complete after the docstring
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        snippet = textwrap.dedent("".join(lines[first - 1: doc.end_lineno]))
        out.append({"source": rel, "lineno": first, "name": node.name, "prompt": snippet.rstrip() + ("\n" if trailing_newline else "")})
    return out


def build_bench(tok: Tokenizer, heldout: dict[str, str], n: int, per_file: int = 3,
                min_tokens: int = 24, max_tokens: int = 256) -> list[dict]:
    """Up to `n` prompts from held-out files: at most `per_file` each (first by line), token length bounded.

    Files are visited in a hash order (not alphabetical) so the set spreads over the stdlib.
    """
    order = sorted(heldout, key=lambda r: hashlib.sha256(("bench:" + r).encode()).hexdigest())
    out = []
    for rel in order:
        cands = sorted(function_prompts(rel, heldout[rel], trailing_newline=False), key=lambda d: d["lineno"])
        kept = 0
        for c in cands:
            k = len(tok.encode(c["prompt"]).ids)
            if min_tokens <= k <= max_tokens:
                out.append({"id": f"{rel}:{c['lineno']}", **c, "prompt_tokens": k})
                kept += 1
                if kept == per_file:
                    break
        if len(out) >= n:
            break
    return out[:n]


def save_prompt_set(tok: Tokenizer, sources: dict[str, str], path: Path, min_tokens: int = 16,
                    max_tokens: int = 192) -> int:
    """Every function header + docstring of `sources` (token length bounded) as an .npz:
    `tokens` uint16 (all prompts joined) and `offsets` int64 [n + 1]. The drafter trainer
    continues these with the target, so its data looks like bench/prompts/code.jsonl."""
    prompts = [c["prompt"] for rel in sorted(sources) for c in function_prompts(rel, sources[rel], trailing_newline=True)]
    ids = [e.ids for e in tok.encode_batch(prompts)]
    ids = [x for x in ids if min_tokens <= len(x) <= max_tokens]
    offsets = np.cumsum([0] + [len(x) for x in ids])
    np.savez(path, tokens=np.asarray([t for x in ids for t in x], dtype=np.uint16), offsets=offsets)
    return len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".train-data", help="folder for tokens, tokenizer and meta (git-ignored)")
    ap.add_argument("--bench", default="bench/prompts/code.jsonl")
    ap.add_argument("--bench-count", type=int, default=64)
    args = ap.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train, heldout, skipped = read_sources(root)
    tok = train_tokenizer([train[k] for k in sorted(train)])
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(MASK) == 1 and tok.get_vocab_size() == VOCAB_SIZE
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    tr, ho = encode_split(tok, train), encode_split(tok, heldout)
    tr.tofile(out / "train.bin")
    ho.tofile(out / "heldout.bin")
    bench = build_bench(tok, heldout, args.bench_count)
    Path(args.bench).parent.mkdir(parents=True, exist_ok=True)
    with open(args.bench, "w") as f:
        for row in bench:
            f.write(json.dumps(row) + "\n")

    n_train_prompts = save_prompt_set(tok, train, out / "train_prompts.npz")
    n_heldout_prompts = save_prompt_set(tok, heldout, out / "heldout_prompts.npz")
    meta = {
        "python": sys.version.split()[0],
        "stdlib_root": str(root),
        "split_rule": "heldout iff int.from_bytes(sha256(relpath)[:8], 'little') % 20 == 0",
        "train_files": sorted(train), "heldout_files": sorted(heldout), "skipped_not_utf8": skipped,
        "train_bytes": sum(len(t.encode()) for t in train.values()),
        "heldout_bytes": sum(len(t.encode()) for t in heldout.values()),
        "train_tokens": int(tr.size), "heldout_tokens": int(ho.size),
        "vocab_size": VOCAB_SIZE, "eos_token_id": 0, "mask_token_id": 1,
        "bench_prompts": len(bench),
        "train_function_prompts": n_train_prompts, "heldout_function_prompts": n_heldout_prompts,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps({k: v for k, v in meta.items() if not k.endswith("_files") and k != "skipped_not_utf8"}, indent=1))
    print(f"files: {len(train)} train, {len(heldout)} heldout, {len(skipped)} skipped (not UTF-8)")


if __name__ == "__main__":
    main()
