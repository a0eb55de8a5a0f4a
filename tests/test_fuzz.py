"""Fuzz of the API's and the CLI's arguments (issue #22): bounded and seeded.

Each case draws values from a pool of ordinary, edge and bad ones: numbers (NaN, inf, huge,
negative, fractional, bool, str), token ids (inside, at and past the vocabulary, negative,
non-integers, bytes), stop items and strings (lone surrogates). A case must end in a result, whose
tokens are in the vocabulary and within the budget, or in a DFlashError (the API) / exit status 2
without a traceback (the CLI). Anything else (another exception, a crash) fails the test.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from badinput import cli

from dflash_iree.errors import DFlashError
from dflash_iree.runtime.engine import Engine

SEED = 22
API_CASES = 300
CLI_CASES = 60
V = 512  # the tiny target's vocabulary

NUMBERS = [0, 1, 2, 7, -1, 0.5, 1.0, 1.5, 1e-30, 1e30, math.nan, math.inf, -math.inf, 2**31, 2**32 - 1, 2**32,
           2**63, 2**64 + 1, -(2**63), True, "1", None]
IDS = [0, 1, 7, 300, V - 1, V, V + 1, -1, 2**40, 10**30, 1.5, True, "3", None]


def _ids(rng: random.Random):
    kind = rng.random()
    if kind < 0.08:
        return rng.choice([b"abc", "text", [], None, 5, [{"role": "user", "content": "hi"}], "\udcff"])
    ids = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
    if kind < 0.5:
        ids[rng.randrange(len(ids))] = rng.choice(IDS)
    return np.array(ids, dtype=np.int64) if kind > 0.95 else ids


def _request(rng: random.Random) -> dict:
    kw = {}
    for name, typical in (("max_new_tokens", [1, 3, 9]), ("temperature", [0.0, 0.7, 1.0]), ("top_k", [0, 5]),
                          ("top_p", [1.0, 0.9]), ("seed", [0, 3]), ("num_speculative_tokens", [None, 3, 7]),
                          ("draft_top_k", [0, 2, 8])):
        if rng.random() < 0.6:
            kw[name] = rng.choice(typical)
        elif rng.random() < 0.5:
            kw[name] = rng.choice(NUMBERS)
    if rng.random() < 0.3:
        kw["stop"] = rng.choice([[5], 600, [-1], "x", ["\udcff"], [1.5], [None], [7, "y"]])
    if rng.random() < 0.2:
        kw["speculative"] = False
    if isinstance(kw.get("max_new_tokens"), (int, float)) and not isinstance(kw["max_new_tokens"], bool):
        kw["max_new_tokens"] = min(kw["max_new_tokens"], 2**64)  # a huge budget is refused by check_fits
    return kw


@pytest.fixture(scope="module")
def engine(host_artifacts):
    return Engine.load(host_artifacts)


def test_fuzz_api(engine):
    rng = random.Random(SEED)
    outcomes = {"result": 0, "refused": 0}
    for case in range(API_CASES):
        prompt, kw = _ids(rng), _request(rng)
        try:
            g = engine.generate(prompt, **kw)
        except DFlashError as e:
            assert str(e) and "\n" not in str(e).strip() or "do not fit" in str(e), (case, prompt, kw, e)
            outcomes["refused"] += 1
            continue
        budget = kw.get("max_new_tokens", 128)
        assert 1 <= len(g.tokens) <= budget and all(0 <= t < V for t in g.tokens), (case, prompt, kw, g.tokens)
        outcomes["result"] += 1
    assert outcomes["result"] >= 30 and outcomes["refused"] >= 30, outcomes  # the pool reaches both ends


def _argv(rng: random.Random) -> list[str]:
    def num(typical: list[str]):
        if rng.random() < 0.6:
            return rng.choice(typical)
        return rng.choice(["0", "1", "-1", "7", "0.5", "nan", "inf", "-inf", "1e-30", "1e30", str(2**64), "abc", ""])

    good = rng.random() < 0.6
    ids = " ".join(rng.choice(["1", "7", "300", "511"] if good else ["1", "512", "-1", str(2**40), "1.5", "x"])
                   for _ in range(rng.randint(0 if not good else 1, 4)))
    argv = ["--prompt-ids", ids] if rng.random() < 0.85 else ["--prompt", rng.choice(["hi", "", "\udcff"])]
    for option, typical in (("--max-new-tokens", ["1", "4", "9"]), ("--temperature", ["0", "0.7", "1"]),
                            ("--top-k", ["0", "5"]), ("--top-p", ["1", "0.9"]), ("--seed", ["0", "3"]),
                            ("--num-speculative-tokens", ["3", "7"]), ("--draft-top-k", ["0", "2"])):
        if rng.random() < 0.35:
            argv += [option, num(typical)]
    for flag in ("--no-draft", "--exact", "--json", "--quiet"):
        if rng.random() < 0.2:
            argv.append(flag)
    if rng.random() < 0.15:
        argv += ["--encoding", rng.choice(["utf-8", "latin-1", "nope"])]
    if "--max-new-tokens" not in argv:
        argv += ["--max-new-tokens", "6"]
    return argv


def test_fuzz_cli(capsys, host_artifacts):
    rng = random.Random(SEED)
    statuses = {0: 0, 2: 0}
    for case in range(CLI_CASES):
        argv = _argv(rng)
        rc, out, err = cli(capsys, "generate", "--artifacts", host_artifacts, *argv)
        assert rc in (0, 2), (case, argv, rc, err)
        assert "Traceback" not in err, (case, argv, err)
        if rc == 2:
            assert "error:" in err, (case, argv, err)
        statuses[rc] += 1
    assert statuses[0] >= 5 and statuses[2] >= 20, statuses
