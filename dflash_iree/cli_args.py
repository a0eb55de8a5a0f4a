"""The `dflash-iree` argument parser: every subcommand's options, and their defaults.

The runtime subcommands' defaults (max_new_tokens and the sampling settings) are GenerateOptions'
own (runtime/options.py), read from its fields, so that the command line and the Python API cannot
drift apart. dflash_iree/cli.py runs what the parser names.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from .arch import ALIASES, ARCHS
from .manifest import COMPUTE_DTYPES
from dflash_iree.runtime.options import GenerateOptions

DEFAULTS = {f.name: f.default for f in fields(GenerateOptions)}


def _runtime_arguments(p: argparse.ArgumentParser) -> None:
    """The options of every subcommand that runs compiled artifacts (generate, bench, demo)."""
    p.add_argument("--artifacts", default="compiled/host", help="folder written by dflash-iree compile")
    p.add_argument("--target", help="target checkpoint folder (default: the one in the manifest)")
    p.add_argument("--drafter", help="drafter checkpoint folder (default: the one in the manifest)")
    p.add_argument("--device", help="IREE device: local-task, cuda, cuda://1, hip (default: the arch's)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"], help="new tokens to generate "
                   "(default %(default)s)")
    _encoding_argument(p)


_SAMPLING_HELP = {
    "temperature": (float, "0 is greedy; otherwise a sample keyed by (seed, position)"),
    "top_k": (int, "keep the k most likely tokens; 0: no cut"),
    "top_p": (float, "keep the smallest set of tokens of this mass; 1.0: no cut"),
    "seed": (int, "key of the sample, 0..4294967295"),
}


def _sampling_arguments(p: argparse.ArgumentParser, names=tuple(_SAMPLING_HELP)) -> None:
    """--temperature, --top-k, --top-p, --seed (or those of `names`), defaulting as GenerateOptions."""
    for name in names:
        kind, what = _SAMPLING_HELP[name]
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=DEFAULTS[name],
                       help=f"{what} (default %(default)s)")


def _encoding_argument(p: argparse.ArgumentParser, what: str = "--prompt, --stop and prompt files") -> None:
    p.add_argument("--encoding", default="utf-8", help=f"encoding of {what} "
                   "(default utf-8; bytes that are not valid in it are refused)")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (the option and what is wrong, `--help` for the usage),
    exit status 2, as every other refusal."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `dflash-iree` parser; `args.command` names the subcommand (dflash_iree/cli.py COMMANDS runs it)."""
    from dflash_iree import __version__

    p = _Parser(prog="dflash-iree", description="AOT-compiled DFlash speculative decoding on IREE")
    p.add_argument("--version", action="version", version=f"dflash-iree {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode with compiled artifacts (plain or DFlash)")
    _runtime_arguments(g)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-ids", help="prompt token ids, space or comma separated")
    g.add_argument("--chat", action="store_true", help="render --prompt as a user message with the chat template")
    _sampling_arguments(g)
    g.add_argument("--num-speculative-tokens", type=int, help="draft depth, 1..block_size-1 (default: all)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--no-draft", action="store_true", help="plain decoding")
    g.add_argument("--exact", action="store_true", help="plain decoding through the verify graph (bit-exact vs drafted)")
    g.add_argument("--draft-top-k", type=int, default=0, metavar="K",
                   help="also return the drafter's K best ids and log-probs at every drafted position, per round "
                        "(1..the artifacts' compiled K; printed to stderr, or under \"draft_top_k\" with --json)")
    g.add_argument("--json", action="store_true", help="print tokens, text and stats as JSON")
    g.add_argument("--quiet", action="store_true", help="no summary line (tokens, τ, tok/s, ms) on stderr after the text")

    b = sub.add_parser("bench", help="plain against drafted on a prompt file, alternated A B A B")
    _runtime_arguments(b)
    b.add_argument("--prompts", required=True, help="JSONL file with a \"prompt\" field per line")
    b.add_argument("--limit", type=int, help="use the first N prompts")
    _sampling_arguments(b, ("temperature", "seed"))
    b.add_argument("--runs", type=int, default=1, help="runs of every prompt per arm, alternated (default 1)")
    b.add_argument("--json", help="write the results as JSON to this file")
    b.add_argument("--plot", help="draw the τ histogram and tok/s to this PNG (needs matplotlib)")
    b.add_argument("--quiet", action="store_true", help="no per-prompt lines")
    b.add_argument("--parallel", metavar="N,N", help="stream counts to run the prompts at, e.g. 1,4: the batch "
                   "engine with N requests at once (up to the artifacts' --streams), aggregate and per-stream tok/s, "
                   "TTFT and τ per count and arm")

    d = sub.add_parser("demo", help="one held-out prompt, plain and drafted: text, τ and tok/s")
    _runtime_arguments(d)
    d.add_argument("--prompts", default="bench/prompts/code.jsonl")
    d.add_argument("--index", type=int, default=0, help="which prompt of the file")

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("--artifacts", default="compiled/host", help="folder written by dflash-iree compile")
    s.add_argument("--target", help="target checkpoint folder (default: the one in the manifest)")
    s.add_argument("--drafter", help="drafter checkpoint folder (default: the one in the manifest)")
    s.add_argument("--device", help="IREE device: local-task, cuda, cuda://1, hip (default: the arch's)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only; "
                   "any other address, such as 0.0.0.0, must be given here explicitly, and then anyone who can reach "
                   "it can use the server: consider --api-key)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s; 0: any free one, printed "
                   "at start)")
    s.add_argument("--parallel", type=int, help="requests decoded at once, at most the artifacts' streams "
                   "(dflash-iree compile --streams N) (default: all of them)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a stream; more are answered "
                   "429 with Retry-After (default %(default)s)")
    s.add_argument("--model-name", help="the model id of /v1/models and requests (default: the target folder's name)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds SIGTERM or Ctrl-C lets running "
                   "and queued requests finish before cancelling them (default %(default)s)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's log level (default %(default)s: one access line per request)")

    e = sub.add_parser("eager", help="decode with the eager PyTorch reference (plain or DFlash)")
    e.add_argument("--target", required=True, help="Qwen3 checkpoint folder")
    e.add_argument("--drafter", help="DFlash drafter checkpoint folder (omit for plain decoding)")
    e.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer.json)")
    e.add_argument("--prompt-ids", help="prompt token ids, space or comma separated")
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--max-context", type=int, help="KV cache length in tokens (default 4096, or the target's "
                   "max_position_embeddings when it is smaller)")
    e.add_argument("--dtype", choices=COMPUTE_DTYPES, help="default: the config's torch_dtype")
    e.add_argument("--block-size", type=int, help="default: the drafter's trained block_size")
    _bits_arguments(e)
    _sampling_arguments(e)
    e.add_argument("--no-draft", action="store_true", help="plain decoding even with --drafter")
    e.add_argument("--json", action="store_true", help="print tokens and stats as JSON")
    _encoding_argument(e, "--prompt")

    c = sub.add_parser("compile", help="export target + drafter and compile them to compiled/ARCH (vmfb + manifest)")
    c.add_argument("--arch", default="host", help=f"{', '.join(ARCHS)}, or an alias: {', '.join(ALIASES)} "
                   "(default: host)")
    read = ("; a 4-bit checkpoint's safetensors headers too; with --{0}-bits 4 each safetensors file is hashed "
            "for the manifest; no weights are loaded")
    c.add_argument("--target", required=True, help="Qwen3 or Qwen3.5-family target checkpoint folder: its config.json "
                   "and generation_config.json (eos ids, if there is one)" + read.format("target"))
    c.add_argument("--drafter", required=True, help="DFlash drafter checkpoint folder: its config.json"
                   + read.format("drafter"))
    c.add_argument("--out", help="output folder (default: compiled/ARCH)")
    c.add_argument("--block-size", type=int, help="verify block, 2..the drafter's trained block_size (default)")
    c.add_argument("--max-context", type=int, help="KV cache length in tokens (default 4096, or the target's "
                   "max_position_embeddings when smaller)")
    c.add_argument("--dtype", choices=COMPUTE_DTYPES, help="default: the target config's torch_dtype")
    _bits_arguments(c, compiled=True)
    c.add_argument("--streams", type=int, default=1, help="requests served together in one round, 1..64 "
                   "(default 1): the leading stream dimension of every entry point and KV cache")
    c.add_argument("--draft-top-k", type=int, default=8, metavar="K",
                   help="K of the draft_topk entry point (the draft's top-K ids and log-probs, on the device), "
                        "1..64; 0 compiles none (default 8)")
    c.add_argument("--decode-steps", type=int, metavar="K",
                   help="greedy plain decode steps in one call (the decode_steps entry point), 2..16, or 0 for "
                        "none; one stream, dense targets (default: the arch's: 8 on GPUs, none on the host)")
    c.add_argument("--no-export-cache", action="store_true",
                   help="export afresh and keep no copy (default: reuse an identical export from ~/.cache/dflash-iree, "
                        "or $DFLASH_IREE_CACHE)")

    k = sub.add_parser("calibrate", help="measure a shared round's cost per verified rows into DIR/depth_cost.json "
                       "(the draft depth rule of a module of several streams)")
    k.add_argument("--artifacts", default="compiled/host", help="folder written by dflash-iree compile --streams N "
                   "(N >= 2); the cost file and the manifest's files are updated in place")
    k.add_argument("--device", help="IREE device: local-task, cuda, cuda://1, hip (default: the arch's)")
    k.add_argument("--repeats", type=int, default=20, help="timed calls of each round kind (default %(default)s)")
    k.add_argument("--context", type=int, help="cached rows the rounds run at (default 128, or what max_context leaves)")

    from dflash_iree.kernels.topk.check import add_arguments as topk_check_arguments

    t = sub.add_parser("topk-check", help="build, run and score the draft top-K dispatch's parity cases")
    topk_check_arguments(t)
    return p


def _bits_arguments(p, compiled: bool = False) -> None:
    """--target-bits / --drafter-bits: quantize a float checkpoint on load (dflash_iree/quant.py);
    `compiled`: compile's wording (the module takes the packed form, the runtime quantizes)."""
    for scope in ("target", "drafter"):
        what = (f"4: build the {scope} as an MLX-format 4-bit module (affine, group 64, for the linears eager "
                f"--{scope}-bits 4 quantizes) from a float checkpoint; the runtime quantizes the float weights when "
                "it binds them and caches them in $DFLASH_IREE_CACHE/quantized (default ~/.cache/dflash-iree); "
                "default: as stored (a 4-bit checkpoint compiles as its config.json says, without this option)"
                if compiled else f"quantize the {scope}'s float linears on load: 4 (affine, group 64); default: as "
                "stored")
        p.add_argument(f"--{scope}-bits", type=int, metavar="BITS", help=what)
