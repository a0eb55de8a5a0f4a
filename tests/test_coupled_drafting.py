"""Coupled drafting at T > 0: the drafter drafts with the target's own keyed noise.

- the coupling itself: a drafter whose logits are the target's proposes exactly the target's sample;
- the compiled drafter's coupled draft == the eager drafter's, token for token;
- drafted == plain seeded sampling at T = 0.6, 1.0 and 1.5 with top-k / top-p, eager and compiled,
  short and long, for the coupled draft and for the benchmark's controls (a greedy draft, another
  seed's noise), with the planted acceptance rule failing the same check.

That coupling raises acceptance is a benchmark row (bench/coupled_drafting.py), not a test.
"""

from __future__ import annotations

import pytest
import torch
from test_exactness import PROMPTS, broken_accept, run_exactness

from dflash_iree.acceptance import accept_length
from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import SamplingConfig, draft_sampling, generate_dflash, generate_plain
from dflash_iree.export.sampling import Sampling, _kept, choose_tokens, draft_tokens
from dflash_iree.generation import DRAFT_NOISES
from dflash_iree.runtime.engine import Engine

SAMPLED = {
    "t0.6-topk40": SamplingConfig(temperature=0.6, top_k=40, seed=5),
    "t1": SamplingConfig(temperature=1.0, seed=3),
    "t1.5-topp0.8": SamplingConfig(temperature=1.5, top_p=0.8, seed=8),
    "t1-topk20-topp0.9": SamplingConfig(temperature=1.0, top_k=20, top_p=0.9, seed=2),
}


def _kw(s: SamplingConfig) -> dict:
    return dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


@pytest.mark.parametrize("name", SAMPLED)
def test_a_drafter_with_the_targets_logits_proposes_the_targets_sample(name):
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 300) * 3
    positions = torch.arange(14).view(2, 7) + 40
    s = SAMPLED[name].tensors()
    s = Sampling(*(torch.cat([t, t]) for t in s))  # two streams
    target = choose_tokens(logits, positions, s)
    assert torch.equal(draft_tokens(logits, positions, s, cut=True), target)
    # over the whole vocabulary (the default) the draft is the target's sample wherever it falls in
    # the target's kept set (always, without top-k / top-p)
    full = draft_tokens(logits, positions, s)
    kept = _kept(logits / s.temperature[:, None, None], s.top_k, s.top_p).gather(-1, full[..., None])[..., 0]
    assert kept.any() and torch.equal(full[kept], target[kept])
    if s.top_k[0] == 0 and s.top_p[0] == 1.0:
        assert kept.all()
    # another seed's noise draws other tokens; temperature 0 in a stream is its argmax
    other = draft_sampling(s, "other")
    assert not torch.equal(draft_tokens(logits, positions, other), choose_tokens(logits, positions, s))
    greedy_one = s._replace(temperature=torch.tensor([0.0, s.temperature[1].item()]))
    got = draft_tokens(logits, positions, greedy_one, cut=True)
    assert torch.equal(got[0], logits[0].argmax(-1)) and torch.equal(got[1], choose_tokens(logits, positions, s)[1])


@pytest.fixture(scope="module")
def pair(target_dir, drafter_dir):
    return load_pair(target_dir, drafter_dir, 512)


@pytest.mark.parametrize("name", SAMPLED)
@pytest.mark.parametrize("max_new_tokens", [5, 120], ids=["short", "long"])
def test_eager_coupled_drafted_equals_plain(pair, name, max_new_tokens):
    assert run_exactness(pair, accept_length, max_new_tokens, SAMPLED[name]) == []


@pytest.mark.parametrize("noise", ["greedy", "other"])
def test_eager_control_noises_keep_the_tokens(pair, noise):
    target, drafter = pair
    s = SAMPLED["t1"]
    for prompt in PROMPTS:
        assert generate_dflash(target, drafter, prompt, 60, s, draft_noise=noise).tokens == \
            generate_plain(target, prompt, 60, s).tokens


def test_eager_planted_control_fails_with_coupled_drafts(pair):
    assert any("random drafter" in f for f in run_exactness(pair, broken_accept, 60, SAMPLED["t1-topk20-topp0.9"]))


@pytest.fixture(scope="module")
def engine(host_artifacts):
    return Engine.load(host_artifacts)


@pytest.mark.parametrize("name", SAMPLED)
def test_compiled_coupled_draft_equals_eager(engine, pair, name):
    """The first round's draft after a prompt: compiled `draft_sampled` against the eager drafter's
    coupled draft at the same positions (and the plain `draft` against the eager greedy one)."""
    target, drafter = pair
    s = SAMPLED[name]
    prompt = PROMPTS[1]
    P, B, m = len(prompt), drafter.block_size, engine.module
    for sampling in (s, SamplingConfig()):
        m.set_sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        first, taps = m.prefill(prompt)
        m.absorb(taps)
        got = m.draft(None, P, 0, first, P)
        with torch.no_grad():
            _, _, etaps = target(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int64), read_len=P, last_only=True)
            drafter.absorb(etaps, torch.zeros(1, dtype=torch.int64))
            want, _ = drafter(target, torch.zeros(1, B, etaps.shape[-1]), torch.tensor([P]), torch.tensor([0]),
                              torch.tensor([first]), read_len=P + B, sampling=sampling.tensors())
        assert got == want[0].tolist(), (sampling, got, want[0].tolist())


@pytest.mark.parametrize("name", SAMPLED)
@pytest.mark.parametrize("max_new_tokens", [4, 90], ids=["short", "long"])
def test_compiled_coupled_drafted_equals_plain_equals_eager(engine, pair, name, max_new_tokens):
    s = SAMPLED[name]
    for prompt in PROMPTS:
        ref = generate_plain(pair[0], prompt, max_new_tokens, s).tokens
        assert engine.generate(prompt, max_new_tokens, speculative=False, **_kw(s)).tokens == ref
        for noise in DRAFT_NOISES:
            for fused in (True, False):
                got = engine.with_seams(draft_noise=noise, fused_round=fused).generate(prompt, max_new_tokens, **_kw(s))
                assert got.tokens == ref, (noise, fused)


def test_compiled_planted_control_fails_with_coupled_drafts(engine, pair):
    s = SAMPLED["t1"]
    broken = engine.with_seams(accept=broken_accept)
    assert any(broken.generate(p, 60, **_kw(s)).tokens != generate_plain(pair[0], p, 60, s).tokens for p in PROMPTS)


def test_compiled_draft_top_k_drafts_coupled(engine):
    """`draft_topk_sampled` drafts as `draft_sampled` does: the same tokens and accepted counts."""
    kw = _kw(SAMPLED["t1-topk20-topp0.9"])
    base = engine.with_seams(fused_round=False).generate(PROMPTS[0], 50, **kw)
    top = engine.generate(PROMPTS[0], 50, draft_top_k=3, **kw)
    assert top.tokens == base.tokens and top.accepted == base.accepted


def test_unknown_draft_noise_is_refused(engine):
    with pytest.raises(Exception, match="draft_noise 'loud'"):
        engine.with_seams(draft_noise="loud").generate(PROMPTS[0], 4, temperature=1.0)
