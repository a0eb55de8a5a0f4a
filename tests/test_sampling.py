"""Keyed sampling: a pure function of (seed, position), with top-k and top-p cut-offs."""

from __future__ import annotations

import torch

from dflash_iree.export.sampling import Sampling, choose_tokens, keyed_uniform


def _params(t=1.0, k=0, p=1.0, seed=0):
    return Sampling(torch.tensor([t]), torch.tensor([k]), torch.tensor([p]), torch.tensor([seed]))


def test_keyed_uniform_depends_on_seed_and_position_only():
    pos = torch.tensor([[5, 6, 7]])
    a = keyed_uniform(torch.tensor([3]), pos, 1000)
    assert torch.equal(a, keyed_uniform(torch.tensor([3]), pos, 1000))
    # the same position gives the same numbers whatever block it sits in
    assert torch.equal(a[0, 1], keyed_uniform(torch.tensor([3]), torch.tensor([[6]]), 1000)[0, 0])
    assert not torch.equal(a, keyed_uniform(torch.tensor([4]), pos, 1000))
    assert 0.0 < a.min().item() and a.max().item() < 1.0
    assert abs(a.mean().item() - 0.5) < 0.02  # roughly uniform over 3000 draws


def test_greedy_when_temperature_zero():
    logits = torch.randn(1, 6, 50)
    assert torch.equal(choose_tokens(logits, torch.arange(6)[None], None), logits.argmax(-1))
    assert torch.equal(choose_tokens(logits, torch.arange(6)[None], _params(t=0.0)), logits.argmax(-1))


def test_sample_frequencies_follow_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(1, 4000, 4).contiguous()
    picks = choose_tokens(logits, torch.arange(4000)[None], _params(t=1.0, seed=7))[0]
    freq = torch.bincount(picks, minlength=4).float() / 4000
    assert (freq - torch.softmax(logits[0, 0], -1)).abs().max().item() < 0.03


def test_top_k_keeps_the_k_best():
    logits = torch.randn(1, 1, 100).expand(1, 2000, 100).contiguous()
    picks = choose_tokens(logits, torch.arange(2000)[None], _params(t=5.0, k=3))[0]
    assert set(picks.tolist()) == set(logits[0, 0].topk(3).indices.tolist())


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(1, 2000, 4).contiguous()
    picks = choose_tokens(logits, torch.arange(2000)[None], _params(t=1.0, p=0.75))[0]
    assert set(picks.tolist()) == {0, 1}  # 0.5 + 0.3 >= 0.75; 0.5 alone is not enough
    picks = choose_tokens(logits, torch.arange(2000)[None], _params(t=1.0, p=0.4))[0]
    assert set(picks.tolist()) == {0}


def test_top_p_one_keeps_everything():
    logits = torch.tensor([10.0, 0.0, -5.0, -30.0]).expand(1, 1, 4)
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([logits, torch.randn(1, 1, 4, generator=g)], 1)
    picks = set()
    for seed in range(300):
        picks |= set(choose_tokens(logits[:, 1:], torch.tensor([[1]]), _params(t=3.0, p=1.0, seed=seed))[0].tolist())
    assert picks == {0, 1, 2, 3}
