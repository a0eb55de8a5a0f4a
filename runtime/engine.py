"""The Engine: compiled target and drafter on an IREE device, plain and DFlash decoding.

Layout: `Engine` (this file) loads the artifacts, checks a request's options against them and runs
its steps; `GenerateOptions` (runtime/options.py) holds what a caller may ask, the defaults in one
place; `Request` (runtime/request.py) is one request's state; runtime/decode.py holds the steps:
prefill, plain steps, one speculative round (draft -> verify -> accept -> commit), the stop check.

What crosses between host and device, per request:
- in: the prompt ids once; per call a few int64 scalars per stream (start, counts, the anchor),
  the block's token ids, and an int8 `pages` vector whose length (not contents) bounds how many
  KV cache rows attention reads;
- out: per round the draft ids [B - 1] and the target's chosen tokens [B] (int64, a few hundred
  bytes); with `draft_top_k`, also the draft's top-K ids (int32) and log-probs (float32), [B - 1, K]
  each with K the compiled count (runtime/module.py states the contract).
Logits and hidden states never leave the device: the taps that verify produces are passed back
to the next `draft` call as device arrays.

Each round runs draft -> verify -> accept -> roll back by length. Acceptance is the pure host
function of dflash_iree/acceptance.py, the same one the eager reference uses, so a scripted
drafter and the planted control run through this compiled path too (`Engine.with_seams`). By
default a round is one call, `verify_draft` (verify, the acceptance count on the device, the next
draft): a small model's step costs calls, not bytes (docs/benchmarks.md). The host still applies its
own rule to the returned tokens and uses the device's next draft only when the device accepted the
same rows; otherwise (normally never: a custom acceptance rule can cause it, and `redrafts` counts
it) it drafts again with a separate call. The KV caches live inside the compiled module; rollback is
the host's committed length, and a new request simply starts writing at position 0 again. Plain
decoding (`speculative=False`, not `exact`) queues each step before the host has the previous token
(CompiledPair.decode_ahead), which stops at most one step late.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Generator

from dflash_iree import validate
from dflash_iree.acceptance import check_fits
from dflash_iree.errors import DFlashError
from dflash_iree.generation import DraftTopK, GenerationResult, draft_seed

from . import decode
from .artifacts import Artifacts, open_device
from .options import GenerateOptions, Seams
from .request import Request, StopRule
from .text import StreamDecoder, TextCodec

__all__ = ["DraftTopK", "Engine", "GenerateOptions", "GenerationResult", "Seams"]


class Engine:
    """A loaded artifact folder with its checkpoints bound, ready to generate.

    Use `Engine.load(...)`; then `generate(...)` or `stream(...)` as often as you like: every
    request starts from position 0, so results do not depend on earlier requests. `seams` (tests
    only, see Seams and `with_seams`) changes how the loop runs, never what a request asks.
    """

    def __init__(self, artifacts: Artifacts, module, codec: TextCodec | None, seams: Seams = Seams()):
        self.artifacts, self.module, self.codec, self.seams = artifacts, module, codec, seams
        self.block_size = artifacts.block_size
        self.max_context = artifacts.max_context
        self.eos_ids = frozenset(artifacts.eos_token_ids)
        # K of the draft_topk entry point (dflash-iree compile --draft-top-k; 0: none, as in
        # manifests written before it existed)
        self.compiled_draft_top_k = int(artifacts.manifest.draft_top_k)
        self.vocab_size = int(artifacts.manifest.target["config"]["vocab_size"])  # request ids are checked against it
        self.streams = int(artifacts.manifest.streams)  # > 1: requests run through runtime/batch.py
        self.text_error = f"{artifacts.target_folder} has no tokenizer.json; pass token ids"  # why text fails (codec None)

    @classmethod
    def load(cls, artifacts: str = "compiled/host", target: str | None = None, drafter: str | None = None,
             device: str | None = None) -> "Engine":
        """Load compiled artifacts and bind checkpoint weights from safetensors (memory-mapped).

        Args:
            artifacts: a folder written by `dflash-iree compile` (manifest.json + .vmfb).
            target, drafter: checkpoint folders; default the ones recorded in the manifest (relative
                to the artifact folder when the checkpoints were moved along with it, else the
                absolute folder; Artifacts.recorded_folder).
            device: an IREE device name ("local-task", "cuda", "cuda://1", "hip"); default the
                arch's own ("local-task" for host, "cuda" for sm_*, "hip" for gfx*).

        Raises:
            DFlashError: a missing or corrupt artifact, a device that cannot run the arch, a
                checkpoint folder that does not exist, or a checkpoint whose keys, shapes or dtypes
                differ from what the module needs.
        """
        arts = Artifacts.load(artifacts)
        dev = open_device(arts, device)
        module = arts.bind(dev, target, drafter, device_name=device)
        text_error = None
        try:
            vocab = int(arts.manifest.target["config"]["vocab_size"])
            codec = TextCodec(arts.checkpoint_folder("target", target), vocab)
        except DFlashError as e:
            codec, text_error = None, str(e)  # token-id prompts still work; the error names the folder bound
        engine = cls(arts, module, codec)
        engine.text_error = text_error or engine.text_error
        return engine

    # -- prompts and stop conditions -------------------------------------------------------

    def encode_prompt(self, prompt, enable_thinking: bool = False) -> list[int]:
        """Token ids of a prompt given as text, as token ids, or as chat messages [{role, content}].

        Raises:
            DFlashError: text or messages without a tokenizer, an empty prompt, or an id outside
                [0, vocab_size) (given, or the tokenizer's).
        """
        prompt = validate.prompt(prompt)
        if isinstance(prompt, str) or (len(prompt) and isinstance(prompt[0], dict)):
            if self.codec is None:
                raise DFlashError(self.text_error)
            text = prompt if isinstance(prompt, str) else self.codec.render_chat(list(prompt),
                                                                                 enable_thinking=enable_thinking)
            # the load already checked the tokenizer's ids; this keeps a codec swapped in later honest too
            return validate.token_ids(self.codec.encode(text), self.vocab_size,
                                      f"the prompt as {self.codec.folder}/tokenizer.json encodes it:")
        ids = validate.token_ids(prompt, self.vocab_size)
        if not ids:
            raise DFlashError("the prompt is empty; give at least one token")
        return ids

    def _check_draft_top_k(self, k, speculative: bool, proposer) -> int:
        """The requested draft_top_k as an int, refused when these artifacts cannot give it."""
        K = self.compiled_draft_top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise DFlashError(f"draft_top_k {k!r} is out of range: use 0 (off) or 1..{K}")
        k = int(k)
        if k == 0:
            return 0
        if K == 0:
            raise DFlashError(f"draft_top_k {k}: {self.artifacts.folder} has no draft_topk entry point (manifest "
                              f"draft_top_k is 0); recompile with dflash-iree compile --draft-top-k {k} (or more, up to 64)")
        if k > K:
            raise DFlashError(f"draft_top_k {k} is more than the {K} that {self.artifacts.folder} was compiled for "
                              f"(manifest draft_top_k); ask for 1..{K}, or recompile with dflash-iree compile "
                              f"--draft-top-k {k}")
        if not speculative:
            raise DFlashError("draft_top_k needs drafted decoding: with speculative=False (--no-draft) or exact=True "
                              "(--exact) nothing is drafted")
        if proposer is not None:
            raise DFlashError("draft_top_k comes from the compiled drafter; it cannot be used with a proposer")
        return k

    def _stop_rule(self, stop, max_new_tokens: int) -> StopRule:
        """The eos ids, `stop`'s ids and strings (one, or a list), and the budget."""
        items = validate.stop_items(stop)
        strings = tuple(validate.text(s, "stop string") for s in items if isinstance(s, str))
        if strings and self.codec is None:
            raise DFlashError("stop strings need the target's tokenizer.json; pass stop token ids instead")
        return StopRule(self.eos_ids | validate.all_ids(items, self.vocab_size, "stop"), strings, max_new_tokens,
                        self.codec)

    def with_seams(self, **seams) -> "Engine":
        """This Engine (the same module, artifacts and tokenizer) with some Seams replaced, for tests:
        `engine.with_seams(accept=broken_accept).generate(...)`. The Engine itself is unchanged.

        Raises:
            TypeError: a keyword that is not a Seams field.
        """
        twin = copy.copy(self)
        twin.seams = dataclasses.replace(self.seams, **seams)
        return twin

    # -- decoding ---------------------------------------------------------------------------

    def generate(self, prompt, max_new_tokens: int | None = None, *, options: GenerateOptions | None = None,
                 **kw) -> GenerationResult:
        """Generate a completion, plain or with DFlash drafting; both give the same tokens.

        Args:
            prompt: text, token ids, or chat messages (rendered with the chat template).
            max_new_tokens: budget of new tokens (None: the option's, default 128).
            options: a GenerateOptions (default: all defaults); keywords replace its fields:
                temperature, top_k, top_p, seed, speculative, num_speculative_tokens, stop,
                draft_top_k, exact, enable_thinking (GenerateOptions documents each).

        Raises:
            DFlashError: bad sampling values, num_speculative_tokens or draft_top_k out of range
                (draft_top_k above the compiled K, or artifacts compiled without it), draft_top_k
                without drafting, or a request that does not fit max_context.
            TypeError: a keyword that is no option.
        """
        o = _options(max_new_tokens, options, kw)
        run = self._decode_streams(prompt, o) if self.streams > 1 else self._decode(self._request(prompt, o), None)
        while True:
            try:
                next(run)
            except StopIteration as end:
                return end.value

    def stream(self, prompt, max_new_tokens: int | None = None, *, options: GenerateOptions | None = None,
               **kw) -> Generator[str, None, GenerationResult]:
        """Yield text pieces as tokens are committed (same arguments as `generate`; nothing without
        a tokenizer). The generator's return value is the GenerationResult (`StopIteration.value`,
        or `result = yield from engine.stream(...)`); its times include the consumer's between pieces."""
        o = _options(max_new_tokens, options, kw)
        if self.streams > 1:
            return (yield from self._decode_streams(prompt, o))
        req = self._request(prompt, o)
        return (yield from self._decode(req, StreamDecoder(self.codec) if self.codec else None))

    def _decode_streams(self, prompt, o: GenerateOptions) -> Generator[str, None, GenerationResult]:
        """One request on a module of several streams: through the batch engine, alone (the
        one-stream calls of runtime/module.py would not fit its [S, ...] arguments)."""
        from .batch import BatchEngine

        self._check_draft_top_k(o.draft_top_k, o.drafted, self.seams.proposer)
        batch = BatchEngine(self)
        batch.add("generate", self.encode_prompt(prompt, o.enable_thinking), o)
        while True:
            for ev in batch.step():
                if ev.text:
                    yield ev.text
                if ev.finished:
                    return ev.result

    def _request(self, prompt, o: GenerateOptions) -> Request:
        """A new Request for `prompt` with options `o`, checked against these artifacts; sets the
        module's sampling for it (stream 0)."""
        top_k = self._check_draft_top_k(o.draft_top_k, o.drafted, self.seams.proposer)
        ids = self.encode_prompt(prompt, o.enable_thinking)
        B = self.block_size
        n = B - 1 if o.num_speculative_tokens is None or not o.drafted else \
            validate.num_speculative_tokens(o.num_speculative_tokens, B)
        check_fits(len(ids), o.max_new_tokens, B, self.max_context)
        stop = self._stop_rule(o.stop, o.max_new_tokens)
        m, s = self.module, self.seams
        # a top_k above the vocabulary keeps every token, as 0 does; clamped so that no int64 overflows
        draft_seed(o.seed, s.draft_noise)  # refuses an unknown draft_noise before any call
        # before has_verify_draft: it is per sampling mode
        m.set_sampling(o.temperature, min(o.top_k, self.vocab_size), o.top_p, o.seed, s.draft_noise)
        fused = (o.drafted and s.fused_round and s.proposer is None and not top_k and m.has_verify_draft()
                 and (s.draft_noise == "coupled" or o.temperature == 0))
        # exact plain steps go through the graph that a drafted request with the same fused_round
        # verifies with, so that the two agree bit for bit
        fused_exact = o.exact and s.fused_round and m.has_verify_draft()
        return Request(ids, o, stop, n, top_k, fused, fused_exact, vocab_size=self.vocab_size)

    def _decode(self, req: Request, streamer: StreamDecoder | None) -> Generator[str, None, GenerationResult]:
        """Prefill, then plain steps or speculative rounds until the request is done; yields the new
        text after each (with a streamer) and returns the result."""
        m = self.module
        decode.prefill(m, req, self.seams)
        decode.check_stop_strings(req)
        if streamer:  # the first token's text, also when the request ends with it
            streamer.stops = tuple(x for x in req.stop.strings if x)
            yield streamer.push(req.tokens[len(streamer.ids):], final=req.done)
        ahead = decode.plain_ahead(m, req)
        try:
            while not req.done:
                if req.speculative:
                    decode.speculative_round(m, req, self.seams)
                else:
                    decode.plain_step(m, req, ahead)
                decode.check_stop_strings(req)
                if streamer:
                    yield streamer.push(req.tokens[len(streamer.ids):], final=req.done)
        finally:
            if ahead is not None:
                ahead.close()  # waits for the step queued past the last token taken
        return req.finish()


def _options(max_new_tokens: int | None, options: GenerateOptions | None, kw: dict) -> GenerateOptions:
    if max_new_tokens is not None:
        kw = {**kw, "max_new_tokens": max_new_tokens}
    return GenerateOptions.of(options, **kw)
