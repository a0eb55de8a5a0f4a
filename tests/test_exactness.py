"""Drafted output == plain output, token for token, and the planted control that proves the test bites.

- a random drafter (mostly rejections) and a scripted drafter that proposes the target's true
  continuation with wrong tokens planted at chosen draft positions, so that every accepted count
  0..block_size-1 occurs and the measured counts must equal the planted ones exactly;
- greedy and seeded sampling, short and long generations, float32;
- bf16: a divergence is tolerated only at a reported near-tie (top-2 margin below BF16_TIE_EPS);
- the planted control: an acceptance rule that keeps one rejected draft token must fail all this.
"""

from __future__ import annotations

import pytest
import torch

from dflash_iree.acceptance import accept_length
from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import (SamplingConfig, first_divergence, generate_dflash, generate_plain,
                                          top2_margin)

BLOCK = 8
BF16_TIE_EPS = 0.125  # logits; bf16 keeps 8 mantissa bits, so values near 16 carry errors of ~0.06
PROMPTS = [[7, 300, 12, 99, 5], list(range(40, 73)), [200]]
SAMPLINGS = {
    "greedy": SamplingConfig(),
    "t1-seed3": SamplingConfig(temperature=1.0, seed=3),
    "t0.7-topk20-topp0.9": SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, seed=11),
}


def broken_accept(draft, chosen) -> int:
    """The planted control: keeps one rejected draft token."""
    return min(accept_length(draft, chosen) + 1, len(draft))


class ScriptedDrafter:
    """Proposes the true continuation, with a wrong token planted at draft index plan[round].

    plan[r] == BLOCK - 1 plants nothing (every draft token is right). Rounds past the plan plant
    at index 0.
    """

    block_size = BLOCK

    def __init__(self, truth: list[int], plan: list[int], vocab: int = 512):
        self.truth, self.plan, self.vocab, self.round = truth, plan, vocab, 0

    def begin(self, prompt_taps):
        self.round = 0

    def propose(self, tokens, new_taps, ctx_start):
        n = len(tokens)
        draft = [self.truth[i] if i < len(self.truth) else 0 for i in range(n, n + BLOCK - 1)]
        wrong_at = self.plan[self.round] if self.round < len(self.plan) else 0
        if wrong_at < BLOCK - 1:
            draft[wrong_at] = (draft[wrong_at] + 1) % self.vocab
        self.round += 1
        return draft


@pytest.fixture(scope="module")
def pair(target_dir, drafter_dir):
    return load_pair(target_dir, drafter_dir, 512)


def run_exactness(pair, accept, max_new_tokens, sampling) -> list[str]:
    """Every way drafted decoding can differ from plain, as messages (empty: exact)."""
    target, drafter = pair
    failures = []
    for prompt in PROMPTS:
        plain = generate_plain(target, prompt, max_new_tokens, sampling)
        drafted = generate_dflash(target, drafter, prompt, max_new_tokens, sampling, accept=accept)
        if drafted.tokens != plain.tokens:
            failures.append(f"random drafter, prompt {prompt[:3]}: diverges at {first_divergence(drafted.tokens, plain.tokens)}")
        # plant wrong tokens so that every accepted count 0..BLOCK-1 occurs, twice over
        plan = [0, 3, 7, 1, 6, 2, 5, 4, 7, 0, 4]
        needed = len(prompt) + sum(a + 1 for a in plan) + BLOCK
        truth = list(prompt) + generate_plain(target, prompt, needed, sampling).tokens
        scripted = generate_dflash(target, ScriptedDrafter(truth, plan), prompt, needed - BLOCK, sampling,
                                   accept=accept)
        if scripted.tokens != truth[len(prompt):len(prompt) + needed - BLOCK]:
            failures.append(f"scripted drafter, prompt {prompt[:3]}: tokens differ from plain")
        if scripted.accepted[: len(plan)] != plan:
            failures.append(f"scripted drafter: measured accepted {scripted.accepted[:len(plan)]} != planted {plan}")
    return failures


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("max_new_tokens", [5, 120], ids=["short", "long"])
def test_drafted_equals_plain(pair, sampling, max_new_tokens):
    assert run_exactness(pair, accept_length, max_new_tokens, sampling) == []


@pytest.mark.parametrize("sampling", [SAMPLINGS["greedy"], SAMPLINGS["t1-seed3"]], ids=["greedy", "t1-seed3"])
def test_planted_control_fails(pair, sampling):
    """The same exactness check must catch an acceptance rule that keeps one rejected token."""
    failures = run_exactness(pair, broken_accept, 60, sampling)
    assert any("random drafter" in f for f in failures)
    assert any("measured accepted" in f for f in failures)


def test_random_drafter_mostly_rejects(pair):
    target, drafter = pair
    gen = generate_dflash(target, drafter, PROMPTS[0], 60)
    assert gen.tau_mean < 2.0 and sum(gen.histogram) == len(gen.accepted)


def test_num_speculative_tokens_lowers_depth(pair):
    target, _ = pair
    truth = [7, 300, 12, 99, 5] + generate_plain(target, [7, 300, 12, 99, 5], 40).tokens
    gen = generate_dflash(target, ScriptedDrafter(truth, [7] * 20), [7, 300, 12, 99, 5], 30, num_speculative_tokens=3)
    assert gen.tokens == truth[5:35] and gen.block_size == 4
    assert set(gen.accepted[:-1]) == {3}


def test_stop_token_cuts_an_accepted_block(pair):
    target, _ = pair
    prompt = [7, 300, 12, 99, 5]
    truth = prompt + generate_plain(target, prompt, 40).tokens
    stop = truth[len(prompt) + 10]
    plain = generate_plain(target, prompt, 40, stop_ids=[stop])
    drafted = generate_dflash(target, ScriptedDrafter(truth, [7] * 20), prompt, 40, stop_ids=[stop])
    assert drafted.tokens == plain.tokens and drafted.tokens[-1] == stop
    assert len(drafted.tokens) == truth[len(prompt):].index(stop) + 1


def test_bf16_divergence_only_at_near_ties(target_dir, drafter_dir):
    """bf16 verify (T rows) and decode (1 row) may round differently; only near-ties may flip."""
    target, drafter = load_pair(target_dir, drafter_dir, 256, dtype="bf16")
    for prompt in PROMPTS:
        plain = generate_plain(target, prompt, 60)
        drafted = generate_dflash(target, drafter, prompt, 60)
        i = first_divergence(drafted.tokens, plain.tokens)
        if i is not None:
            margin = top2_margin(target, list(prompt) + plain.tokens[:i])
            print(f"bf16 prompt {prompt[:3]}: first divergence at token {i}, top-2 margin {margin:.4f}")
            assert margin < BF16_TIE_EPS, f"divergence at {i} with top-2 margin {margin} >= {BF16_TIE_EPS}"
