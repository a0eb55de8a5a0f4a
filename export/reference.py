"""Eager reference decoding: plain (one token per step) and DFlash (draft, verify, accept).

This is what every compiled path is checked against, token for token. Both decoders take the
target's token at each absolute position from `choose_tokens` (argmax, or a sample keyed by
(seed, position)), so drafted output equals plain output by construction of the acceptance rule
(dflash_iree/acceptance.py), for greedy and for seeded sampling alike. A sampled request drafts
with the target's own keyed noise (coupled drafting, export/sampling.py `draft_tokens`), as the
compiled drafter does; `draft_noise` picks the benchmark's other arms (a greedy draft, or noise of
another seed), which keep the tokens and lose acceptance.

The drafter is reached through a small proposer interface, so a scripted drafter (tests) can
stand in for the DFlash module, and the acceptance rule is a parameter, so a deliberately broken
rule (the planted control) runs through the same loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dflash_iree import validate
from dflash_iree.acceptance import accept_length, check_fits, commit_round
from dflash_iree.errors import DFlashError
from dflash_iree.generation import GenerationResult, draft_seed
from dflash_iree.runtime.options import GenerateOptions

from .dflash import DFlashDrafter
from .qwen3 import Qwen3
from .sampling import Sampling


@dataclass(frozen=True)
class SamplingConfig:
    """User sampling settings: temperature 0 is greedy; top_k 0 and top_p 1.0 disable the cuts.

    The defaults are GenerateOptions' and the checks the runtime's (dflash_iree/validate.py
    `sampling`, the same messages), so that the reference refuses what the engine refuses.

    Raises (on construction):
        DFlashError: a setting out of range or of the wrong type.
    """

    temperature: float = GenerateOptions.temperature
    top_k: int = GenerateOptions.top_k
    top_p: float = GenerateOptions.top_p
    seed: int = GenerateOptions.seed

    def __post_init__(self):
        checked = validate.sampling(self.temperature, self.top_k, self.top_p, self.seed, None)
        for name, value in zip(("temperature", "top_k", "top_p", "seed"), checked):
            object.__setattr__(self, name, value)  # frozen: the checked, normalised value

    def tensors(self) -> Sampling | None:
        """Per-stream tensors for one stream, or None when greedy."""
        if self.temperature == 0:
            return None
        return Sampling(
            torch.tensor([self.temperature], dtype=torch.float32),
            torch.tensor([self.top_k], dtype=torch.int64),
            torch.tensor([self.top_p], dtype=torch.float32),
            torch.tensor([self.seed], dtype=torch.int64),
        )


class Proposer(Protocol):
    """Anything that drafts a block: the DFlash drafter, or a scripted one in tests."""

    def begin(self, prompt_taps: torch.Tensor) -> None:
        """Take the prompt's taps [1, P, n_taps * hidden] (rows at positions 0..P-1)."""

    def propose(self, tokens: list[int], new_taps: torch.Tensor, ctx_start: int) -> list[int]:
        """Draft block_size - 1 ids after the anchor tokens[-1].

        tokens: every committed id (prompt and generated; the last is the anchor at position
        len(tokens) - 1). new_taps: [1, R, n_taps * hidden], the rows committed last round at
        positions [ctx_start, ctx_start + R), with ctx_start + R == len(tokens) - 1.
        """


def draft_sampling(sampling: Sampling | None, draft_noise: str = "coupled") -> Sampling | None:
    """The sampling a drafter drafts with: the request's own ("coupled"), none ("greedy"), or the
    request's with another seed ("other", a benchmark control: independent noise).

    Raises:
        DFlashError: a draft_noise not in DRAFT_NOISES.
    """
    seed = draft_seed(0 if sampling is None else sampling.seed, draft_noise)
    if sampling is None or seed is None:
        return None
    return sampling._replace(seed=seed)


class DrafterProposer:
    """The DFlash module as a Proposer.

    sampling: what the drafter drafts with (`draft_sampling`); None drafts greedily. `last_logits`
    keeps the last round's drafter logits, float32 [B - 1, V] (benchmarks read them).
    """

    def __init__(self, target: Qwen3, drafter: DFlashDrafter, sampling: Sampling | None = None):
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.last_logits = None

    def begin(self, prompt_taps: torch.Tensor) -> None:
        self.drafter.absorb(prompt_taps, torch.zeros(1, dtype=torch.int64))

    def propose(self, tokens: list[int], new_taps: torch.Tensor, ctx_start: int) -> list[int]:
        R = new_taps.shape[1]
        start = ctx_start + R
        draft, logits = self.drafter(
            self.target, new_taps, torch.tensor([ctx_start]), torch.tensor([R]), torch.tensor([tokens[-1]]),
            read_len=start + self.drafter.block_size, sampling=self.sampling,
        )
        self.last_logits = logits[0]
        return draft[0].tolist()


def _step(target: Qwen3, tokens: Sequence[int], start: int, sampling: Sampling | None):
    t = torch.tensor([list(tokens)], dtype=torch.int64)
    return target(t, torch.tensor([start]), sampling, read_len=start + len(tokens))


def _stop_set(target: Qwen3, stop_ids: Sequence[int]) -> frozenset[int]:
    return frozenset(target.cfg.eos_token_ids) | frozenset(int(s) for s in stop_ids)


@torch.no_grad()
def generate_plain(target: Qwen3, prompt: Sequence[int], max_new_tokens: int,
                   sampling: SamplingConfig = SamplingConfig(), stop_ids: Sequence[int] = ()) -> GenerationResult:
    """Plain decoding: prefill, then one target step per token.

    Stops after a token in eos_token_ids or stop_ids (kept), or after max_new_tokens.

    Raises:
        DFlashError: empty prompt, or prompt + max_new_tokens + 1 > max_context.
    """
    check_fits(len(prompt), max_new_tokens, 1, target.max_context)
    stops, s = _stop_set(target, stop_ids), sampling.tensors()
    t0 = time.perf_counter()
    chosen, _, _ = _step(target, prompt, 0, s)
    out = [int(chosen[0, -1])]
    t1 = time.perf_counter()
    while len(out) < max_new_tokens and out[-1] not in stops:
        chosen, _, _ = _step(target, [out[-1]], len(prompt) + len(out) - 1, s)
        out.append(int(chosen[0, -1]))
    return GenerationResult(out, ttft_ms=(t1 - t0) * 1e3, decode_s=time.perf_counter() - t1)


@torch.no_grad()
def generate_dflash(target: Qwen3, proposer: Proposer | DFlashDrafter, prompt: Sequence[int], max_new_tokens: int,
                    sampling: SamplingConfig = SamplingConfig(), stop_ids: Sequence[int] = (),
                    num_speculative_tokens: int | None = None,
                    accept: Callable[[Sequence[int], Sequence[int]], int] = accept_length,
                    draft_noise: str = "coupled") -> GenerationResult:
    """DFlash decoding: prefill; then per round draft, verify the block as a chain, accept, roll back.

    Args:
        target: the target, built with the drafter's tap_layer_ids.
        proposer: a DFlashDrafter (wrapped in DrafterProposer) or any Proposer.
        prompt: prompt token ids.
        max_new_tokens: budget of new tokens.
        sampling: greedy or keyed sampling for the target; a DFlashDrafter drafts with the same
            keyed noise (coupled drafting).
        stop_ids: extra stop token ids (eos ids are always stops).
        num_speculative_tokens: draft tokens verified per round, 1..block_size-1; default block_size-1.
        accept: the acceptance rule; tests pass a deliberately broken one as a planted control.
        draft_noise: a DFlashDrafter's noise at T > 0 (`draft_sampling`): "coupled" (the default),
            or the benchmark's controls "greedy" and "other"; the tokens are the same for all three.

    Returns:
        GenerationResult with per-round accepted counts (text None: the reference works on ids).

    Raises:
        DFlashError: num_speculative_tokens out of range, a draft_noise not in DRAFT_NOISES, or the
            request does not fit max_context.

    Algorithm: z-lab/dflash `dflash_generate` (chain verify, exact match against the target's own
    choice, bonus token), with rollback by length instead of cache cropping; coupled drafting:
    Daliri, Musco and Suresh 2024 (export/sampling.py).
    """
    if isinstance(proposer, DFlashDrafter):
        block_size = proposer.block_size
        proposer = DrafterProposer(target, proposer, draft_sampling(sampling.tensors(), draft_noise))
    else:
        block_size = getattr(proposer, "block_size")
    n = block_size - 1 if num_speculative_tokens is None else num_speculative_tokens
    if not 1 <= n <= block_size - 1:
        raise DFlashError(f"num_speculative_tokens {n} is out of range: use 1..{block_size - 1} (block_size - 1)")
    check_fits(len(prompt), max_new_tokens, block_size, target.max_context)
    stops, s = _stop_set(target, stop_ids), sampling.tensors()

    t0 = time.perf_counter()
    chosen, _, taps = _step(target, prompt, 0, s)
    tokens = list(prompt) + [int(chosen[0, -1])]
    proposer.begin(taps)
    t1 = time.perf_counter()
    new_taps, ctx_start = taps[:, :0], len(prompt)
    accepted_per_round = []
    done = tokens[-1] in stops or max_new_tokens == 1
    while not done:
        start = len(tokens) - 1  # the anchor's position
        draft = [int(d) for d in proposer.propose(tokens, new_taps, ctx_start)][:n]
        chosen, _, taps = _step(target, [tokens[-1]] + draft, start, s)
        a = accept(draft, chosen[0].tolist())
        budget = max_new_tokens - (len(tokens) - len(prompt))
        r = commit_round(draft, chosen[0].tolist(), a, stops, budget)
        tokens += r.tokens
        accepted_per_round.append(r.accepted)
        new_taps, ctx_start = taps[:, : len(r.tokens)], start
        done = r.done
    return GenerationResult(tokens[len(prompt):], accepted=accepted_per_round, block_size=n + 1,
                            ttft_ms=(t1 - t0) * 1e3, decode_s=time.perf_counter() - t1)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two generations, or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def top2_margin(target: Qwen3, prefix: Sequence[int]) -> float:
    """The target's top-2 logit margin for the token after `prefix` (a near-tie when small)."""
    _, logits, _ = _step(target, prefix, 0, None)
    top = logits[0, -1].topk(2).values
    return float(top[0] - top[1])
