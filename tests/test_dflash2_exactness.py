"""DFlash2 drafted == plain decoding, greedy and seeded T = 1, eager and compiled, with planted controls.

- eager: the random DFlash2 drafter and the scripted drafter through `run_exactness` (tests/test_exactness.py),
  and the acceptance rule that keeps one rejected token failing the same check;
- compiled (one session compile of the tiny DFlash2 pair, `dflash2_artifacts`, whose drafter's
  layers all slide, window 12, as the Qwen3.6-27B example's do: its context cache is a ring of
  20 slots, and the 33-token prompt and the 60 new tokens run past it): the device's
  first draft after a prompt == the eager walk, greedy and coupled at T = 1; a broken walk (the
  predecessor never advances) drafts otherwise, so that comparison bites; and generate ==
  plain decoding, with the planted acceptance rule failing it. v1's compiled exactness is
  tests/test_coupled_drafting.py's, on the v1 pair.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from test_exactness import PROMPTS, broken_accept, run_exactness

from dflash_iree.acceptance import accept_length
from dflash_iree.export.draft_window import KEY_ALIGN
from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import SamplingConfig, generate_plain

SAMPLINGS = {"greedy": SamplingConfig(), "t1-seed3": SamplingConfig(temperature=1.0, seed=3)}


def _kw(s: SamplingConfig) -> dict:
    return dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


@pytest.fixture(scope="module")
def pair(target_dir, dflash2_dir):
    return load_pair(target_dir, dflash2_dir, 512)


@pytest.fixture(scope="module")
def pair256(target_dir, dflash2_sliding_dir):
    return load_pair(target_dir, dflash2_sliding_dir, 256)


@pytest.fixture(scope="session")
def dflash2_artifacts(tmp_path_factory, target_dir, dflash2_sliding_dir):
    """The tiny sliding-window DFlash2 pair compiled for the host CPU (block 8, max_context 256,
    float32), once."""
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = tmp_path_factory.mktemp("compiled-dflash2") / "host"
    compile_artifacts("host", target_dir, dflash2_sliding_dir, out, max_context=256,
                      log=Progress(open(os.devnull, "w")))
    return out


@pytest.fixture(scope="module")
def engine(dflash2_artifacts):
    from dflash_iree.runtime.engine import Engine

    return Engine.load(dflash2_artifacts)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_eager_drafted_equals_plain(pair, sampling):
    assert run_exactness(pair, accept_length, 60, sampling) == []


def test_eager_planted_control_fails(pair):
    failures = run_exactness(pair, broken_accept, 60, SAMPLINGS["t1-seed3"])
    assert any("random drafter" in f for f in failures) and any("measured accepted" in f for f in failures)


def _eager_first_draft(pair, prompt, first, sampling):
    target, drafter = pair
    P, B = len(prompt), drafter.block_size
    with torch.no_grad():
        _, _, taps = target(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int64), read_len=P, last_only=True)
        drafter.absorb(taps, torch.zeros(1, dtype=torch.int64))
        draft, _ = drafter(target, torch.zeros(1, B, taps.shape[-1]), torch.tensor([P]), torch.tensor([0]),
                           torch.tensor([first]), read_len=P + B, sampling=sampling.tensors())
    return draft[0].tolist()


class _StalePredecessor:
    """The planted control of the walk: the predecessor stays the anchor at every slot."""

    def __init__(self, selector):
        self.selector, self.walk = selector, selector.walk

    def __enter__(self):
        sel, walk = self.selector, self.walk

        def stale(ids, unary, h, anchor, positions, sampling):
            return torch.stack([walk(ids[:, i:i + 1], unary[:, i:i + 1], h[:, i:i + 1], anchor, positions[:, i:i + 1],
                                     sampling)[:, 0] for i in range(ids.shape[1])], 1)
        sel.walk = stale

    def __exit__(self, *exc):
        del self.selector.walk


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_compiled_draft_equals_eager_walk(engine, pair256, sampling):
    """The device's draft (conv, logits, top-16 on the top-K dispatch, the walk) == the eager one,
    for several prompts; the broken walk differs from it somewhere."""
    m, broken_differs = engine.module, False
    for prompt in PROMPTS:
        m.set_sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        first, taps = m.prefill(prompt)
        m.absorb(taps)
        got = m.draft(None, len(prompt), 0, first, len(prompt))
        assert got == _eager_first_draft(pair256, prompt, first, sampling), (prompt, sampling)
        with _StalePredecessor(pair256[1].candidate_selector):
            broken_differs |= got != _eager_first_draft(pair256, prompt, first, sampling)
    assert broken_differs, "the planted walk drafts as the real one: the comparison would not bite"


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_compiled_drafted_equals_plain(engine, pair256, sampling):
    for prompt in PROMPTS:
        ref = generate_plain(pair256[0], prompt, 60, sampling).tokens
        assert engine.generate(prompt, 60, **_kw(sampling)).tokens == ref
        assert engine.with_seams(fused_round=False).generate(prompt, 60, **_kw(sampling)).tokens == ref


def test_compiled_planted_control_fails(engine, pair256):
    s = SAMPLINGS["t1-seed3"]
    broken = engine.with_seams(accept=broken_accept)
    assert any(broken.generate(p, 60, **_kw(s)).tokens != generate_plain(pair256[0], p, 60, s).tokens for p in PROMPTS)


def test_compiled_manifest_names_the_dflash2_drafter(engine, dflash2_artifacts):
    import json

    manifest = json.loads((dflash2_artifacts / "manifest.json").read_text())
    assert manifest["drafter"]["config"]["dflash2"]["selector_top_k"] == 16
    assert manifest["drafter"]["config"]["layer_windows"] == [12, 12]
    ring = manifest["state"]["globals"]["drafter.ctx_cache"]
    # a ring of window + block slots and a spare, padded so that its rows and the block's keys come to
    # a multiple of KEY_ALIGN, whatever max_context is; float32
    assert ring["shape"][3] == KEY_ALIGN - 8  # 12 + 8 + 1 rows, and 8 block keys: padded to 64
    assert ring["bytes"] == math.prod(ring["shape"]) * 4
    assert "candidate_selector.predecessor_codebook" in manifest["parameters"]["drafter"]
