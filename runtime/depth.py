"""The draft depth of shared rounds: how many rows the batch engine's next round verifies, from the
drafter's confidence and the artifact's measured cost of a round (docs/architecture.md, "Draft
depth for shared rounds").

A module of S > 1 streams has `verify_rows{R}` for a few R (export/depth_entry_points.py): a round
of every stream over [S, R] rows, which also writes the drafter's top-1 log-probs of the next
draft. `depth_cost.json` (written by `dflash-iree calibrate`, runtime/calibrate.py, and listed in
the manifest's `files`) holds the measured milliseconds of each such round and of a plain step.
Before each round `DepthRule.plan` picks R, or a plain step of every stream (`FALLBACK`), to
maximise expected tokens per millisecond:

    value(R)  = sum over streams of E[tau_s(min(R - 1, drafts_s))] / rows_ms[R]
    value(plain) = streams / fallback_ms
    E[tau(d)] = 1 + sum_{k=1..d} prod_{j<=k} p_j,  p_j = exp(confidence_j)

(the expected accepted length of a chain whose j-th draft is accepted with probability p_j,
independently: Leviathan et al., "Fast Inference from Transformers via Speculative Decoding", 2023,
section 3.1, with the per-position probabilities of the drafter's own top-1 in place of a constant).
Rows are shared: in a round of R rows every stream verifies min(R - 1, its drafts), since more rows
of one stream cost nothing once R is paid; a stream of unlikely drafts lowers R only through its
share of the sum. After a plain step no stream has a draft (the drafter drafts in the round), so the
rule waits 1, 2, 4 ... (at most MAX_WAIT) more plain steps, doubling each time a probe (a round of
the fewest rows, anchors only, which drafts the next block) again chooses plain.

The depth never changes the output: the verified rows are the target's own tokens however many
there are (tests/test_depth.py forces every depth against full depth and plain decoding). In float32
token for token; in bf16 each row count is a graph of its own (docs/architecture.md).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_iree.errors import DFlashError
from dflash_iree.guard import DFlashWarning
from dflash_iree.manifest import DEPTH_COST_FILE, rows_of

FALLBACK = None  # RoundPlan.rows of a plain step of every stream
MAX_WAIT = 16  # plain steps at most between two probes
FLAT = 0.02  # a whole-block round within 2% of the cheapest call: noise of the measurement, no saving
COST_FORMAT = 1
_warned: set[str] = set()  # artifact folders whose missing cost file was logged


def calibrate_hint(folder) -> str:
    return f"measure it again: dflash-iree calibrate --artifacts {folder}"


@dataclass(frozen=True)
class CostModel:
    """The measured cost of a round (depth_cost.json).

    rows_ms: R -> median milliseconds of one `verify_rows{R}` round of all S streams.
    fallback_ms: one plain step of all S streams that keeps the drafter's context (prefill of one
        row per stream, then absorb).
    """

    rows_ms: dict[int, float]
    fallback_ms: float

    def full_depth_always(self) -> bool:
        """Whether the rule would choose the whole block whatever the drafts: E[tau] does not fall as
        rows are added and is at least 1 a stream (a plain step's yield), so when the largest R costs
        no more (within FLAT) than every smaller R and than a plain step, no confidence can choose
        otherwise. Then the rule is only overhead: the H200 runs the demo pair's rounds at 1.22-1.27 ms
        for 2, 4 or 8 rows (experiments/2026-12-02-draft-depth-h200/), calls, not bytes, bounding them."""
        full = self.rows_ms[max(self.rows_ms)]
        return full <= (1 + FLAT) * min(min(self.rows_ms.values()), self.fallback_ms)

    @classmethod
    def load(cls, folder: Path, manifest) -> "CostModel | None":
        """The cost model of an artifact folder; None (logged once) when it has none.

        Raises:
            DFlashError: the file is not listed in the manifest's files, is not JSON, or has a
                missing, wrong-typed or non-positive field, or rows other than the module's; the
                message names the file and `dflash-iree calibrate`.
        """
        path = Path(folder) / DEPTH_COST_FILE
        if not path.exists():
            if str(folder) not in _warned:
                _warned.add(str(folder))
                warnings.warn(f"{path} does not exist: the draft depth rule is off (every round verifies the whole "
                              f"block); measure it with dflash-iree calibrate --artifacts {folder}", DFlashWarning,
                              stacklevel=3)
            return None
        if DEPTH_COST_FILE not in manifest.files:
            raise DFlashError(f"{path} is not listed in {Path(folder) / 'manifest.json'} (not written by calibrate); "
                              + calibrate_hint(folder))
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DFlashError(f"{path} is not a JSON cost file ({e}); {calibrate_hint(folder)}") from None
        return cls.from_json(data, path, manifest, folder)

    @classmethod
    def from_json(cls, data, path, manifest, folder) -> "CostModel":
        """Checked against the manifest (streams, block size, the compiled rows); DFlashError as `load`."""
        def bad(what):
            return DFlashError(f"{path}: {what}; {calibrate_hint(folder)}")

        if not isinstance(data, dict):
            raise bad("not a JSON object")
        if data.get("format") != COST_FORMAT:
            raise bad(f"format {data.get('format')!r}, this runtime reads format {COST_FORMAT}")
        for key, want in (("streams", manifest.streams), ("block_size", manifest.block_size)):
            if data.get(key) != want:
                raise bad(f"{key} {data.get(key)!r}, the module's is {want}")
        rows = data.get("rows_ms")
        if not isinstance(rows, dict):
            raise bad("rows_ms is missing or not an object of row count -> milliseconds")
        compiled = sorted(compiled_rows(manifest))
        if sorted(rows) != [str(r) for r in compiled]:
            raise bad(f"rows_ms has rows {sorted(rows)}, the module compiles {compiled}")
        values = {int(r): rows[r] for r in rows} | {"fallback": data.get("fallback_ms")}
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(f"{'fallback_ms' if k == 'fallback' else f'rows_ms[{k}]'} is {v!r}, not a positive "
                          "number of milliseconds")
        return cls({int(r): float(rows[r]) for r in rows}, float(data["fallback_ms"]))


def compiled_rows(manifest) -> list[int]:
    """The R of every `verify_rows{R}` entry point in the manifest, ascending (empty for S = 1)."""
    return sorted({r for e in manifest.entry_points if (r := rows_of(e["name"])) is not None})


def expected_tau(logprobs, depth: int) -> float:
    """E[tau] of verifying `depth` drafts whose top-1 log-probs (natural log, one per drafted
    position, in order) are `logprobs`: 1 + sum_{k<=depth} prod_{j<=k} exp(logprobs[j])."""
    total, chain = 1.0, 1.0
    for lp in list(logprobs)[:depth]:
        chain *= math.exp(min(0.0, float(lp)))
        total += chain
    return total


@dataclass
class StreamView:
    """What the rule sees of one running stream: its slot, the drafts it has for this round (0: none,
    a plain stream, or one waiting for its first draft) and their top-1 log-probs (None: unknown)."""

    slot: int
    drafts: int
    logprobs: list[float] | None = None


@dataclass
class RoundPlan:
    """rows: the R to verify (a compiled row count), or FALLBACK (a plain step of every stream);
    depth: slot -> drafts that stream verifies (0..R-1)."""

    rows: int | None
    depth: dict[int, int] = field(default_factory=dict)


class DepthRule:
    """The cost-model rule of the module docstring.

    Args:
        costs: the artifact's CostModel (its rows are the module's compiled rows).
    """

    def __init__(self, costs: CostModel):
        self.costs = costs
        self.rows = sorted(costs.rows_ms)
        self._wait, self._backoff = 0, 1

    def plan(self, streams: list[StreamView], round_index: int) -> RoundPlan:
        """This round's plan for the running streams (round_index: the engine's round count, unused
        here; the forced rule of the tests keys on it)."""
        if not any(v.drafts for v in streams):
            if self._wait > 0:  # no draft to judge: plain steps until the next probe
                self._wait -= 1
                return RoundPlan(FALLBACK)
            return RoundPlan(self.rows[0], {v.slot: 0 for v in streams})  # a probe: anchors, then a draft
        best_rows, best = FALLBACK, len(streams) / self.costs.fallback_ms
        for R in self.rows:
            tau = sum(expected_tau(v.logprobs or [], min(R - 1, v.drafts)) if v.logprobs is not None
                      else 1 + min(R - 1, v.drafts) for v in streams)
            if tau / self.costs.rows_ms[R] > best:
                best_rows, best = R, tau / self.costs.rows_ms[R]
        if best_rows is FALLBACK:
            self._wait, self._backoff = self._backoff, min(2 * self._backoff, MAX_WAIT)
            return RoundPlan(FALLBACK)
        self._backoff = 1
        return RoundPlan(best_rows, {v.slot: min(best_rows - 1, v.drafts) for v in streams})


class ForcedDepth:
    """A rule of given depths (tests): `depth(round_index, slot)` drafts for that stream (clipped to
    its drafts), the round's R the fewest compiled rows that hold them all; `fallback(round_index)`
    True: a plain step of every stream instead.

    Args:
        rows: the module's compiled row counts (`compiled_rows`).
    """

    def __init__(self, rows: list[int], depth: Callable[[int, int], int],
                 fallback: Callable[[int], bool] = lambda i: False):
        self.rows, self.depth, self.fallback = sorted(rows), depth, fallback

    def plan(self, streams: list[StreamView], round_index: int) -> RoundPlan:
        if self.fallback(round_index):
            return RoundPlan(FALLBACK)
        depth = {v.slot: max(0, min(self.depth(round_index, v.slot), v.drafts)) for v in streams}
        R = next(r for r in self.rows if r >= max(depth.values(), default=0) + 1)
        return RoundPlan(R, depth)


def rule_for(engine) -> DepthRule | None:
    """The depth rule of an Engine's artifacts, read once per Engine: None when the module has no
    `verify_rows` (S = 1), no cost file (logged once), or costs under which the whole block always
    wins (`CostModel.full_depth_always`, logged once).

    Raises:
        DFlashError: a corrupt cost file (CostModel.load).
    """
    if not hasattr(engine, "_depth_costs"):
        a = engine.artifacts
        engine._depth_costs = CostModel.load(a.folder, a.manifest) if compiled_rows(a.manifest) else None
        if engine._depth_costs is not None and engine._depth_costs.full_depth_always():
            warnings.warn(f"{Path(a.folder) / DEPTH_COST_FILE}: a round of the whole block costs no more than fewer "
                          "rows or a plain step here, so the draft depth rule is off (every round verifies the "
                          "whole block)", DFlashWarning, stacklevel=3)
            engine._depth_costs = None
    return DepthRule(engine._depth_costs) if engine._depth_costs is not None else None
