"""`dflash-iree bench --parallel 1,4`: plain against drafted decoding with N requests at once
through the batch engine (runtime/batch.py), the arms alternated, for each N of the list.

Per N and arm: the aggregate tok/s (every new token of the prompt set over the arm's wall time,
prefills and queueing included), the per-stream decode tok/s (each request's tokens after its first
over its own decode time), the time to first token (from `add`, so it counts the wait for a slot)
and τ. When the artifacts have a cost file (depth_cost.json, `dflash-iree calibrate`), the drafted
arm runs with the draft depth rule (runtime/depth.py) and a third arm, `full`, drafts with it off
(every round verifies the whole block), also alternated; the dflash arm reports how many rounds
the rule gave each row count (`round_rows`, "plain": plain steps). `same_tokens`: every prompt's
drafted tokens equal its plain ones (a float32 module gives equality; bf16 can part at near-ties,
README "Definitions").
"""

from __future__ import annotations

import statistics
import time

from dflash_iree import validate
from dflash_iree.errors import DFlashError

from .batch import BatchEngine
from .options import GenerateOptions


def parse_levels(text: str, capacity: int) -> list[int]:
    """`--parallel` "1,4" -> [1, 4].

    Raises:
        DFlashError: not a comma-separated list of integers 1..capacity (the module's streams).
    """
    try:
        levels = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise DFlashError(f"--parallel {text!r} is not a list of stream counts; use e.g. --parallel 1,4") from None
    bad = [n for n in levels if not 1 <= n <= capacity]
    if not levels or bad:
        raise DFlashError(f"--parallel {text!r}: use stream counts 1..{capacity} (the artifacts were compiled with "
                          f"--streams {capacity}; compile with more --streams for more)")
    return levels


def run_parallel(engine, prompts: list, levels: list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 seed: int = 0, runs: int = 1, log=print) -> dict:
    """Every prompt plain and drafted at each concurrency of `levels`, `runs` times, arms alternated.

    Args:
        engine: a loaded Engine (its module's `streams` bounds the levels).

    Returns:
        A JSON-ready dict: {"levels": {N: {"plain": ..., "dflash": ..., "speedup": ...}}, "same_tokens", ...}.
    """
    runs = validate.count(runs, "runs", "times each level runs per arm")
    if not prompts:
        raise DFlashError("no prompts to benchmark")
    batch = BatchEngine(engine)
    ids = [batch.encode_prompt(p) for p in prompts]
    engines = {"plain": batch, "dflash": batch}
    if batch.depth is not None:
        engines["full"] = BatchEngine(engine, depth=None)
    arms = {"plain": False, "dflash": True, "full": True}
    arms = {a: arms[a] for a in engines}
    out = {"artifacts": str(engine.artifacts.folder), "arch": engine.artifacts.arch, "streams": batch.capacity,
           "prompts": len(prompts), "runs": runs, "max_new_tokens": max_new_tokens, "temperature": temperature,
           "depth_rule": batch.depth is not None, "same_tokens": True, "levels": {}}
    batch.generate_many(ids[:1], GenerateOptions(max_new_tokens=8))  # warm-up: first calls pay one-time setup
    for n in levels:
        got = {arm: [] for arm in arms}
        walls = {arm: [] for arm in arms}
        batch.round_rows = {}
        for r in range(runs):
            for arm in arms if r % 2 == 0 else reversed(list(arms)):
                o = GenerateOptions(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                    speculative=arms[arm])
                t0 = time.perf_counter()
                res = engines[arm].generate_many(ids, o, concurrency=n)
                walls[arm].append(time.perf_counter() - t0)
                got[arm].append(res)
            out["same_tokens"] &= all(all(a.tokens == b.tokens for a, b in zip(got["plain"][-1], got[arm][-1]))
                                      for arm in arms)
            if log:
                log(f"--parallel {n} run {r + 1}/{runs}: " + ", ".join(f"{a} {walls[a][-1]:.2f} s" for a in arms))
        level = {}
        for arm in arms:
            gens = [g for res in got[arm] for g in res]
            tokens = sum(len(g.tokens) for g in got[arm][0])
            accepted = [a for g in gens for a in g.accepted]
            level[arm] = {"aggregate_tok_s": statistics.median(tokens / w for w in walls[arm]),
                          "per_stream_tok_s": statistics.median(g.decode_tok_s for g in gens),
                          "ttft_ms": statistics.median(g.ttft_ms for g in gens),
                          "tau_mean": sum(a + 1 for a in accepted) / len(accepted) if accepted else None,
                          "wall_s": walls[arm]}
        level["speedup"] = level["dflash"]["aggregate_tok_s"] / level["plain"]["aggregate_tok_s"]
        if "full" in arms:
            level["full_speedup"] = level["full"]["aggregate_tok_s"] / level["plain"]["aggregate_tok_s"]
            level["dflash"]["round_rows"] = {str(k): v for k, v in batch.round_rows.items()}
        out["levels"][str(n)] = level
    return out


def format_parallel_table(result: dict) -> str:
    """The result as a text table: one line per concurrency and arm."""
    def n(count, what):
        return f"{count} {what}{'s' * (count != 1)}"

    lines = [f"{n(result['prompts'], 'prompt')} x {n(result['runs'], 'run')}, {result['max_new_tokens']} new tokens, "
             f"module of {n(result['streams'], 'stream')} ({result['arch']})",
             f"{'streams':>7} {'arm':>6} {'aggregate tok/s':>15} {'per-stream tok/s':>16} {'TTFT ms':>8} {'tau':>5} {'speedup':>7}"]
    for streams, level in result["levels"].items():
        for arm in [a for a in ("plain", "dflash", "full") if a in level]:
            a = level[arm]
            tau = f"{a['tau_mean']:.2f}" if a["tau_mean"] else "-"
            sp = {"dflash": f"{level['speedup']:.2f}x", "full": f"{level.get('full_speedup', 0):.2f}x"}.get(arm, "")
            lines.append(f"{streams:>7} {arm:>6} {a['aggregate_tok_s']:>15.1f} {a['per_stream_tok_s']:>16.1f} "
                         f"{a['ttft_ms']:>8.1f} {tau:>5} {sp:>7}")
    rule = ("on (dflash; full: off, the whole block every round)" if result.get("depth_rule") else
            "off (no verify_rows entry points, as in a hybrid target's module; no depth_cost.json; or its costs "
            "make the whole block always the choice)")
    lines.append(f"depth rule: {rule}")
    lines.append(f"same tokens: {'yes' if result['same_tokens'] else 'NO'}")
    return "\n".join(lines)
