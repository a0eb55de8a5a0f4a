"""The stream dimension S: the per-stream prefill and absorb (export/stream_entry_points.py) write
one stream's slot and nothing else, eagerly; and the tiny pair compiled with --streams 4 for the
host (the session's shared `streams_artifacts`) has S-shaped entry points and the per-stream ones;
the one-stream round and step (`verify_draft_stream`, `decode_stream`) equal the S-stream call's
row of their slot and touch no other slot, eagerly, with a planted wrong slot that must differ.
S > 1 modules compile for sm_80 and gfx1151 too since export/qwen3.py `cache_rows` gives each layer
its own index vector (before, a [1, ?] i64 slice in the cache write failed CUDA translation;
experiments/2026-12-02-streams-sm80/); no GPU compile runs here, its form is tested below."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_iree.export.load import load_pair
from dflash_iree.export.qwen3 import cache_rows
from dflash_iree.export import entry_points as E
from dflash_iree.export import stream_entry_points as SE
from dflash_iree.export.aot import Pair
from dflash_iree.export.stream_entry_points import drafter_absorb_stream, target_step_stream

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
    got, got_taps = target_step_stream(three_t, prompt, SE.slot_arg(2), torch.tensor([0]), 64, None, True)
    drafter_absorb_stream(three_d, got_taps, SE.slot_arg(2), torch.tensor([0]))
    assert torch.equal(got, chosen) and torch.allclose(got_taps, taps, atol=1e-5)
    T = prompt.shape[1]
    for three, one, before in ((three_t.kv_cache, one_t.kv_cache, before_t), (three_d.ctx_cache, one_d.ctx_cache, before_d)):
        assert torch.allclose(three[2, :, :, :T], one[0, :, :, :T], atol=1e-5)
        assert torch.equal(three[2, :, :, T:], before[2, :, :, T:])
        assert torch.equal(three[:2], before[:2])


def _filled(pair: Pair) -> Pair:
    """pair with every cache slot holding noise: a call that reads or writes another slot shows."""
    for cache in (pair.target.kv_cache, pair.drafter.ctx_cache):
        cache.normal_()
    return pair


@torch.no_grad()
@pytest.mark.parametrize("drafter", ["drafter_dir", "dflash2_sliding_dir"])
def test_one_stream_calls_equal_the_stream_row(target_dir, drafter, request):
    """`verify_draft_stream` / `decode_stream` (+ `_sampled`) in slot 1 of a 3-stream pair: the
    round and taps of row 1 of `verify_draft` / `decode` on the same caches, slot 1's cache rows
    the same after, every other slot untouched. The planted control, the one-stream call told slot 2,
    must differ. With the v1 drafter and a DFlash2 one whose layers all slide (its ring cache)."""
    drafter_dir = request.getfixturevalue(drafter)
    B, pages = 8, torch.zeros(4, dtype=torch.int8)  # 64 rows read
    tokens = torch.tensor([[5, 9, 300, 41, 41, 7, 2, 8], [7, 300, 12, 99, 5, 41, 3, 3], [1, 2, 3, 4, 5, 6, 7, 8]])
    start, n_draft = torch.tensor([20, 33, 12]), torch.tensor([7, 4, 0])
    torch.manual_seed(0)
    base = _filled(Pair(*load_pair(target_dir, drafter_dir, CONTEXT, streams=3, block_size=B)))
    saved = [base.target.kv_cache.clone(), base.drafter.ctx_cache.clone()]
    sampling = (torch.tensor([0.0, 0.9, 1.3]), torch.tensor([0, 20, 0]), torch.tensor([1.0, 0.9, 1.0]),
                torch.tensor([0, 4, 7]))

    def fresh():
        base.target.kv_cache.copy_(saved[0])
        base.drafter.ctx_cache.copy_(saved[1])
        return base

    def caches(pair):
        return pair.target.kv_cache.clone(), pair.drafter.ctx_cache.clone()

    def check(slot, want_slot=1):
        failures = []
        for sampled in (False, True):
            extra = sampling if sampled else ()
            one = tuple(x[want_slot:want_slot + 1] for x in extra)
            sfx = "_sampled" if sampled else ""
            rnd = torch.zeros(3, 2 * B, dtype=torch.int64)
            taps = E.BODIES["verify_draft" + sfx](fresh(), tokens, start, n_draft, pages, *extra, rnd)
            want = caches(base)
            rnd1 = torch.zeros(1, 2 * B, dtype=torch.int64)
            taps1 = SE.STREAM_BODIES["verify_draft_stream" + sfx](fresh(), tokens[1:2], SE.slot_arg(slot),
                                                                   start[1:2], n_draft[1:2], pages, *one, rnd1)
            got = caches(base)
            if not (torch.equal(rnd1, rnd[1:2]) and torch.allclose(taps1, taps[1:2], atol=1e-5)):
                failures.append(f"verify_draft_stream{sfx}: round or taps differ")
            for w, g, s in zip(want, got, saved):
                if not (torch.allclose(g[1], w[1], atol=1e-5) and torch.equal(g[[0, 2]], s[[0, 2]])):
                    failures.append(f"verify_draft_stream{sfx}: cache slots differ")
            ch = torch.zeros(3, 1, dtype=torch.int64)
            E.BODIES["decode" + sfx](fresh(), tokens[:, :1], start, pages, *extra, ch)
            ch1 = torch.zeros(1, 1, dtype=torch.int64)
            SE.STREAM_BODIES["decode_stream" + sfx](fresh(), tokens[1:2, :1], SE.slot_arg(slot), start[1:2], pages,
                                                    *one, ch1)
            if not torch.equal(ch1, ch[1:2]) or not torch.equal(base.target.kv_cache[0], saved[0][0]):
                failures.append(f"decode_stream{sfx} differs")
        return failures

    assert check(1) == []
    assert check(2)  # planted: slot 2 written and read while row 1's round is compared


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
    assert e["prefill_stream"]["args"][0]["shape"] == [1, "T"] and e["absorb_stream"]["args"][1] == {"name": "stream", "shape": ["Q"], "dtype": "i8"}
    assert [a["name"] for a in e["verify_draft_stream_sampled"]["args"]] == [
        "tokens", "stream", "start", "n_draft", "pages", "temperature", "top_k", "top_p", "seed", "round"]
    assert e["verify_draft_stream"]["args"][0]["shape"] == [1, 8] and e["verify_draft_stream"]["args"][-1]["shape"] == [1, 16]
    assert e["decode_stream"]["args"][0]["shape"] == [1, 1] and e["decode_stream_sampled"]["writes"] == ["chosen"]
    assert m["state"]["globals"]["target.kv_cache"]["shape"][0] == 4
    assert m["splices"]["topk"]


def test_one_stream_round_takes_the_block_attention_kernel(target_dir, drafter_dir, tmp_path):
    """`verify_draft_stream` of a bf16 3-stream module spliced for sm_80: every target layer's attention
    is the block-attention kernel over the cache viewed as one stream of 3 * L layers, its layer a
    runtime i32 computed from the slot (`torch_c.to_i64` + `arith.trunci`), not a constant; the module
    compiles. Before, the one-stream calls ran IREE's attention (experiments/2026-12-02-streams-8b/)."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.arch import ARCHS
    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export import aot
    from dflash_iree.export.dflash import DFlashDrafter
    from dflash_iree.export.iree_tool import run_iree_compile
    from dflash_iree.export.qwen3 import Qwen3
    from dflash_iree.export.splice import load, splice_file

    tcfg = load_target_config(target_dir)
    dcfg = load_drafter_config(drafter_dir, tcfg)
    S, B, L = 3, 8, tcfg.num_hidden_layers
    with torch.device("meta"):
        pair = Pair(Qwen3(tcfg, CONTEXT, dcfg.target_layer_ids, S, torch.bfloat16, attention="fused"),
                    DFlashDrafter(dcfg, CONTEXT, B, S, torch.bfloat16, attention="fused")).eval()
    pair.requires_grad_(False)
    shapes = E.ExportShapes(S, B, CONTEXT, "bf16", dcfg.num_taps * tcfg.hidden_size)
    out, _ = aot.export_module(pair, shapes, sampled=False, only=("verify_draft_stream",))
    out.save_mlir(tmp_path / "m.mlir")
    src, flags, report = splice_file(tmp_path / "m.mlir", tmp_path / "s.mlirbc", "sm_80")
    Hkv, hd = tcfg.num_key_value_heads, tcfg.head_dim
    R = B * tcfg.num_attention_heads // Hkv
    assert report["attention"] == [{"S": 1, "Hkv": Hkv, "R": R, "head_dim": hd, "ops": L, "g": R // B}]
    text = str(load(src))
    assert text.count(f"util.call @dflash_attention_1x{Hkv}x{R}x{hd}_{S * L}x{CONTEXT}_g{R // B}(") == L
    assert text.count("torch_c.to_i64") >= L and "arith.trunci" in text
    run_iree_compile(src, tmp_path / "m.vmfb", list(ARCHS["sm_80"].flags), tmp_path / "stats.csv", flags)
    assert (tmp_path / "m.vmfb").stat().st_size > 10000
