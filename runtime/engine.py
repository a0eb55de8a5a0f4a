"""The Engine: compiled target and drafter on an IREE device, plain and DFlash decoding.

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
drafter and the planted control run through this compiled path too. By default a round is one
call, `verify_draft` (verify, the acceptance count on the device, the next draft): a small model's
step costs calls, not bytes (docs/benchmarks.md). The host still applies its own rule to the
returned tokens and uses the device's next draft only when the device accepted the same rows;
otherwise (normally never: a custom `accept` can cause it, and `redrafts` counts it) it drafts
again with a separate call. The KV caches live inside
the compiled module; rollback is the host's committed length, and a new request simply starts
writing at position 0 again. Plain decoding (`speculative=False`, not `exact`) queues each step before
the host has the previous token (CompiledPair.decode_ahead), which stops at most one step late.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from dflash_iree.acceptance import RoundStats, accept_length, check_fits, commit_round
from dflash_iree.errors import DFlashError

from .artifacts import Artifacts, open_device
from .text import StreamDecoder, TextCodec, find_stop


class DraftTopK(NamedTuple):
    """The drafter's top-k at the drafted positions of one round (`generate(..., draft_top_k=k)`).

    ids: one list of k token ids per draft token of the round (row i: block position i + 1, the
        position of draft token i), best first: descending drafter logit, equal logits by lower id,
        so ids[i][0] is draft token i. `accepted` of the same round says how many rows were kept.
    logprobs: the matching log-probabilities, log_softmax(drafter logits / T) at those ids, with T
        the request's temperature when it samples (> 0) and 1 when it is greedy (the drafter's own
        distribution). top_k / top_p are not applied.
    """

    ids: list[list[int]]
    logprobs: list[list[float]]

    def to_dict(self) -> dict:
        return {"ids": self.ids, "logprobs": self.logprobs}


@dataclass
class GenerationResult(RoundStats):
    """What `Engine.generate` returns.

    tokens: new token ids (a stop token that ended generation is included).
    text: their text, cut before a stop string when one ended generation (None without a tokenizer).
    accepted: per round, draft tokens kept (0..block_size-1); empty for plain decoding.
    block_size: verify block size of the request (num_speculative_tokens + 1; 1 for plain).
    ttft_ms: time to first token in ms (prefill and its token to the host).
    decode_s: seconds from the first token to the last.
    draft_top_k: with draft_top_k = k > 0, a DraftTopK per round (the same rounds as `accepted`):
        ids and log-probs [n_drafted][k], n_drafted = num_speculative_tokens; empty otherwise.
    redrafts: rounds of `verify_draft` whose device draft was dropped because the host committed
        a different number of rows than the device accepted (0 with the built-in rule).
    """

    tokens: list[int]
    text: str | None
    accepted: list[int] = field(default_factory=list)
    block_size: int = 1
    ttft_ms: float = 0.0
    decode_s: float = 0.0
    draft_top_k: list[DraftTopK] = field(default_factory=list)
    redrafts: int = 0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token."""
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0

    def stats(self) -> dict:
        return {"accepted": self.accepted, "tau": self.tau, "tau_mean": self.tau_mean, "histogram": self.histogram,
                "block_size": self.block_size, "ttft_ms": self.ttft_ms, "decode_tok_s": self.decode_tok_s,
                "new_tokens": len(self.tokens), "redrafts": self.redrafts}


class Engine:
    """A loaded artifact folder with its checkpoints bound, ready to generate.

    Use `Engine.load(...)`; then `generate(...)` or `stream(...)` as often as you like: every
    request starts from position 0, so results do not depend on earlier requests.
    """

    def __init__(self, artifacts: Artifacts, module, codec: TextCodec | None):
        self.artifacts, self.module, self.codec = artifacts, module, codec
        self.block_size = artifacts.block_size
        self.max_context = artifacts.max_context
        self.eos_ids = frozenset(artifacts.eos_token_ids)
        # K of the draft_topk entry point (dflash-iree compile --draft-top-k; 0: none, as in
        # manifests written before it existed)
        self.compiled_draft_top_k = int(artifacts.manifest.draft_top_k)

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
        module = arts.bind(dev, target, drafter)
        try:
            codec = TextCodec(arts.checkpoint_folder("target", target))
        except DFlashError:
            codec = None  # token-id prompts still work
        return cls(arts, module, codec)

    # -- prompts and stop conditions -------------------------------------------------------

    def encode_prompt(self, prompt, enable_thinking: bool = False) -> list[int]:
        """Token ids of a prompt given as text, as token ids, or as chat messages [{role, content}].

        Raises:
            DFlashError: text or messages without a tokenizer, or an empty prompt.
        """
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            if self.codec is None:
                raise DFlashError(f"{self.artifacts.target_folder} has no tokenizer.json; pass token ids instead of text")
            if isinstance(prompt, str):
                return self.codec.encode(prompt)
            return self.codec.encode(self.codec.render_chat(list(prompt), enable_thinking=enable_thinking))
        ids = [int(t) for t in prompt]
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
            raise DFlashError("draft_top_k needs drafted decoding: with speculative=False (--no-draft) nothing is drafted")
        if proposer is not None:
            raise DFlashError("draft_top_k comes from the compiled drafter; it cannot be used with a proposer")
        return k

    def _split_stops(self, stop) -> tuple[frozenset[int], list[str]]:
        items = [stop] if isinstance(stop, (str, int)) else list(stop or [])
        strings = [s for s in items if isinstance(s, str)]
        if strings and self.codec is None:
            raise DFlashError("stop strings need the target's tokenizer.json; pass stop token ids instead")
        return self.eos_ids | {int(s) for s in items if not isinstance(s, str)}, strings

    # -- decoding ---------------------------------------------------------------------------

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, speculative: bool = True, num_speculative_tokens: int | None = None,
                 stop=None, draft_top_k: int = 0, exact: bool = False, enable_thinking: bool = False,
                 accept: Callable[[Sequence[int], Sequence[int]], int] = accept_length, proposer=None,
                 fused_round: bool = True) -> GenerationResult:
        """Generate a completion, plain or with DFlash drafting; both give the same tokens.

        Args:
            prompt: text, token ids, or chat messages (rendered with the chat template).
            max_new_tokens: budget of new tokens.
            temperature, top_k, top_p, seed: 0 temperature is greedy; otherwise a sample keyed by
                (seed, position), identical in plain and drafted decoding.
            speculative: False for plain decoding.
            num_speculative_tokens: draft tokens verified per round, 1..block_size-1 (default all).
            stop: stop strings and/or token ids (eos ids always stop).
            draft_top_k: k > 0 also returns, per round, the drafter's k best ids and their
                log-probs at every drafted position, from the compiled top-K dispatch
                (`GenerationResult.draft_top_k`, see DraftTopK); 1..K of the artifacts
                (`dflash-iree compile --draft-top-k K`, manifest `draft_top_k`). Drafting itself
                is unchanged (the same draft ids, hence the same tokens).
            exact: plain decoding through the verify graph (`verify_draft`'s when fused_round and
                the artifacts have it, else `verify`'s), so that drafted == plain holds bit for bit
                even in bf16 on a GPU.
            enable_thinking: passed to the chat template (off: drafters are trained without it).
            accept: the acceptance rule (tests pass a broken one as a planted control).
            proposer: a stand-in drafter with the eager reference's Proposer interface
                (`begin(taps)`, `propose(tokens, new_taps, ctx_start) -> ids`; taps come as None),
                for the scripted-drafter tests.
            fused_round: run each round as one `verify_draft` call when the artifacts have it
                (not with a proposer or draft_top_k); False: a `draft` call and a `verify` call.
                The tokens are the same either way.

        Raises:
            DFlashError: bad sampling values, num_speculative_tokens or draft_top_k out of range
                (draft_top_k above the compiled K, or artifacts compiled without it), draft_top_k
                without drafting, or a request that does not fit max_context.
        """
        pieces = list(self._run(prompt, max_new_tokens, temperature, top_k, top_p, seed, speculative,
                                num_speculative_tokens, stop, draft_top_k, exact, enable_thinking, accept, proposer,
                                fused_round, stream=False))
        return pieces[-1]

    def stream(self, prompt, **kwargs) -> Generator[str, None, GenerationResult]:
        """Yield text pieces as tokens are committed (same arguments as `generate`; nothing without
        a tokenizer). The generator's return value is the GenerationResult (`StopIteration.value`,
        or `result = yield from engine.stream(...)`); its times include the consumer's between pieces."""
        for piece in self._run(prompt, stream=True, **{**_GEN_DEFAULTS, **kwargs}):
            if not isinstance(piece, str):
                return piece
            yield piece

    def _run(self, prompt, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, seed=0, speculative=True,
             num_speculative_tokens=None, stop=None, draft_top_k=0, exact=False, enable_thinking=False,
             accept=accept_length, proposer=None, fused_round=True, stream=False):
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise DFlashError(f"sampling out of range: temperature {temperature} (>= 0), top_k {top_k} (>= 0), top_p {top_p} (in (0, 1])")
        top_k_draft = self._check_draft_top_k(draft_top_k, speculative, proposer)
        ids = self.encode_prompt(prompt, enable_thinking)
        B = self.block_size
        n = B - 1 if num_speculative_tokens is None else int(num_speculative_tokens)
        if speculative and not 1 <= n <= B - 1:
            raise DFlashError(f"num_speculative_tokens {n} is out of range: use 1..{B - 1} (block_size - 1 of these artifacts)")
        check_fits(len(ids), max_new_tokens, B, self.max_context)
        stop_ids, stop_strings = self._split_stops(stop)
        m = self.module
        m.set_sampling(temperature, top_k, top_p, seed)
        streamer = StreamDecoder(self.codec) if stream and self.codec else None

        t0 = time.perf_counter()
        first, prompt_taps = m.prefill(ids)
        out, accepted, draft_top = [first], [], []
        lp_temperature = temperature if temperature > 0 else 1.0  # of the draft top-K's log-probs
        t1 = time.perf_counter()
        done = first in stop_ids or max_new_tokens == 1
        fused = speculative and fused_round and proposer is None and not top_k_draft and m.has_verify_draft()
        # exact plain steps go through the graph that a drafted request with the same fused_round
        # verifies with, so that the two agree bit for bit
        fused_exact = exact and fused_round and m.has_verify_draft()
        redrafts, next_draft = 0, None  # next_draft: the device's draft after out[-1], from verify_draft
        if speculative:
            m.absorb(prompt_taps)
            if proposer is not None:
                proposer.begin(None)
            taps, ctx_start, n_valid = None, len(ids), 0
        # plain decoding queues each step before the host has the previous token (module.py)
        plain = None if speculative or exact else m.decode_ahead(first, len(ids), max_new_tokens - 1)
        try:
            while not done:
                start = len(ids) + len(out) - 1  # the anchor's position
                if not speculative:
                    token = m.step_exact(out[-1], start, fused_exact) if exact else next(plain)
                    out.append(token)
                    done = token in stop_ids or len(out) >= max_new_tokens
                else:
                    if proposer is not None:
                        draft = [int(d) for d in proposer.propose(list(ids) + out, None, ctx_start)][:n]
                    elif top_k_draft:
                        draft, top_ids, top_lps = m.draft_topk(taps, ctx_start, n_valid, out[-1], start, lp_temperature)
                        draft = draft[:n]
                        draft_top.append(DraftTopK(top_ids[:n, :top_k_draft].tolist(), top_lps[:n, :top_k_draft].tolist()))
                    elif next_draft is not None:
                        draft = next_draft[:n]
                    else:
                        draft = m.draft(taps, ctx_start, n_valid, out[-1], start)[:n]
                    if fused:
                        chosen, next_draft, device_rows, taps = m.verify_draft([out[-1]] + draft, start)
                    else:
                        chosen, taps = m.verify([out[-1]] + draft, start)
                    r = commit_round(draft, chosen, accept(draft, chosen), stop_ids, max_new_tokens - len(out))
                    out += r.tokens
                    accepted.append(r.accepted)
                    ctx_start, n_valid = start, len(r.tokens)
                    done = r.done
                    if fused and device_rows != n_valid:
                        # the device drafted after other rows than the host kept: draft again
                        next_draft = None
                        redrafts += not done
                if stop_strings:
                    cut = self._stop_string_cut(out, stop_strings)
                    if cut is not None:
                        out, done = out[:cut], True
                if streamer:
                    yield streamer.push(out[len(streamer.ids):])
        finally:
            if plain is not None:
                plain.close()  # waits for the step queued past the last token taken
        t2 = time.perf_counter()
        text = self.codec.decode(out) if self.codec else None
        if text is not None and stop_strings:
            at = find_stop(text, stop_strings)
            text = text if at is None else text[:at]
        yield GenerationResult(out, text, accepted, (n + 1) if speculative else 1, (t1 - t0) * 1e3, t2 - t1, draft_top,
                               redrafts)

    def _stop_string_cut(self, out: list[int], stops: list[str]) -> int | None:
        """Length of the shortest prefix of `out` whose text contains a stop string, or None."""
        if find_stop(self.codec.decode(out), stops) is None:
            return None
        for i in range(1, len(out) + 1):
            if find_stop(self.codec.decode(out[:i]), stops) is not None:
                return i
        return None


_GEN_DEFAULTS = dict(max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, seed=0, speculative=True,
                     num_speculative_tokens=None, stop=None, draft_top_k=0, exact=False, enable_thinking=False,
                     fused_round=True)
