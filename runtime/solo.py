"""The engine protocol the server drives (StreamEvent, add / cancel / step), over today's one-stream
`Engine`: `SoloEngine` serves one request at a time, one prefill or round per `step()`.

The protocol (shared with the multi-stream `BatchEngine` of runtime/batch.py, which the server uses
instead where the artifacts have several streams; StreamEvent is defined there):
- `capacity`: streams served at once; `active`: requests admitted and not finished;
- `encode_prompt(prompt, enable_thinking)`: as `Engine.encode_prompt`;
- `add(request_id, prompt_ids, options)`: validates now (DFlashError with one line), joins at the
  next step; DFlashError when `capacity` requests are active;
- `cancel(request_id)`: the next step frees its slot and yields its finished "cancelled" event;
- `step()`: one round for every active stream (a joiner's prefill counts as its round); returns a
  StreamEvent for each request with news.
It is used from one thread (the server's worker) and is not thread-safe.
"""

from __future__ import annotations


from dflash_iree.errors import DFlashError
from dflash_iree.generation import GenerationResult

from . import decode
from .batch import StreamEvent
from .options import GenerateOptions
from .text import StreamDecoder

FINISH_REASONS = ("stop", "length", "cancelled")


class _Slot:
    """One admitted request: its Request state, streamed text, how many tokens were reported, the
    plain-decoding queue (decode_ahead) once prefilled."""

    def __init__(self, request_id: str, req, streamer: StreamDecoder | None):
        self.id, self.req, self.streamer = request_id, req, streamer
        self.reported, self.prefilled, self.ahead, self.cancelled = 0, False, None, False


class SoloEngine:
    """The engine protocol over one `Engine`: capacity 1, one prefill or one round per step.

    Args:
        engine: a loaded runtime.engine.Engine (its stream 0 is the one slot).

    The request's tokens are those of `engine.generate(prompt_ids, options=options)` (the same
    runtime/decode.py steps in the same order).
    """

    capacity = 1

    def __init__(self, engine):
        self.engine = engine
        self.block_size, self.max_context = engine.block_size, engine.max_context
        self._slot: _Slot | None = None

    @property
    def active(self) -> int:
        """Requests admitted and not yet finished (0 or 1)."""
        return int(self._slot is not None)

    def encode_prompt(self, prompt, enable_thinking: bool = False) -> list[int]:
        """Token ids of text, ids or chat messages (Engine.encode_prompt; raises DFlashError)."""
        return self.engine.encode_prompt(prompt, enable_thinking)

    def add(self, request_id: str, prompt_ids: list[int], options: GenerateOptions) -> None:
        """Admit a request; its prefill runs at the next `step()`.

        Raises:
            DFlashError: the slot is taken (capacity 1), or the request does not fit these artifacts
                (prompt + max_new_tokens + block over max_context, an id outside the vocabulary, a
                stop string without a tokenizer, num_speculative_tokens out of range, ...).
        """
        if self._slot is not None:
            raise DFlashError(f"the engine is full: {self.capacity} of {self.capacity} streams are busy; "
                              "add the request after one finishes")
        e = self.engine
        req = e._request(list(prompt_ids), options)  # checks against the artifacts; sets stream 0's sampling
        streamer = StreamDecoder(e.codec, tuple(s for s in req.stop.strings if s)) if e.codec else None
        self._slot = _Slot(request_id, req, streamer)

    def cancel(self, request_id: str) -> None:
        """Mark a request cancelled; the next step frees its slot. An unknown id is ignored (it
        finished already)."""
        if self._slot is not None and self._slot.id == request_id:
            self._slot.cancelled = True

    def step(self) -> list[StreamEvent]:
        """Prefill the joiner, or run one round (one plain step) of the active request.

        Returns:
            [] when idle, else the one request's StreamEvent (possibly with no tokens, when a stop
            string may be starting and its text is held back).
        """
        s = self._slot
        if s is None:
            return []
        m, seams, req = self.engine.module, self.engine.seams, s.req
        if s.cancelled:
            return [self._finish(s, "cancelled")]
        if not s.prefilled:
            decode.prefill(m, req, seams)
            s.prefilled = True
            s.ahead = decode.plain_ahead(m, req)
        elif req.speculative:
            decode.speculative_round(m, req, seams)
        else:
            decode.plain_step(m, req, s.ahead)
        decode.check_stop_strings(req)
        if req.done:
            # a stop string may complete on the budget's last token: ask the text, not the count
            stopped = req.tokens[-1] in req.stop.ids or req.stop.cut(req.tokens) is not None
            return [self._finish(s, "stop" if stopped else "length")]
        return [self._event(s)]

    def _event(self, s: _Slot, final: bool = False) -> StreamEvent:
        new = s.req.tokens[s.reported:]
        s.reported = len(s.req.tokens)
        text = s.streamer.push(new, final=final) if s.streamer else ""
        return StreamEvent(s.id, list(new), text, False)

    def _finish(self, s: _Slot, reason: str) -> StreamEvent:
        """Free the slot; the finished event with the result (a cancelled request's tokens so far)."""
        self._slot = None
        if s.ahead is not None:
            s.ahead.close()  # waits for the step queued past the last token taken
        if not s.prefilled:
            result = GenerationResult([], "" if s.streamer else None, block_size=s.req.block_size)
            return StreamEvent(s.id, [], "", True, reason, result)
        ev = self._event(s, final=reason != "cancelled")
        ev.finished, ev.finish_reason, ev.result = True, reason, s.req.finish()
        return ev
