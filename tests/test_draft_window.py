"""Sliding-window drafters: the config's layer types, the visibility rule, and the ring context cache
against a from-scratch forward over absolute positions, with a planted ring that forgets.

The from-scratch forward (tests/test_dflash2.py `ref_hidden` with `window`) keeps every context
row at its absolute position and masks key k from query q unless k <= q and q - k < W (z-lab/dflash
`_attention_mask`). Our drafter keeps W + B slots. The rounds below absorb B rows at a time of
which only some are real, as the fused round does, and run well past the window, so a ring that
lets those extra rows overwrite a row some query still sees differs from the reference.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_dflash2 import ref_hidden

from dflash_iree.config import load_drafter_config, load_target_config
from dflash_iree.errors import DFlashError
from dflash_iree.export import draft_window
from dflash_iree.export.load import load_pair

STEPS = [8, 1, 3, 8, 5, 2, 8, 7, 1, 4]  # real rows of each round's 8 absorbed rows


def _config(folder, tmp_path, **edit):
    d = tmp_path / "d"
    shutil.copytree(folder, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_layer_windows_read(target_dir, dflash2_sliding_dir, drafter_dir, tmp_path):
    target = load_target_config(target_dir)
    assert load_drafter_config(dflash2_sliding_dir, target).layer_windows == (12, 12)
    assert load_drafter_config(drafter_dir, target).layer_windows == ()
    mixed = _config(drafter_dir, tmp_path, layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    assert load_drafter_config(mixed, target).layer_windows == (0, 4)


def test_hf_rule_without_layer_types(target_dir, drafter_dir, tmp_path):
    """No layer_types: Hugging Face Qwen3Config's rule, sliding from max_window_layers on."""
    d = _config(drafter_dir, tmp_path, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert load_drafter_config(d, load_target_config(target_dir)).layer_windows == (0, 6)


@pytest.mark.parametrize("edit, message", [
    ({"layer_types": ["sliding_attention"] * 2}, "sliding_window is None"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 0}, "sliding_window is 0"),
    ({"layer_types": ["chunked_attention"] * 2}, "layer_types ['chunked_attention'] are not supported"),
    ({"layer_types": ["full_attention"]}, "one type per layer (2)"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 4, "is_causal": False}, "is_causal overrides"),
    ({"is_causal": True}, "is_causal overrides"),
])
def test_refusals(target_dir, drafter_dir, tmp_path, edit, message):
    with pytest.raises(DFlashError) as e:
        load_drafter_config(_config(drafter_dir, tmp_path, **edit), load_target_config(target_dir))
    assert message in str(e.value) and "config.json" in str(e.value)


def test_sliding_target_refused(target_dir, tmp_path):
    t = _config(target_dir, tmp_path, layer_types=["sliding_attention"] * 4, sliding_window=8)
    with pytest.raises(DFlashError, match="implemented for drafters only"):
        load_target_config(t)


def test_visibility_is_the_published_mask():
    """visibility() over absolute positions == z-lab's rule, written out: causal, q - k < W."""
    start, B, W = 13, 8, 5
    held = draft_window.slot_positions(torch.tensor([start]), 40, None)
    positions = start + torch.arange(B)[None]
    got = torch.cat(draft_window.visibility(held, positions, W), -1)[0]
    for i in range(B):
        q = start + i
        want = [0 <= k < start and q - k < W for k in range(40)] + [j <= i and i - j < W for j in range(B)]
        assert got[i].tolist() == want


def test_ring_holds_each_position_once():
    """The ring's slots name distinct positions, every one of the window's among them."""
    ring, B, W = 20, 8, 12
    for start in range(0, 70, 3):
        held = draft_window.slot_positions(torch.tensor([start]), ring + 1, ring)[0].tolist()
        seen = [p for p in held if p >= 0]
        assert len(seen) == len(set(seen)) and held[ring] == -1
        assert set(range(max(0, start - W), start)) <= set(seen)


def _rounds(target, drafter, steps=STEPS, prompt_len=17):
    """The largest difference between the drafter's last hidden states and the reference's over a
    prompt and then rounds that absorb B rows of which steps[i] are real (the rest junk), and the
    final block start."""
    B = drafter.block_size
    g = torch.Generator().manual_seed(1)
    total = prompt_len + sum(steps) + 1
    tokens = torch.randint(0, 512, (1, total), generator=g)
    captured = {}
    hook = drafter.norm.register_forward_hook(lambda _m, _i, out: captured.update(h=out))
    try:
        with torch.no_grad():
            _, _, taps = target(tokens, torch.tensor([0]))
            noise = torch.randn(taps.shape, generator=g)
            drafter.absorb(taps[:, :prompt_len], torch.tensor([0]))
            prev, worst = prompt_len, 0.0
            for n in [0] + list(steps):
                idx = torch.arange(prev, prev + B)
                real = (torch.arange(B) < n)[None, :, None]
                rows = torch.where(real, taps[:, idx.clamp(max=total - 1)], noise[:, idx % total])
                start = prev + n
                drafter(target, rows, torch.tensor([prev]), torch.tensor([n]), tokens[:, start])
                ref = ref_hidden(target, drafter, taps[0, :start], int(tokens[0, start]), window=12)
                worst = max(worst, (captured["h"][0] - ref).abs().max().item())
                prev = start
    finally:
        hook.remove()
    return worst, prev


def test_ring_equals_absolute_positions(target_dir, dflash2_sliding_dir):
    target, drafter = load_pair(target_dir, dflash2_sliding_dir, 128)
    assert drafter.ring == 20 and drafter.ctx_cache.shape[3] == 56  # not max_context: 21 rows padded to 64 keys with the block's 8
    worst, end = _rounds(target, drafter)
    assert end > 3 * drafter.ring and worst < 1e-4


def test_planted_ring_without_margin_fails(target_dir, dflash2_sliding_dir, monkeypatch):
    """A ring of W slots that writes every row at p mod W: the junk rows past the block start
    overwrite rows that the window still sees, and the comparison catches it."""
    target, drafter = load_pair(target_dir, dflash2_sliding_dir, 128)
    drafter.ring = 12
    drafter.ctx_cache = torch.zeros(*drafter.ctx_cache.shape[:3], 13, drafter.ctx_cache.shape[4])
    monkeypatch.setattr(draft_window, "absorb_slots", lambda positions, start, ring, block: positions % ring)
    worst, _ = _rounds(target, drafter)
    assert worst > 1e-2


def test_cache_bytes_do_not_grow_with_max_context(target_dir, dflash2_sliding_dir, dflash2_dir):
    small = load_pair(target_dir, dflash2_sliding_dir, 64)[1].ctx_cache
    large = load_pair(target_dir, dflash2_sliding_dir, 512)[1].ctx_cache
    assert small.shape == large.shape
    assert load_pair(target_dir, dflash2_dir, 512)[1].ctx_cache.shape[3] == 512
