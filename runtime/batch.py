"""The multi-stream engine: up to S requests decoded together, one round for all of them a step
(continuous batching), on a module compiled with `--streams S` (or 1).

`BatchEngine` implements the engine protocol that the server drives (docs/architecture.md, "Several
streams"): `capacity`, `active`, `encode_prompt`, `add`, `cancel`, `step` -> [StreamEvent]. Requests
join and leave at round boundaries: `add` validates a request and queues it; each `step` first
finishes cancelled requests, then prefills at most one queued request into a free slot (one call:
the running streams wait at most one prefill), then runs one round for every active stream: one
`verify_draft` call when any stream drafts (or asks for `exact`), else one `decode` call (with one
stream running, the module's one-stream form of them, runtime/stream_calls.py). Each stream
keeps its own length, sampling parameters, stop rule and rollback (runtime/stream_calls.py: every
argument has a row per stream); a plain stream in a drafted round verifies its anchor alone
(n_draft 0), which is plain decoding through the verify graph.

A joining drafted request's first round verifies its anchor alone too (n_draft 0): the device drafts
its first block from that round's taps, so joining costs no `draft` call of all streams. That round
and any other of no drafts is not counted in `accepted` (τ is over drafted rounds). The host's rule
(dflash_iree/acceptance.py, or the `accept` seam) decides what is committed; where it keeps another
count than the device, that stream's next round has no drafts (the device's draft followed other rows).

On a module of several streams with a cost file (depth_cost.json, `dflash-iree calibrate`), the
draft depth rule (runtime/depth.py) picks each drafted round's rows: one `verify_rows{R}` call, each
stream verifying min(R - 1, its drafts), or a plain step of every stream that keeps the drafter's
context (StreamCalls.plain_step); without the file every drafted round is `verify_draft`.

One thread only: the server calls it from its worker thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dflash_iree import validate
from dflash_iree.acceptance import accept_length, check_fits
from dflash_iree.errors import DFlashError
from dflash_iree.generation import GenerationResult

from . import decode
from .depth import FALLBACK, RoundPlan, StreamView, rule_for
from .engine import Engine
from .options import GenerateOptions
from .request import Request
from .stream_calls import GREEDY, StreamCalls
from .text import StreamDecoder

__all__ = ["BatchEngine", "StreamEvent"]


@dataclass
class StreamEvent:
    """What one `step` gives one request.

    token_ids: tokens new since this request's previous event (cut before a stop string as the result is).
    text: their text delta (UTF-8 safe, cut before stop strings), "" if none or without a tokenizer.
    finished: the request is done; finish_reason "stop" (a stop token or string), "length" (the
        max_new_tokens budget) or "cancelled"; result its GenerationResult.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    result: GenerationResult | None = None


@dataclass
class _Stream:
    """A request admitted to the engine: its Request, its slot (None while queued), what was sent."""

    request_id: str
    req: Request
    streamer: StreamDecoder | None
    slot: int | None = None
    sent: int = 0
    cancelled: bool = False
    draft_ready: bool = False  # req.next_draft holds the device's draft for this stream's next round
    confidence: list[float] | None = None  # the drafter's top-1 log-probs of that draft (depth rule rounds)


class BatchEngine:
    """Up to `capacity` requests decoded together on one Engine's module.

    Args:
        engine: a loaded Engine (`Engine.load`); its module's manifest `streams` is the capacity.
            Its seams' `accept` rule and `proposer` (a scripted drafter, tests) are used; the other
            seams are the one-stream loop's and are ignored here.
        depth: the draft depth rule (runtime/depth.py): "auto", the artifacts' own (`rule_for`: off
            for a module without `verify_rows` or without depth_cost.json); None, off (every round
            verifies the whole block); or a rule object with `plan(views, round_index)` and `rows`
            (tests: `ForcedDepth`).
        one_stream: a round with one stream running calls the module's one-stream form
            (runtime/stream_calls.py) where it has one; False: always the S-stream calls (benchmarks).

    Raises:
        DFlashError: "auto" with a corrupt depth_cost.json (runtime/depth.py CostModel.load).
    """

    def __init__(self, engine: Engine, depth="auto", one_stream: bool = True):
        self.engine = engine
        self.depth = rule_for(engine) if depth == "auto" else depth
        self.rounds = 0
        self.round_rows: dict = {}  # R or "plain" -> rounds the depth rule planned so
        self.capacity = int(engine.artifacts.manifest.streams)
        self.calls = StreamCalls(engine.module, self.capacity, one_stream)
        self.block_size = engine.block_size
        self.max_context = engine.max_context
        self._slots: list[_Stream | None] = [None] * self.capacity
        self._queue: deque[_Stream] = deque()
        self._ids: dict[str, _Stream] = {}

    @classmethod
    def load(cls, artifacts: str = "compiled/host", target: str | None = None, drafter: str | None = None,
             device: str | None = None) -> "BatchEngine":
        """`Engine.load(...)` (same arguments and errors) served as a BatchEngine."""
        return cls(Engine.load(artifacts, target, drafter, device))

    @property
    def active(self) -> int:
        """Requests admitted (queued or in a slot) and not finished."""
        return len(self._ids)

    def encode_prompt(self, prompt, enable_thinking: bool = False) -> list[int]:
        """As `Engine.encode_prompt`: text, token ids or chat messages -> token ids."""
        return self.engine.encode_prompt(prompt, enable_thinking)

    def add(self, request_id: str, prompt_ids: list[int], options: GenerateOptions | None = None) -> None:
        """Admit a request; it joins at the next `step` with a free slot (queued in order of arrival).

        Raises:
            DFlashError: every slot taken or queued (capacity), a request_id already admitted,
                prompt ids outside the vocabulary or empty, num_speculative_tokens out of range,
                draft_top_k (not served by the batch engine), or prompt + max_new_tokens + block
                over max_context.
        """
        if self.active >= self.capacity:
            raise DFlashError(f"all {self.capacity} streams are busy (the module was compiled with --streams "
                              f"{self.capacity}); wait for a request to finish, or compile with more --streams")
        if request_id in self._ids:
            raise DFlashError(f"request_id {request_id!r} is already running; give each request its own id")
        o = options or GenerateOptions()
        if o.draft_top_k:
            raise DFlashError("draft_top_k is not served by the batch engine (runtime/batch.py) yet: use "
                              "Engine.generate on artifacts compiled with --streams 1 for it")
        e = self.engine
        ids = e.encode_prompt(list(prompt_ids))
        B = self.block_size
        n = B - 1 if o.num_speculative_tokens is None or not o.drafted else \
            validate.num_speculative_tokens(o.num_speculative_tokens, B)
        check_fits(len(ids), o.max_new_tokens, B, e.max_context)
        stop = e._stop_rule(o.stop, o.max_new_tokens)
        req = Request(ids, o, stop, n, fused_round=True, vocab_size=e.vocab_size)
        req.t_start = time.perf_counter()  # the time to first token counts the wait for a slot
        s = _Stream(request_id, req, StreamDecoder(e.codec, stop.strings) if e.codec else None)
        self._queue.append(s)
        self._ids[request_id] = s

    def cancel(self, request_id: str) -> None:
        """End a request at the next step (a finished event, finish_reason "cancelled"); an unknown
        or finished id is ignored (it may have finished in the meantime)."""
        if request_id in self._ids:
            self._ids[request_id].cancelled = True

    def step(self) -> list[StreamEvent]:
        """Finish cancelled requests, prefill at most one queued request, then one round for every
        active stream. Returns an event per request with news (new tokens or its end)."""
        events = [self._finish(s, "cancelled") for s in list(self._ids.values()) if s.cancelled]
        free = [i for i, s in enumerate(self._slots) if s is None]
        if self._queue and free:
            s = self._queue.popleft()
            s.slot = free[0]
            self._slots[s.slot] = s
            self._prefill(s)
        running = [s for s in self._slots if s is not None and not s.req.done]
        if running:
            self._round(running)
        for s in [s for s in self._slots if s is not None]:
            if s.req.done:
                events.append(self._finish(s, self._reason(s.req)))
            elif len(s.req.tokens) > s.sent:
                events.append(self._event(s, False))
        return events

    def generate_many(self, prompts: Sequence, options: GenerateOptions | Sequence[GenerateOptions] | None = None,
                      concurrency: int | None = None) -> list[GenerationResult]:
        """Generate a completion for each prompt (text, ids or chat messages), up to `capacity` at
        once, the rest joining as slots free; each result is the one `Engine.generate` gives.

        Args:
            options: one GenerateOptions for all prompts, or one per prompt (default: all defaults).
            concurrency: at most this many at once (default and at most `capacity`; at least 1).

        Raises:
            DFlashError: as `add`, for the first bad prompt or option (before any work); a busy engine;
                a concurrency below 1.
        """
        if concurrency is not None:
            concurrency = validate.count(concurrency, "concurrency", "requests decoded at once")
        opts = list(options) if isinstance(options, Sequence) else [options or GenerateOptions()] * len(prompts)
        if len(opts) != len(prompts):
            raise DFlashError(f"{len(prompts)} prompts but {len(opts)} options; give one options for all, or one each")
        if self.active:
            raise DFlashError("generate_many needs an idle engine; finish or cancel the running requests first")
        todo = deque((f"generate_many-{i}", self.encode_prompt(p, o.enable_thinking), o)
                     for i, (p, o) in enumerate(zip(prompts, opts)))
        results: dict[str, GenerationResult] = {}
        order = [t[0] for t in todo]
        for t in todo:  # every prompt checked before any work
            check_fits(len(t[1]), t[2].max_new_tokens, self.block_size, self.engine.max_context)
        while todo or self.active:
            while todo and self.active < min(concurrency or self.capacity, self.capacity):
                self.add(*todo.popleft())
            for ev in self.step():
                if ev.finished:
                    results[ev.request_id] = ev.result
        return [results[i] for i in order]

    # -- the steps --------------------------------------------------------------------------

    def _prefill(self, s: _Stream) -> None:
        req = s.req
        first, taps = self.calls.prefill(s.slot, req.prompt, self._sampling(req))
        req.tokens.append(first)
        req.t_first = time.perf_counter()
        req.done = req.stop.ends(req.tokens)
        decode.check_stop_strings(req)
        if req.speculative:
            self.calls.absorb(s.slot, taps)
        s.draft_ready = False

    def _sampling(self, req: Request) -> tuple:
        o = req.options
        if o.temperature == 0:
            return GREEDY
        return (o.temperature, min(o.top_k, self.engine.vocab_size), o.top_p, o.seed)

    def _round_starts(self, streams: list[_Stream | None]) -> list[int]:
        """Each slot's write position this round: its anchor's position (0 for an idle slot).
        (tests/test_batch.py plants a variant that leaks one stream's into another.)"""
        return [0 if s is None or s.req.done else s.req.anchor_position for s in streams]

    def _round(self, running: list[_Stream]) -> None:
        slots = self._slots
        starts = self._round_starts(slots)
        sampling = [GREEDY if s is None or s.req.done else self._sampling(s.req) for s in slots]
        self.rounds += 1
        anchors = [0 if s is None or s.req.done else s.req.tokens[-1] for s in slots]
        only = running[0].slot if len(running) == 1 else None  # the one-stream form's slot
        if not any(s.req.speculative or s.req.options.exact for s in running):
            chosen = self.calls.decode(anchors, starts, sampling, only)
            for s in running:
                self._commit_plain(s.req, chosen[s.slot])
            return
        ready = {s.slot: self._ready_drafts(s) for s in running}
        plan = self._plan(running, ready)
        if plan is not None and plan.rows is FALLBACK:
            chosen = self.calls.plain_step(anchors, starts, sampling, only)
            for s in running:
                self._commit_plain(s.req, chosen[s.slot])
                s.draft_ready, s.confidence = False, None
            return
        R = self.block_size if plan is None else plan.rows
        blocks, n_draft = [], []
        for i, s in enumerate(slots):
            drafts = ready.get(i, [])
            if plan is not None:
                drafts = drafts[:plan.depth.get(i, 0)]
            block = [anchors[i]] + [int(t) for t in drafts]
            blocks.append(block + [block[-1]] * (R - len(block)))
            n_draft.append(len(drafts))
        if plan is None:
            (chosen, drafts, rows), confidence = self.calls.verify_draft(blocks, starts, n_draft, sampling, only), None
        else:
            chosen, drafts, rows, confidence = self.calls.verify_rows(R, blocks, starts, n_draft, sampling)
        accept = self.engine.seams.accept
        for s in running:
            req, i, n = s.req, s.slot, n_draft[s.slot]
            if not req.speculative:
                self._commit_plain(req, int(chosen[i, 0]))
                continue
            draft_ids, row = self._verified(blocks[i], n, [int(t) for t in chosen[i, :n + 1]], ready[i])
            kept = accept(draft_ids, row) if draft_ids else accept_length([], row)
            req.next_draft, req.device_rows = [int(t) for t in drafts[i]], int(rows[i])
            redrafts = req.redrafts
            decode.commit(req, draft_ids, row, kept, starts[i])
            s.draft_ready = req.next_draft is not None
            s.confidence = None if confidence is None else [float(x) for x in confidence[i]]
            if not n:  # no drafts: a round of plain verify, not counted in τ
                req.accepted.pop()
                req.redrafts = redrafts
            decode.check_stop_strings(req)

    def _ready_drafts(self, s: _Stream) -> list[int]:
        """The drafts stream s may verify this round (none for a plain stream or one without a draft)."""
        if s.req.speculative and (s.draft_ready or self.engine.seams.proposer is not None):
            return [int(t) for t in self._drafts(s.req)]
        return []

    def _plan(self, running: list[_Stream], ready: dict[int, list[int]]) -> RoundPlan | None:
        """The depth rule's plan for this round; None when the rule is off (every round verifies the
        whole block through `verify_draft`). A stream asking for `exact` keeps the verify graph: a
        plain step becomes a round of anchors alone."""
        if self.depth is None:
            return None
        views = [StreamView(s.slot, len(ready[s.slot]), s.confidence) for s in running]
        plan = self.depth.plan(views, self.rounds)
        if plan.rows is FALLBACK and any(s.req.options.exact for s in running):
            plan = RoundPlan(self.depth.rows[0], {s.slot: 0 for s in running})
        key = "plain" if plan.rows is FALLBACK else plan.rows
        self.round_rows[key] = self.round_rows.get(key, 0) + 1
        return plan

    @staticmethod
    def _verified(block: list[int], n: int, row: list[int], ready: list[int]) -> tuple[list[int], list[int]]:
        """(the drafts verified, the target's tokens after the anchor and each of them): what the
        acceptance rule compares. (tests/test_depth.py plants a variant that trusts drafts past them.)"""
        return block[1:n + 1], row

    def _drafts(self, req: Request) -> list[int]:
        """This round's drafts of a drafted stream: the device's from its last round, or the proposer
        seam's (tests: a scripted drafter that plants wrong tokens)."""
        proposer = self.engine.seams.proposer
        if proposer is None:
            return req.next_draft[:req.n_draft]
        proposed = proposer.propose(list(req.prompt) + req.tokens, None, req.ctx_start)
        return validate.token_ids(proposed, req.vocab_size, "proposer draft")[:req.n_draft]

    @staticmethod
    def _commit_plain(req: Request, token: int) -> None:
        req.tokens.append(token)
        req.done = req.stop.ends(req.tokens)
        decode.check_stop_strings(req)

    # -- events -----------------------------------------------------------------------------

    @staticmethod
    def _reason(req: Request) -> str:
        return "length" if len(req.tokens) >= req.stop.max_new_tokens and req.tokens[-1] not in req.stop.ids \
            and req.stop.cut(req.tokens) is None else "stop"

    def _event(self, s: _Stream, final: bool) -> StreamEvent:
        new = s.req.tokens[s.sent:]
        s.sent = len(s.req.tokens)
        text = s.streamer.push(new, final=final) if s.streamer else ""
        return StreamEvent(s.request_id, new, text, False)

    def _finish(self, s: _Stream, reason: str) -> StreamEvent:
        if not s.req.tokens:  # cancelled before its prefill: no first token, no time to it
            s.req.t_first = time.perf_counter()
        ev = self._event(s, True)
        ev.finished, ev.finish_reason, ev.result = True, reason, s.req.finish()
        del self._ids[s.request_id]
        if s.slot is not None:
            self._slots[s.slot] = None
        else:
            self._queue.remove(s)
        return ev
