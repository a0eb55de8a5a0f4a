"""The DFlash2 drafter's forward against a from-scratch forward written from the published
description (next-families.md §1; z-lab/dflash `DFlash2DraftModel`), with planted controls.

The from-scratch forward runs every row and tap by explicit loops: the convolution of each
sublayer over the block rows (row i reads rows i-t >= 0 only: the block boundary), the context K/V
from the fused taps without any convolution, the logits, the top-16 by torch.topk, and the walk
with the predecessor codebook indexed by the previous choice and the successor codebook by the
candidate. A control that breaks one of these (the boundary, the codebooks' orientation, the
walk's predecessor) must fail the same comparison.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from test_drafter import _rms, _rope

from dflash_iree.export import dflash2 as d2
from dflash_iree.export.load import load_pair
from dflash_iree.export.sampling import Sampling

MASK = 511


def ref_conv(x, delta, base, group):
    """x [B, H], delta [B, k, G], base [k, H]: out[i] = sum_{t <= i} (base[t] + delta[i, t] per group) * x[i - t]."""
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(base.shape[0]):
            if i - t >= 0:
                out[i] += (base[t] + delta[i, t].repeat_interleave(group)) * x[i - t]
    return out


def ref_hidden(target, drafter, ctx_taps, anchor, window: int = 0):
    """The last layer's normalised output at block rows 1..B-1: ctx_taps [P, nH] at positions
    0..P-1, the block [anchor, mask...] at P..P+B-1. window > 0: every layer is a sliding_attention
    one, key k visible to query q when k <= q and q - k < window (z-lab/dflash `_attention_mask`)."""
    P, B, hd = ctx_taps.shape[0], drafter.block_size, drafter.cfg.head_dim
    k, group = drafter.cfg.dflash2.conv_kernel_size, drafter.cfg.dflash2.conv_group_size
    ctx = _rms(ctx_taps @ drafter.fc.weight.T, drafter.hidden_norm.weight)
    x = target.model.embed_tokens.weight[torch.tensor([anchor] + [MASK] * (B - 1))]
    pos = torch.arange(P + B)
    mask = None
    if window:
        mask = (pos[None, :] <= pos[P:, None]) & (pos[P:, None] - pos[None, :] < window)
    for layer in drafter.layers:
        a, m = layer.self_attn, layer.mlp
        for conv, norm, sub in ((layer.attention_conv, layer.input_layernorm, "attn"),
                                (layer.mlp_conv, layer.post_attention_layernorm, "mlp")):
            h = _rms(x, norm.weight)
            delta = (h @ conv.kernel_projection.weight.T).view(B, 2, k, -1)
            h = ref_conv(h, delta[:, 0], conv.base_kernel[0], group)
            if sub == "attn":
                q = _rope(_rms((h @ a.q_proj.weight.T).view(B, -1, hd), a.q_norm.weight), pos[P:])
                kv_in = torch.cat([ctx, h])  # context rows: never convolved
                kk = _rope(_rms((kv_in @ a.k_proj.weight.T).view(P + B, -1, hd), a.k_norm.weight), pos)
                v = (kv_in @ a.v_proj.weight.T).view(P + B, -1, hd)
                g = q.shape[1] // kk.shape[1]
                kk, v = kk.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
                o = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
                y = o.transpose(0, 1).reshape(B, -1) @ a.o_proj.weight.T
            else:
                y = (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
            x = x + ref_conv(y, delta[:, 1], conv.base_kernel[1], group)
    return _rms(x[1:], drafter.norm.weight)


def ref_walk(drafter, h, logits, anchor, swap=False, stale_prev=False):
    """The greedy walk, slot by slot; swap / stale_prev are planted controls."""
    sel = drafter.candidate_selector
    A, Bc = sel.predecessor_codebook, sel.successor_codebook
    if swap:
        A, Bc = Bc, A
    unary, cand = torch.topk(logits, 16, dim=-1)
    hp = h @ sel.hidden_projection.weight.T
    prev, path = anchor, []
    for i in range(logits.shape[0]):
        scores = [float(unary[i, j]) + float((A[prev] * hp[i] * Bc[cand[i, j]]).sum()) for j in range(16)]
        choice = int(cand[i, max(range(16), key=lambda j: scores[j])])
        path.append(choice)
        prev = prev if stale_prev else choice
    return path, cand


@pytest.fixture(scope="module")
def rounds(target_dir, dflash2_dir):
    """Our drafter after a prompt and two rounds, and the from-scratch results at the last round."""
    target, drafter = load_pair(target_dir, dflash2_dir, 128)
    with torch.no_grad():
        tokens = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(0))
        _, _, taps = target(tokens, torch.tensor([0]))
        drafter.absorb(taps[:, :17], torch.tensor([0]))
        drafter(target, taps[:, 17:20], torch.tensor([17]), torch.tensor([3]), tokens[:, 20])
        draft, logits = drafter(target, taps[:, 20:25], torch.tensor([20]), torch.tensor([5]), tokens[:, 25])
        h = ref_hidden(target, drafter, taps[0, :25], int(tokens[0, 25]))
        ref_logits = h @ target.lm_head.weight.T
    return target, drafter, draft[0], logits[0], h, ref_logits, int(tokens[0, 25])


def test_logits_match_from_scratch(rounds):
    _, _, _, logits, _, ref_logits, _ = rounds
    assert (logits - ref_logits).abs().max().item() < 1e-4


@torch.no_grad()
def test_candidates_and_walk_match_from_scratch(rounds):
    _, drafter, draft, logits, h, ref_logits, anchor = rounds
    path, cand = ref_walk(drafter, h, ref_logits, anchor)
    ours, _ = drafter.candidate_selector.candidates(logits[None])
    assert torch.equal(ours[0], cand)
    assert draft.tolist() == path
    assert path != ref_logits.argmax(-1).tolist(), "the pair term never changed a choice: the test would not bite"


@pytest.mark.parametrize("control", ["swap", "stale_prev"])
@torch.no_grad()
def test_planted_walk_controls_fail(rounds, control):
    """The codebooks' orientation and the walk's predecessor: each broken variant drafts otherwise."""
    _, drafter, draft, _, h, ref_logits, anchor = rounds
    broken, _ = ref_walk(drafter, h, ref_logits, anchor, **{control: True})
    assert draft.tolist() != broken


@torch.no_grad()
def test_conv_boundary_and_causality():
    """Row 0 sees only itself (zero before the block); no row sees a later one; a control that
    wraps around (torch.roll: the last rows leak into row 0) differs."""
    g = torch.Generator().manual_seed(0)
    x, base = torch.randn(1, 6, 32, generator=g), torch.randn(3, 32, generator=g)
    delta = torch.randn(1, 6, 3, 2, generator=g)
    out = d2.causal_conv(x, delta, base, 16)
    assert torch.allclose(out[0], ref_conv(x[0], delta[0], base, 16), atol=1e-6)
    assert torch.allclose(out[0, 0], (base[0] + delta[0, 0, 0].repeat_interleave(16)) * x[0, 0], atol=1e-6)
    assert torch.allclose(d2.causal_conv(x[:, :4], delta[:, :4], base, 16), out[:, :4], atol=1e-6)
    wrapped = sum((base[t] + delta[0, :, t].repeat_interleave(16, -1)) * torch.roll(x[0], t, 0) for t in range(3))
    assert not torch.allclose(wrapped, out[0], atol=1e-3)


@torch.no_grad()
def test_context_rows_never_pass_through_the_conv(target_dir, dflash2_dir):
    """The drafter's context cache holds v1's projection of the taps: the convolutions have no say."""
    target, drafter = load_pair(target_dir, dflash2_dir, 64)
    _, _, taps = target(torch.arange(10)[None], torch.tensor([0]))
    drafter.absorb(taps, torch.tensor([0]))
    before = drafter.ctx_cache.clone()
    for layer in drafter.layers:
        layer.attention_conv.base_kernel.mul_(3.0)
    drafter.absorb(taps, torch.tensor([0]))
    assert torch.equal(before, drafter.ctx_cache)


@torch.no_grad()
def test_sampled_walk_uses_the_targets_noise(rounds):
    """At T > 0 the walk's choice at a slot is argmax(score / T + the target's gumbel at that
    (seed, position, id)); a stream at T = 0 walks greedily; the draft is among the candidates."""
    target, drafter, draft, logits, h, _, anchor = rounds
    ids, unary = drafter.candidate_selector.candidates(logits[None])
    pos = torch.arange(26, 33)[None]
    s = Sampling(torch.tensor([1.0]), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([5]))
    sampled = drafter.candidate_selector.walk(ids, unary, h[None], torch.tensor([anchor]), pos, s)[0]
    assert all(int(t) in ids[0, i].tolist() for i, t in enumerate(sampled))
    greedy = drafter.candidate_selector.walk(ids, unary, h[None], torch.tensor([anchor]), pos,
                                             s._replace(temperature=torch.tensor([0.0])))[0]
    assert torch.equal(greedy, draft)
    seeds = {tuple(drafter.candidate_selector.walk(ids, unary, h[None], torch.tensor([anchor]), pos,
                                                   s._replace(seed=torch.tensor([n])))[0].tolist()) for n in range(6)}
    assert len(seeds) > 1, "the noise never changed the walk"


@torch.no_grad()
def test_logit_transform_for_v1_and_dflash2(target_dir, drafter_dir, tmp_path):
    """output_multiplier m and final_logit_softcapping cap: logits tanh(l * m / cap) * cap (v1 too)."""
    import json

    target, drafter = load_pair(target_dir, drafter_dir, 64)
    _, _, taps = target(torch.arange(6)[None], torch.tensor([0]))
    args = (taps, torch.tensor([0]), torch.tensor([6]), torch.tensor([7]))
    _, plain = drafter(target, *args)
    d = shutil.copytree(drafter_dir, tmp_path / "d")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"].update(output_multiplier=0.25, final_logit_softcapping=2.0)
    (d / "config.json").write_text(json.dumps(cfg))
    _, capped_drafter = load_pair(target_dir, d, 64)
    _, capped = capped_drafter(target, *args)
    assert torch.allclose(capped, torch.tanh(plain * 0.25 / 2.0) * 2.0, atol=1e-6)
    assert capped.abs().max() < 2.0
