"""Soak: a 10k-token generation on the host, drafted and plain, compared token for token.

The tiny long pair (tests/conftest.py `long_pair`: vocab 8192, block 4) is compiled once with a
KV cache of LONG_CONTEXT rows, so every round runs against a context that grows to 10k tokens:
the paged read lengths, the rollback by length and the drafter's context cache are exercised far
past where the short tests stop. Bounded: each case's two generations must finish within
BUDGET_S on the host (measured with 2 busy cores: 10k greedy tokens drafted 98 s, plain 37 s; the
random drafter is accepted about never, so drafting costs a verify per token; the compile, about
3 minutes, is not counted).
"""

from __future__ import annotations

import time

import pytest
from conftest import LONG_CONTEXT

from dflash_iree.runtime.engine import Engine

SOAK_TOKENS = 10_000
BUDGET_S = 300


@pytest.fixture(scope="module")
def long_engine(long_artifacts):
    return Engine.load(long_artifacts)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.mark.parametrize("sampling,n", [(dict(), SOAK_TOKENS), (dict(temperature=0.8, top_k=50, top_p=0.95, seed=7), 2000)],
                         ids=["greedy-10k", "sampled-2k"])
def test_long_generation_drafted_equals_plain(long_engine, sampling, n):
    """n new tokens drafted == plain (the decode graph), every token, within the time budget.
    Drafted == plain through the verify graph (`exact`) holds too (measured at 10k, greedy and
    sampled); it is left out here for time, the short tests check it."""
    prompt = [11, 420, 7, 3001, 64]
    assert len(prompt) + n + long_engine.block_size <= LONG_CONTEXT
    t0 = time.perf_counter()
    drafted = long_engine.generate(prompt, n, **sampling)
    plain = long_engine.generate(prompt, n, speculative=False, **sampling)
    took = time.perf_counter() - t0
    assert len(drafted.tokens) == len(plain.tokens) == n
    assert _first_difference(drafted.tokens, plain.tokens) is None
    assert all(0 <= t < long_engine.vocab_size for t in drafted.tokens)
    assert sum(a + 1 for a in drafted.accepted) + 1 >= n  # every round committed its tokens
    assert took < BUDGET_S, f"{n} tokens took {took:.0f}s, over the {BUDGET_S}s budget"
