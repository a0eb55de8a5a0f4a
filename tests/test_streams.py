"""The stream dimension S: the per-stream prefill and absorb (export/stream_entry_points.py) write
one stream's slot and nothing else, eagerly; and the tiny pair compiled with --streams 4 for the
host (the session's shared `streams_artifacts`) has S-shaped entry points and the per-stream ones.
S > 1 modules compile for sm_80 and gfx1151 too since export/qwen3.py `cache_rows` gives each layer
its own index vector (before, a [1, ?] i64 slice in the cache write failed CUDA translation;
experiments/2026-12-02-streams-sm80/); no GPU compile runs here, its form is tested below."""

from __future__ import annotations

import json

import torch

from dflash_iree.export.load import load_pair
from dflash_iree.export.qwen3 import cache_rows
from dflash_iree.export.stream_entry_points import drafter_absorb_stream, target_prefill_stream

CONTEXT = 256


@torch.no_grad()
def test_prefill_stream_writes_its_slot_only(target_dir, drafter_dir):
    """Slot 2 of a 3-stream pair prefilled alone: the same token and taps as a one-stream prefill, its
    target and drafter cache rows those of the one-stream pair, every other slot's rows untouched."""
    one_t, one_d = load_pair(target_dir, drafter_dir, CONTEXT)
    three_t, three_d = load_pair(target_dir, drafter_dir, CONTEXT, streams=3)
    for cache in (three_t.kv_cache, three_d.ctx_cache):
        cache.normal_()
    before_t, before_d = three_t.kv_cache.clone(), three_d.ctx_cache.clone()
    prompt = torch.tensor([[7, 300, 12, 99, 5, 41]])
    chosen, _, taps = one_t(prompt, torch.tensor([0]), last_only=True)
    one_d.absorb(taps, torch.tensor([0]))
    got, got_taps = target_prefill_stream(three_t, prompt, torch.tensor([2]), torch.tensor([0]), 64, None)
    drafter_absorb_stream(three_d, got_taps, torch.tensor([2]), torch.tensor([0]))
    assert torch.equal(got, chosen) and torch.allclose(got_taps, taps, atol=1e-5)
    T = prompt.shape[1]
    for three, one, before in ((three_t.kv_cache, one_t.kv_cache, before_t), (three_d.ctx_cache, one_d.ctx_cache, before_d)):
        assert torch.allclose(three[2, :, :, :T], one[0, :, :, :T], atol=1e-5)
        assert torch.equal(three[2, :, :, T:], before[2, :, :, T:])
        assert torch.equal(three[:2], before[:2])


def test_cache_rows_of_several_streams():
    """The per-layer rows of S > 1 streams (export/qwen3.py `cache_rows`, formed so that sm_80
    compiles them) are the flat-view rows (s*L + l)*2C + p of keys, then + C of values, per stream."""
    S, L, C = 3, 4, 64
    positions = torch.tensor([[5, 6, 7], [0, 1, 2], [60, 61, 62]])
    rows = cache_rows(torch.zeros(S, L, 2, C, 8), positions)
    for layer in range(L):
        keys = torch.stack([(s * L + layer) * 2 * C + positions[s] for s in range(S)])
        assert torch.equal(rows[layer], torch.cat([keys, keys + C], 1).reshape(-1))


def test_four_streams_manifest(streams_artifacts):
    """The S = 4 module: every entry point's stream dimension 4, the per-stream prefill and absorb
    of [1, T], the caches of 4 slots, the top-K spliced."""
    m = json.loads((streams_artifacts / "manifest.json").read_text())
    assert m["streams"] == 4 and m["shapes"]["streams"] == 4
    e = {x["name"]: x for x in m["entry_points"]}
    assert e["verify"]["args"][0] == {"name": "tokens", "shape": [4, 8], "dtype": "i64"}
    assert e["draft"]["args"][-1] == {"name": "draft", "shape": [4, 7], "dtype": "i64"}
    assert [a["name"] for a in e["prefill_stream_sampled"]["args"]] == [
        "tokens", "stream", "start", "pages", "temperature", "top_k", "top_p", "seed", "chosen"]
    assert e["prefill_stream"]["args"][0]["shape"] == [1, "T"] and e["absorb_stream"]["args"][1]["shape"] == [1]
    assert m["state"]["globals"]["target.kv_cache"]["shape"][0] == 4
    assert m["splices"]["topk"]
