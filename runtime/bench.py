"""`dflash-iree bench`: the same prompts decoded plain and drafted, side by side in one run.

Arms alternate per prompt and run (A B A B ...), so machine noise hits both alike. Per arm it
reports decode tok/s (median and the 10th..90th percentile spread over requests) and time to
first token; for the drafted arm also mean τ, the τ histogram and the first-draft-correct rate
(rounds whose first draft token was accepted); then the speedup drafted / plain and whether both
arms produced the same tokens for every prompt.

Token equality is judged against plain decoding through the verify graph (`exact`, one untimed
extra run per prompt), which holds bit for bit in any dtype. The timed plain arm uses the decode
graph, which in bf16 may round differently at near-ties: those prompts are counted separately.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from dflash_iree import validate
from dflash_iree.acceptance import check_fits
from dflash_iree.errors import DFlashError


def read_prompts(path: str | Path, limit: int | None = None, encoding: str = "utf-8") -> list:
    """Prompts from a JSONL file: each line an object with "prompt" (text), "prompt_ids" (ids) or
    "messages" (chat messages [{"role", "content"}], rendered later with the target's chat template,
    as `generate --chat` renders them; bench/prompts/chat.jsonl).

    Args:
        limit: use the first `limit` prompts (>= 1), or all (None).
        encoding: the file's text encoding (strict: bytes not valid in it are refused).

    Raises:
        DFlashError: a missing file, bytes not valid in `encoding`, a bad line (not an object, no
            "prompt" string, "prompt_ids" list of integers or "messages" list of chat messages), no
            prompts, or limit < 1.
    """
    path = Path(path)
    if limit is not None:
        validate.count(limit, "--limit", "prompts to use from the file")
    if path.is_dir():
        raise DFlashError(f"{path} is a folder; pass a JSONL file of {{\"prompt\": ...}} lines in it")
    if not path.is_file():
        raise DFlashError(f"{path} does not exist; pass a JSONL file of {{\"prompt\": ...}} lines")
    prompts = []
    for n, line in enumerate(validate.decode(path.read_bytes(), encoding, str(path)).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
            key = next(k for k in ("prompt_ids", "messages", "prompt") if k in row)
            prompt = row[key]
        except (ValueError, StopIteration, TypeError):
            raise DFlashError(f"{where}: expected a JSON object with a \"prompt\", \"prompt_ids\" or \"messages\" "
                              "field") from None
        if key == "messages":
            if not (isinstance(prompt, list) and prompt and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt)):
                raise DFlashError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}")
            prompts.append(prompt)
        elif isinstance(prompt, str):
            prompts.append(validate.text(prompt, f"{where} \"prompt\""))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompts.append(prompt)
        else:
            raise DFlashError(f"{where}: \"prompt\" must be a string, \"prompt_ids\" a non-empty list of integer "
                              "token ids")
    if not prompts:
        raise DFlashError(f"{path} holds no prompts")
    return prompts[:limit] if limit else prompts


def _spread(values: list[float]) -> dict:
    if not values:
        return {"median": 0.0, "p10": 0.0, "p90": 0.0}
    qs = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return {"median": statistics.median(values), "p10": qs[0], "p90": qs[-1]}


def run_bench(engine, prompts: list, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
              runs: int = 1, log=print) -> dict:
    """Decode every prompt plain and drafted, `runs` times, alternating the arms.

    Returns:
        A JSON-ready dict: per-arm tok/s and TTFT (ms) spreads, τ stats, speedup, same_tokens.
    """
    runs = validate.count(runs, "runs", "times each prompt runs per arm")
    if not prompts:
        raise DFlashError("no prompts to benchmark")
    max_new_tokens = validate.count(max_new_tokens, "max_new_tokens", "new tokens to generate")
    for i, prompt in enumerate(prompts):  # every prompt, before the first is run
        try:
            check_fits(len(engine.encode_prompt(prompt)), max_new_tokens, engine.block_size, engine.max_context)
        except DFlashError as e:
            raise DFlashError(f"prompt {i + 1} of {len(prompts)}: {e}") from None
    arms = {"plain": [], "dflash": []}
    same, decode_graph_diffs, accepted_all, first_ok = True, 0, [], []
    for r in range(runs):
        for i, prompt in enumerate(prompts):
            out = {}
            for arm in ("plain", "dflash") if (i + r) % 2 == 0 else ("dflash", "plain"):
                g = engine.generate(prompt, max_new_tokens, temperature=temperature, seed=seed,
                                    speculative=arm == "dflash")
                out[arm] = g
                arms[arm].append(g)
            if r == 0:
                exact = engine.generate(prompt, max_new_tokens, temperature=temperature, seed=seed,
                                        speculative=False, exact=True)
                same &= exact.tokens == out["dflash"].tokens
                decode_graph_diffs += out["plain"].tokens != out["dflash"].tokens
            accepted_all += out["dflash"].accepted
            first_ok += [a >= 1 for a in out["dflash"].accepted]
            if log:
                log(f"run {r + 1}/{runs} prompt {i + 1}/{len(prompts)}: plain {out['plain'].decode_tok_s:.1f} tok/s, "
                    f"dflash {out['dflash'].decode_tok_s:.1f} tok/s, tau {out['dflash'].tau_mean:.2f}")
    B = engine.block_size
    hist = [0] * B
    for a in accepted_all:
        hist[a] += 1
    result = {
        "artifacts": str(engine.artifacts.folder), "arch": engine.artifacts.arch, "block_size": B,
        "prompts": len(prompts), "runs": runs, "max_new_tokens": max_new_tokens, "temperature": temperature,
        "same_tokens": same, "decode_graph_differs": decode_graph_diffs,
    }
    for arm, gens in arms.items():
        result[arm] = {"decode_tok_s": _spread([g.decode_tok_s for g in gens]),
                       "ttft_ms": _spread([g.ttft_ms for g in gens]),
                       "tokens": sum(len(g.tokens) for g in gens),
                       "decode_s": sum(g.decode_s for g in gens)}
    result["dflash"].update({
        "tau_mean": sum(a + 1 for a in accepted_all) / max(1, len(accepted_all)),
        "tau_histogram": hist,
        "first_draft_correct": sum(first_ok) / max(1, len(first_ok)),
        "rounds": len(accepted_all),
    })
    p, d = result["plain"]["decode_tok_s"]["median"], result["dflash"]["decode_tok_s"]["median"]
    result["speedup"] = d / p if p else 0.0
    return result


def format_table(result: dict) -> str:
    """The benchmark as a plain-text table."""
    rows = [("arm", "decode tok/s (median)", "p10..p90", "TTFT ms (median)")]
    for arm in ("plain", "dflash"):
        a = result[arm]
        rows.append((arm, f"{a['decode_tok_s']['median']:.1f}",
                     f"{a['decode_tok_s']['p10']:.1f}..{a['decode_tok_s']['p90']:.1f}", f"{a['ttft_ms']['median']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    d = result["dflash"]
    lines += [
        f"speedup dflash/plain: {result['speedup']:.2f}x   same tokens as plain (exact): "
        f"{'yes' if result['same_tokens'] else 'NO'}; prompts where the decode graph rounds differently: "
        f"{result['decode_graph_differs']}/{result['prompts']}",
        f"tau mean {d['tau_mean']:.2f} over {d['rounds']} rounds; first draft correct {d['first_draft_correct']:.0%}",
        "tau histogram (1..B): " + " ".join(str(h) for h in d["tau_histogram"]),
    ]
    return "\n".join(lines)


def check_plot() -> None:
    """Refuse --plot before a run when matplotlib is missing (not after it).

    Raises:
        DFlashError: matplotlib is not installed.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DFlashError("--plot needs matplotlib: pip install matplotlib (or leave --plot out)") from None


def plot(result: dict, path: str | Path) -> None:
    """Draw the τ histogram and the tok/s comparison to a PNG (needs matplotlib).

    Raises:
        DFlashError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError("--plot needs matplotlib: pip install matplotlib") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    hist = result["dflash"]["tau_histogram"]
    ax1.bar(range(1, len(hist) + 1), hist)
    ax1.set(xlabel="acceptance length τ (tokens per round)", ylabel="rounds",
            title=f"τ mean {result['dflash']['tau_mean']:.2f}")
    meds = [result[a]["decode_tok_s"]["median"] for a in ("plain", "dflash")]
    errs = [[m - result[a]["decode_tok_s"]["p10"] for m, a in zip(meds, ("plain", "dflash"))],
            [result[a]["decode_tok_s"]["p90"] - m for m, a in zip(meds, ("plain", "dflash"))]]
    ax2.bar(["plain", "dflash"], meds, yerr=errs, capsize=6)
    ax2.set(ylabel="decode tok/s", title=f"speedup {result['speedup']:.2f}x ({result['arch']})")
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")  # whole or not at all, like --json
    try:
        fig.savefig(tmp, dpi=100, format=path.suffix.lstrip(".") or "png")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
