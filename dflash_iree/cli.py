"""The `dflash-iree` command line.

Subcommands:
- `generate`: decode with compiled artifacts on an IREE device (the runtime; no torch).
- `bench`: the same prompts plain and drafted, alternated, with tok/s, τ and speedup.
- `demo`: one held-out prompt plain and drafted: the text, τ and tok/s of each (`make demo`).
- `serve`: an OpenAI-compatible HTTP server over the compiled artifacts (runtime/server.py).
- `compile`: export target + drafter and lower them for one ARCH (needs the `compile` extra).
- `topk-check`: parity of the draft top-K dispatch on a device.
- `eager`: decode with the eager PyTorch reference (needs the `compile` extra), plain or DFlash.

Bad input (DFlashError) prints one message and exits with status 2, without a traceback; so do
faults of the machine the message can name (a file that cannot be written, a full disk, device
memory). Ctrl-C exits with status 130 and one line, after what was in flight is cleaned up (a
compile's stage folder, export cache entry and lock). Text from the command line and from prompt
files is bytes until decoded with --encoding (default utf-8), strictly.

The options and their defaults are dflash_iree/cli_args.py's; this module runs them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from . import validate
from .cli_args import build_parser
from .errors import DFlashError


def _arg_text(value: str | None, encoding: str, option: str) -> str | None:
    """A command-line string decoded with --encoding: argv arrives as the bytes the shell passed
    (Python keeps undecodable bytes as surrogates; os.fsencode gives the bytes back)."""
    if value is None:
        return None
    return validate.decode(os.fsencode(value), encoding, option)


def _encode_prompt(target_dir: str, text: str | None, ids: str | None) -> list[int]:
    if ids is not None:
        try:
            return [int(t) for t in ids.replace(",", " ").split()]
        except ValueError:
            raise DFlashError(f"--prompt-ids '{ids}' is not a list of integers") from None
    tok = Path(target_dir) / "tokenizer.json"
    if not tok.is_file():
        raise DFlashError(f"{tok} does not exist; pass --prompt-ids, or use a target folder with a tokenizer.json")
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok)).encode(text or "").ids


def _decode(target_dir: str, ids: list[int]) -> str | None:
    tok = Path(target_dir) / "tokenizer.json"
    if not tok.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok)).decode(ids)


def cmd_eager(args) -> int:
    """Decode with the eager PyTorch reference, plain or DFlash; prints the text (token ids without a
    tokenizer) and τ on stderr, or tokens and stats with --json."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise DFlashError("the eager reference needs torch: install the compile extra (pip install 'dflash-iree[compile]')") from None
    from dflash_iree.export.load import load_pair, load_target
    from dflash_iree.export.reference import SamplingConfig, generate_dflash, generate_plain

    from dflash_iree.config import load_target_config

    tcfg = load_target_config(args.target)
    vocab, (limit, limit_why) = tcfg.vocab_size, tcfg.context_limit()
    if args.max_context is None:
        args.max_context = min(4096, limit)  # as compile's default
    validate.integer(args.max_context, "--max-context", 2, limit, fix=f" ({limit_why} is {limit})")
    prompt = validate.token_ids(_encode_prompt(args.target, _arg_text(args.prompt, args.encoding, "--prompt"),
                                               args.prompt_ids), vocab)
    sampling = SamplingConfig(*validate.sampling(args.temperature, args.top_k, args.top_p, args.seed, vocab))
    if args.drafter and not args.no_draft:
        target, drafter = load_pair(args.target, args.drafter, args.max_context, args.dtype, args.block_size,
                                    target_bits=args.target_bits, drafter_bits=args.drafter_bits)
        gen = generate_dflash(target, drafter, prompt, args.max_new_tokens, sampling)
    else:
        target = load_target(args.target, args.max_context, args.dtype, bits=args.target_bits)
        gen = generate_plain(target, prompt, args.max_new_tokens, sampling)
    text = _decode(args.target, gen.tokens)
    if args.json:
        print(json.dumps({"tokens": gen.tokens, "text": text, "accepted": gen.accepted, "tau_mean": gen.tau_mean,
                          "histogram": gen.histogram, "ttft_ms": gen.ttft_ms, "decode_s": gen.decode_s}))
    else:
        print(text if text is not None else " ".join(map(str, gen.tokens)))
        if gen.accepted:
            print(f"[tau mean {gen.tau_mean:.2f} over {len(gen.accepted)} rounds]", file=sys.stderr)
    return 0


def cmd_topk_check(args) -> int:
    """Parity of the draft top-K custom dispatch on a device against a float64 reference (kernels/topk/check.py)."""
    from dflash_iree.kernels.topk.check import run

    return run(args)


def cmd_compile(args) -> int:
    """Export target and drafter and lower them for one ARCH (export/compile.py)."""
    try:
        import iree.compiler  # noqa: F401
        import iree.turbine  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        raise DFlashError(f"compiling needs the compile extra (pip install 'dflash-iree[compile]'): {e}") from None
    from dflash_iree.export.compile import compile_artifacts

    compile_artifacts(args.arch, args.target, args.drafter, args.out, args.block_size, args.max_context, args.dtype,
                      args.streams, use_cache=not args.no_export_cache, draft_top_k=args.draft_top_k,
                      target_bits=args.target_bits, drafter_bits=args.drafter_bits, decode_steps=args.decode_steps)
    return 0


def cmd_calibrate(args) -> int:
    """Measure the round costs of a module of several streams into its folder (runtime/calibrate.py)."""
    from dflash_iree.runtime.calibrate import calibrate

    calibrate(args.artifacts, args.device, args.repeats, args.context)
    return 0


def cmd_serve(args) -> int:
    """The OpenAI-compatible server (runtime/server.py) until SIGTERM or Ctrl-C."""
    from dflash_iree.runtime.server import serve

    return serve(args.artifacts, args.target, args.drafter, args.device, args.host, args.port, args.parallel,
                 args.api_key, args.max_queue, args.model_name, args.shutdown_timeout, args.log_level)


def _load_engine(args):
    from dflash_iree.runtime.engine import Engine

    return Engine.load(args.artifacts, args.target, args.drafter, args.device)


def _summary(g) -> str:
    """One line of what a generation did (a GenerationResult), for stderr: new tokens, τ and rounds
    when drafted, tok/s after the first token, the first token's ms and the rest's."""
    how = f"tau {g.tau_mean:.2f} over {len(g.accepted)} rounds" if g.block_size > 1 else "plain decoding"
    return (f"[{len(g.tokens)} tokens, {how}, {g.decode_tok_s:.1f} tok/s; first token {g.ttft_ms:.1f} ms, "
            f"then {len(g.tokens) - 1} tokens in {g.decode_s * 1e3:.1f} ms]")


def _print_stream(pieces):
    """Print an Engine.stream's text pieces as they come; returns its GenerationResult."""
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            return done.value
        print(piece, end="", flush=True)


def cmd_generate(args) -> int:
    """Generate with compiled artifacts; prints the text (token ids without a tokenizer) and a
    summary line on stderr (not with --quiet), or tokens and stats with --json."""
    if args.prompt_ids is not None and (args.prompt is not None or args.chat):
        raise DFlashError("--prompt-ids is a prompt of its own: give it without --prompt and --chat")
    text = _arg_text(args.prompt, args.encoding, "--prompt") or ""
    stop = [_arg_text(s, args.encoding, "--stop") for s in args.stop or []] or None
    engine = _load_engine(args)
    if args.prompt_ids is not None:
        prompt = _encode_prompt("", None, args.prompt_ids)
    elif args.chat:
        prompt = [{"role": "user", "content": text}]
    else:
        prompt = text
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              seed=args.seed, speculative=not args.no_draft, num_speculative_tokens=args.num_speculative_tokens,
              stop=stop, exact=args.exact, draft_top_k=args.draft_top_k)
    if args.json:
        g = engine.generate(prompt, **kw)
        out = {"tokens": g.tokens, "text": g.text, "stats": g.stats()}
        if args.draft_top_k:
            out["draft_top_k"] = [r.to_dict() for r in g.draft_top_k]
        print(json.dumps(out))
        return 0
    if args.draft_top_k:  # the text, then each round's top-k on stderr
        g = engine.generate(prompt, **kw)
        print(g.text if g.text is not None else " ".join(map(str, g.tokens)))
        for r, top in enumerate(g.draft_top_k):
            for i, (ids, lps) in enumerate(zip(top.ids, top.logprobs)):
                pairs = "  ".join(f"{t}:{lp:.3f}" for t, lp in zip(ids, lps))
                print(f"round {r} draft {i}: {pairs}", file=sys.stderr)
    else:
        g = _print_stream(engine.stream(prompt, **kw))
        print("" if g.text is not None else " ".join(map(str, g.tokens)))  # nothing streamed without a tokenizer
    if not args.quiet:
        print(_summary(g), file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    """Plain against drafted on a prompt file; prints a table, optionally writes JSON and a plot."""
    from dflash_iree.guard import check_writable, write_atomic
    from dflash_iree.runtime.bench import check_plot, format_table, plot, read_prompts, run_bench

    validate.count(args.runs, "--runs", "times each prompt runs per arm")
    prompts = read_prompts(args.prompts, args.limit, args.encoding)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_writable(path, option)  # before the run, not after it
            _check_not_overwriting(Path(path), option, Path(args.prompts), json_result=option == "--json")
    if args.plot:
        check_plot()
    if args.parallel is not None and args.plot:
        raise DFlashError("--plot draws the one-stream bench; leave it out with --parallel")
    engine = _load_engine(args)
    log = None if args.quiet else lambda m: print(m, file=sys.stderr)
    if args.parallel is not None:
        from dflash_iree.runtime.bench_parallel import format_parallel_table, parse_levels, run_parallel

        levels = parse_levels(args.parallel, engine.streams)
        result = run_parallel(engine, prompts, levels, args.max_new_tokens, args.temperature, args.seed, args.runs, log)
        print(format_parallel_table(result))
        if args.json:
            write_atomic(args.json, json.dumps(result, indent=1) + "\n")
        return 0 if result["same_tokens"] else 1
    result = run_bench(engine, prompts, args.max_new_tokens, args.temperature, args.seed, args.runs, log=log)
    print(format_table(result))
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0 if result["same_tokens"] else 1


def _check_not_overwriting(path: Path, option: str, prompts: Path, json_result: bool) -> None:
    """Refuse an output path that holds the prompts being read, or (for --json) any existing file
    that is not an earlier bench result: bench writes its results there whole."""
    if not path.exists():
        return
    if prompts.exists() and path.samefile(prompts):
        raise DFlashError(f"{option} {path} is the --prompts file; write the results elsewhere")
    if json_result:
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = None
        if not (isinstance(earlier, dict) and "same_tokens" in earlier):
            raise DFlashError(f"{option} {path} exists and is not an earlier bench result; choose another path, or "
                              f"remove it first")


def cmd_demo(args) -> int:
    """One held-out code prompt, plain and drafted: text, τ, tok/s, and whether the tokens agree.

    Equality is checked against plain decoding through the verify graph (`exact`), which holds bit
    for bit in any dtype; plain decoding through the decode graph may round differently in bf16, and
    its first divergence is reported.
    """
    from dflash_iree.runtime.bench import read_prompts

    prompts = read_prompts(args.prompts, encoding=args.encoding)
    prompt = prompts[validate.index(args.index, "--index", len(prompts), args.prompts)]
    engine = _load_engine(args)
    engine.generate(prompt, 8)  # warm-up: first calls pay one-time setup
    plain = engine.generate(prompt, args.max_new_tokens, speculative=False)
    drafted = engine.generate(prompt, args.max_new_tokens)
    exact = engine.generate(prompt, args.max_new_tokens, speculative=False, exact=True)
    if isinstance(prompt, str) or engine.codec is not None:
        print(prompt if isinstance(prompt, str) else engine.codec.decode(prompt), end="")
        print(drafted.text)
    else:  # token ids and no tokenizer: ids in, ids out
        print(" ".join(map(str, prompt)), "->", " ".join(map(str, drafted.tokens)))
    print("-" * 72)
    print(f"plain : {plain.decode_tok_s:7.1f} tok/s")
    print(f"dflash: {drafted.decode_tok_s:7.1f} tok/s   tau {drafted.tau_mean:.2f} over {len(drafted.accepted)} rounds"
          f"   speedup {drafted.decode_tok_s / max(plain.decode_tok_s, 1e-9):.2f}x")
    print(f"dflash == plain through the verify graph (exact): {'yes' if drafted.tokens == exact.tokens else 'NO'}")
    div = next((i for i, (a, b) in enumerate(zip(plain.tokens, drafted.tokens)) if a != b), None)
    if div is None:
        print("dflash == plain through the decode graph: yes")
    else:
        print(f"dflash vs plain through the decode graph: first divergence at token {div} "
              f"({engine.artifacts.manifest.dtype} rounding differs between the two graphs at a near-tie)")
    return 0 if drafted.tokens == exact.tokens else 1


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "demo": cmd_demo, "serve": cmd_serve, "eager": cmd_eager,
            "compile": cmd_compile, "topk-check": cmd_topk_check, "calibrate": cmd_calibrate}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dflash-iree` console script; returns the exit status: 0, 1 (bench or
    demo found drafted != plain), 2 (bad input, or a fault named in one line), 130 (Ctrl-C)."""
    args = None
    try:
        with warnings.catch_warnings(), _notes():
            warnings.showwarning = _show_warning
            # libraries' deprecation notices (torch's pytree during export) are not the user's to act on
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            args = build_parser().parse_args(argv)
            return COMMANDS[args.command](args)
    except DFlashError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print("\ndflash-iree: interrupted; nothing half-written was left behind", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # `dflash-iree generate ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        return _fail(_os_error(e, getattr(args, "command", None)))
    except RuntimeError as e:  # IREE reports device memory exhaustion as RuntimeError
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return _fail(f"out of device memory ({str(e).splitlines()[0][:200]}); recompile with a smaller --max-context, "
                     "or free the device")


def _fail(message: str) -> int:
    print(f"dflash-iree: error: {message}", file=sys.stderr)
    return 2


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"dflash-iree: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def _notes():
    """The library's notes for the user (the `dflash_iree` logger at INFO and above, e.g. what
    quantize on load made or reused) as `dflash-iree: ...` lines on stderr, for one command: the
    logger is left as it was after, since tests and embedders call main() in their own process."""
    logger = logging.getLogger("dflash_iree")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dflash-iree: %(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # printed here once, not again by a root handler
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _os_error(e: OSError, command: str | None) -> str:
    """One line for an OSError: the file, the system's reason, and what to do."""
    where = f"{e.filename}: " if e.filename else ""
    fix = {errno.ENOSPC: "free some space on that disk and run it again",
           errno.EDQUOT: "free some space (disk quota) and run it again",
           errno.EACCES: "it is not writable or readable by you: choose another folder or fix its permissions",
           errno.EPERM: "it is not writable or readable by you: choose another folder or fix its permissions",
           errno.EROFS: "it is on a read-only file system: choose another folder"}.get(e.errno, "check the path")
    kept = "; --out was left as it was" if command == "compile" else ""
    return f"{where}{e.strerror or e}: {fix}{kept}"
