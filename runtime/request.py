"""One request's state while the Engine decodes it (Request) and when it ends (StopRule).

Everything that differs from request to request lives here, not in the Engine: the prompt ids, the
committed tokens, the positions, the options, how its rounds run, the drafter's context, the
per-round stats and the timings. The decoding steps (runtime/decode.py) take the Request they
advance, so that an Engine serving several streams per round can hold one per stream; today the
runtime serves stream 0, one request at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dflash_iree.generation import DraftTopK, GenerationResult

from .options import GenerateOptions
from .text import TextCodec, find_stop


@dataclass(frozen=True)
class StopRule:
    """When a request ends: a token in `ids` (kept), text containing one of `strings`, or
    `max_new_tokens` new tokens.

    ids: eos ids and the caller's stop token ids.
    strings: the caller's stop strings (need `codec`).
    max_new_tokens: the budget of new tokens.
    codec: the target's tokenizer, None without one (then `strings` is empty).
    """

    ids: frozenset[int]
    strings: tuple[str, ...]
    max_new_tokens: int
    codec: TextCodec | None

    def budget(self, tokens: list[int]) -> int:
        """How many more tokens may be committed after `tokens` (the new tokens so far)."""
        return self.max_new_tokens - len(tokens)

    def ends(self, tokens: list[int]) -> bool:
        """Whether a request ends after committing `tokens`' last one: a stop id or the budget."""
        return tokens[-1] in self.ids or len(tokens) >= self.max_new_tokens

    def cut(self, tokens: list[int]) -> int | None:
        """Length of the shortest prefix of `tokens` whose text contains a stop string, or None."""
        if not self.strings or find_stop(self.codec.decode(tokens), self.strings) is None:
            return None
        for i in range(1, len(tokens) + 1):
            if find_stop(self.codec.decode(tokens[:i]), self.strings) is not None:
                return i
        return None

    def text(self, tokens: list[int]) -> str | None:
        """The text of `tokens`, cut before a stop string; None without a tokenizer."""
        if self.codec is None:
            return None
        text = self.codec.decode(tokens)
        at = find_stop(text, self.strings) if self.strings else None
        return text if at is None else text[:at]


@dataclass
class Request:
    """One request being decoded; the decoding steps advance it until `done`.

    prompt: the prompt ids (int), at positions 0..len(prompt)-1.
    options: what was asked (sampling, speculative, exact, ...), validated.
    stop: when it ends.
    n_draft: draft tokens verified per round (num_speculative_tokens, 1..block_size-1).
    draft_top_k: k of the per-round draft top-K rows kept (0: none).
    fused_round: rounds run as one `verify_draft` call (else a `draft` and a `verify` call).
    fused_exact: `exact` plain steps run through `verify_draft` (else through `verify`).
    stream: the module's stream slot that holds this request's KV caches (0: the one served).
    vocab_size: the target's vocabulary; every token id the request holds is below it.

    State as decoding goes:
    tokens: the new tokens committed so far; tokens[-1] is the anchor of the next step.
    done: a stop token, a stop string or the budget ended it.
    taps, ctx_start, n_valid: the drafter's pending context, the taps device array of the last
        verify (None before the first round) whose first n_valid rows are at positions
        ctx_start.. (absorbed by the next `draft`).
    next_draft, device_rows: from `verify_draft`, the device's next draft [B - 1] ids (None: draft
        with a separate call) and the rows it accepted.
    accepted, draft_top, redrafts: the per-round stats (GenerationResult's).
    t_start, t_first, t_end: time.perf_counter() seconds at prefill, first token, last token.
    """

    prompt: list[int]
    options: GenerateOptions
    stop: StopRule
    n_draft: int
    draft_top_k: int = 0
    fused_round: bool = False
    fused_exact: bool = False
    stream: int = 0
    vocab_size: int = 0
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    taps: object = None
    ctx_start: int = 0
    n_valid: int = 0
    next_draft: list[int] | None = None
    device_rows: int = 0
    accepted: list[int] = field(default_factory=list)
    draft_top: list[DraftTopK] = field(default_factory=list)
    redrafts: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0

    @property
    def speculative(self) -> bool:
        """The request drafts (GenerateOptions.drafted: `exact` is plain decoding)."""
        return self.options.drafted

    @property
    def block_size(self) -> int:
        """The verify block of a round: n_draft + 1 (1 for plain decoding)."""
        return self.n_draft + 1 if self.speculative else 1

    @property
    def anchor_position(self) -> int:
        """Absolute position of tokens[-1], where the next step or round starts."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def logprob_temperature(self) -> float:
        """T of the draft top-K's log-probs: the request's temperature when it samples, else 1."""
        return self.options.temperature if self.options.temperature > 0 else 1.0

    def finish(self) -> GenerationResult:
        """Stamp the end time and return the result (text cut before a stop string)."""
        self.t_end = time.perf_counter()
        return GenerationResult(self.tokens, self.stop.text(self.tokens), self.accepted, self.block_size,
                                (self.t_first - self.t_start) * 1e3, self.t_end - self.t_first, self.draft_top,
                                self.redrafts)
