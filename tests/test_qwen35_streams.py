"""Several streams of a hybrid target: the tiny Qwen3.5-family pair compiled with --streams 2 for the
host, driven by the batch engine as tests/test_batch.py drives the dense pair. Every request run
while another joins and leaves gives the tokens it gives alone and those of plain decoding of the
eager target, greedy and seeded, drafted and plain: each stream's recurrent state is read, kept and
rolled back in its own slot. Prompts longer than the prefill chunk join through `prefill_stream`
(the chunk) and `verify_stream` (the rest, padded), into their slot alone. The scripted drafter
makes rounds accept every count 0..B-1; the planted controls (stream 1 at stream 0's length, and
one-stream calls told the next slot) must fail the same checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_batch import BLOCK, LeakyBatchEngine, Oracle, WrongSlotBatchEngine, counting, failures

from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import SamplingConfig, generate_plain
from dflash_iree.runtime.batch import BatchEngine
from dflash_iree.runtime.engine import Engine
from dflash_iree.runtime.options import GenerateOptions as G

STREAMS = 2
# prompt, options, the step it is added at (when a slot is free); 70 and 136 tokens: one and two
# prefill chunks of 64, then 6 rows and a whole block of 8 through verify_stream
REQUESTS = [
    (list(range(100, 170)), G(max_new_tokens=40), 0),
    ([7, 300, 12, 99, 5], G(max_new_tokens=30, temperature=1.0, seed=3), 0),
    ([200], G(max_new_tokens=12, speculative=False), 1),
    ([(5 * i) % 500 for i in range(136)], G(max_new_tokens=26, temperature=0.7, top_k=20, top_p=0.9, seed=11), 2),
    ([9, 9, 8, 1], G(max_new_tokens=20, temperature=1.4, seed=5, speculative=False), 3),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, hybrid_pair):
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = tmp_path_factory.mktemp("compiled-hybrid-streams") / "host"
    compile_artifacts("host", *hybrid_pair, out, max_context=256, streams=STREAMS, log=Progress(open(os.devnull, "w")))
    return Engine.load(str(out))


@pytest.fixture(scope="module")
def truths(hybrid_pair) -> dict[tuple, list[int]]:
    """prompt -> prompt + plain decoding of the eager hybrid target (BLOCK tokens past each budget)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target, _ = load_pair(*hybrid_pair, 256)
    out = {}
    for prompt, o, _ in REQUESTS:
        s = SamplingConfig(o.temperature, o.top_k, o.top_p, o.seed)
        out[tuple(prompt)] = list(prompt) + generate_plain(target, prompt, o.max_new_tokens + BLOCK, s).tokens
    return out


def test_module_has_the_hybrid_stream_entry_points(engine):
    fn = engine.module.fn
    assert {"prefill_stream", "verify_stream_sampled", "decode_stream", "verify_draft_stream"} <= set(fn)
    assert not any(name.startswith("verify_rows") for name in fn)  # no draft depth rule for a hybrid yet
    assert engine.artifacts.manifest.streams == STREAMS


def test_solo_equals_together_equals_plain(engine, truths, monkeypatch):
    counts = counting(monkeypatch, engine)
    assert failures(engine, truths, requests=REQUESTS) == []
    assert counts.get("verify_stream", 0) + counts.get("verify_stream_sampled", 0) > 0
    assert counts.get("prefill_stream", 0) + counts.get("prefill_stream_sampled", 0) > 0
    for form in ("verify_draft", "verify_draft_stream"):  # both forms ran, as requests joined and left
        assert counts.get(form, 0) + counts.get(form + "_sampled", 0) > 0, form


def test_solo_equals_together_with_the_compiled_drafter(engine, truths):
    assert failures(engine, truths, proposer=False, requests=REQUESTS) == []


def test_scripted_rounds_accept_every_count(engine, truths):
    prompt, o, _ = REQUESTS[0]
    alone = BatchEngine(engine.with_seams(proposer=Oracle(truths))).generate_many([prompt], o)[0]
    assert set(alone.accepted) == set(range(BLOCK))


@pytest.mark.parametrize("cls", [LeakyBatchEngine, WrongSlotBatchEngine], ids=["length-leak", "wrong-slot"])
def test_planted_controls_fail(engine, truths, cls):
    assert failures(engine, truths, cls=cls, requests=REQUESTS)


def test_calibrate_refuses_a_hybrid_module(engine):
    """No verify_rows for a hybrid yet, so `calibrate` says so in one line, exit 2, writing nothing."""
    folder = Path(engine.artifacts.folder)
    before = sorted(p.name for p in folder.iterdir())
    done = subprocess.run([sys.executable, "-m", "dflash_iree", "calibrate", "--artifacts", str(folder)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "does not serve hybrid targets yet" in done.stderr
    assert sorted(p.name for p in folder.iterdir()) == before
