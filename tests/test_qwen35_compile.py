"""A Qwen3.5-family hybrid target compiled for the host (tests/conftest.py `hybrid_artifacts`, one
compile a session): the manifest's record of the layers and the recurrent state; compiled == eager
and drafted == plain, token for token, greedy and seeded T = 1, short and long (a prompt of two
prefill chunks and a remainder, export/hybrid.py); every accepted length 0..B-1 rolled back on the
device, with a planted control that resumes from one rejected draft's state and must fail."""

from __future__ import annotations

import os
import warnings

import pytest
from test_qwen35_decoding import Scripted  # the scripted drafter: accepted lengths cycle 0..B-1

from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import SamplingConfig, generate_plain
from dflash_iree.manifest import Manifest
from dflash_iree.runtime.engine import Engine

B = 8
CHUNK = 64  # export/hybrid.py PREFILL_CHUNK
SHORT = [3, 17, 99, 250, 7, 7, 42]
LONG = [(7 * i + 3) % 509 for i in range(2 * CHUNK + 22)]  # two prefill chunks, then 22 rows through verify
SAMPLINGS = [SamplingConfig(), SamplingConfig(temperature=1.0, seed=7)]


@pytest.fixture(scope="module")
def engine(hybrid_artifacts):
    return Engine.load(str(hybrid_artifacts))


@pytest.fixture(scope="module")
def eager(hybrid_pair):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_pair(*hybrid_pair, max_context=256)


def test_manifest_records_layers_and_state(hybrid_artifacts):
    m = Manifest.load(hybrid_artifacts / "manifest.json")
    state = m.state
    assert state["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    r = state["recurrent"]
    assert (r["gdn_layers"], r["attention_layers"], r["slots"], r["prefill_chunk"]) == ([0, 1, 2], [3], B, CHUNK)
    # one step: 3 GDN layers x 4 value heads x 8 x 8 f32; conv window 3 rows x (2 x 16 + 32) channels
    assert r["step"]["gdn_state"] == {"shape": [1, 3, 4, 8, 8], "dtype": "f32", "bytes": 3 * 4 * 8 * 8 * 4}
    assert r["step"]["conv_state"] == {"shape": [1, 3, 3, 64], "dtype": "f32", "bytes": 3 * 3 * 64 * 4}
    g = state["globals"]
    assert g["target.state.gdn_slots"]["shape"] == [1, B, 3, 4, 8, 8]
    assert r["slot_bytes"] == B * r["step_bytes"] + 8  # + slot_start, one int64
    assert g["target.kv_cache"]["shape"] == [1, 1, 2, 256, 32]  # the attention layer only
    entries = {e["name"]: e for e in m.entry_points}
    assert entries["prefill"]["args"][0]["shape"] == [1, CHUNK] and "T" not in m.shapes["dims"]
    assert m.shapes["prefill_chunk"] == CHUNK


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "T1"])
@pytest.mark.parametrize("prompt, n_new", [(SHORT, 24), (LONG, 90)], ids=["short", "long"])
def test_compiled_equals_eager(engine, eager, prompt, n_new, sampling):
    target, _ = eager
    want = generate_plain(target, prompt, n_new, sampling).tokens
    kw = dict(temperature=sampling.temperature, seed=sampling.seed)
    plain = engine.generate(prompt, n_new, speculative=False, **kw)
    drafted = engine.generate(prompt, n_new, **kw)
    assert plain.tokens == want
    assert drafted.tokens == want
    assert sum(drafted.accepted) + len(drafted.accepted) >= n_new - 1  # every round committed its rows


def keeps_one_rejected(m):
    """Planted control, an `accept` seam: the real rule, then one `decode` of the first rejected
    draft at its position, so the module's next call resumes from the state after that rejected
    row (its KV row is rewritten by the next verify before anything reads it; only the recurrent
    state is wrong)."""
    from dflash_iree.acceptance import accept_length

    last = {}
    verify = m.verify

    def recording_verify(block, start):
        last["block"], last["start"] = block, start
        return verify(block, start)

    m.verify = recording_verify

    def accept(draft_ids, chosen):
        a = accept_length(draft_ids, chosen)
        if a < len(draft_ids):
            m.decode(draft_ids[a], last["start"] + a + 1)
        return a

    return accept


@pytest.mark.parametrize("planted", [False, True], ids=["rollback", "planted-control"])
def test_every_accepted_length_rolls_back(hybrid_artifacts, eager, planted):
    target, _ = eager
    prompt = [5, 6, 7, 8]
    want = generate_plain(target, prompt, 80).tokens
    engine = Engine.load(str(hybrid_artifacts))
    seams = dict(proposer=Scripted(want, len(prompt)), fused_round=False)
    if planted:
        seams["accept"] = keeps_one_rejected(engine.module)
    out = engine.with_seams(**seams).generate(prompt, 80)
    if planted:
        assert out.tokens != want
    else:
        assert set(out.accepted) == set(range(B)) and out.tokens == want


def test_exact_and_draft_top_k_keep_the_tokens(engine, eager):
    """`exact` (plain steps through the verify graph) and `draft_top_k` (the top-K drafter) on the
    hybrid module give the eager tokens too, with prompts through both prefill paths."""
    target, _ = eager
    for prompt in (SHORT, LONG[:CHUNK], LONG[:CHUNK + 3]):  # verify only, one whole chunk, chunk + verify
        want = generate_plain(target, prompt, 16).tokens
        assert engine.generate(prompt, 16, exact=True).tokens == want
        top = engine.generate(prompt, 16, draft_top_k=3)
        assert top.tokens == want and len(top.draft_top_k) == len(top.accepted)


def test_sm_80_puts_the_hybrid_layers_on_the_kernels(tiny_dir, tmp_path):
    """A bf16 tiny hybrid compiled for sm_80 (no sampled entry points, to keep it short): every gated
    attention op, decode's (R = g = 2) and verify's (R = 2 B) included, takes the gated block-attention
    kernel (the manifest's `splices.attention`, `gated`), the target's q/k norm + rope the
    zero-centred, partial-rotary norm + rope, and the DeltaNet rule of decode (T = 1), verify (T = B) and
    prefill (its 64 rows as 4 blocks of 16 keeping their last state only) the GDN step kernel; none of
    them is left to IREE."""
    import torch
    from tiny import make_drafter
    from tiny_qwen35 import make_hybrid

    from dflash_iree.export.compile import Progress, compile_artifacts

    target = make_hybrid(tiny_dir / "hybrid-target-bf16", seed=4, dtype="bfloat16")
    drafter = make_drafter(tiny_dir / "hybrid-drafter-bf16", target, block_size=B, taps=(1, 3), mask_token_id=511,
                           dtype=torch.bfloat16)
    m = compile_artifacts("sm_80", target, drafter, tmp_path / "sm_80", max_context=256, sampled=False,
                          draft_top_k=0, use_cache=False, log=Progress(open(os.devnull, "w")))
    splices = m.splices
    rows = sorted(e["R"] for e in splices["attention"])
    assert all(e["gated"] and e["head_dim"] == 16 and e["g"] == 2 for e in splices["attention"])
    assert 2 in rows and 2 * B in rows and "attention" not in splices.get("iree", {})
    hybrid = [e for e in splices["norm_rope"] if e.get("zero_centered")]  # the rest: the drafter's Qwen3 norms
    assert hybrid and all(e["rotary_dim"] == 8 for e in hybrid)
    assert {(e["T"], e["every_row"]) for e in splices["gdn"]} == {(1, True), (B, True), (16, False)}
    assert sum(e["ops"] for e in splices["gdn"] if not e["every_row"]) == 4 * 3  # one prefill's 4 blocks, 3 layers
    assert not {"gdn", "norm_rope"} & set(splices.get("iree", {}))


def test_sm_80_runs_one_deltanet_rule_in_every_entry_point(tiny_dir, tmp_path):
    """A drafter trained for a block of 20: verify's 20 rows are more than the GDN step kernel takes
    (16), so every entry point's DeltaNet rule, decode's included, goes to IREE: decode on the kernel
    and verify on IREE would sum in other orders, and decode's rows would not equal verify's."""
    import torch
    from tiny import make_drafter
    from tiny_qwen35 import make_hybrid

    from dflash_iree.export.compile import Progress, compile_artifacts

    target = make_hybrid(tiny_dir / "hybrid-target-bf16", seed=4, dtype="bfloat16")
    drafter = make_drafter(tiny_dir / "hybrid-drafter-b20", target, block_size=20, taps=(1, 3), mask_token_id=511,
                           dtype=torch.bfloat16)
    m = compile_artifacts("sm_80", target, drafter, tmp_path / "sm_80", max_context=256, sampled=False,
                          draft_top_k=0, use_cache=False, log=Progress(open(os.devnull, "w")))
    assert not m.splices.get("gdn") and sum(m.splices["iree"]["gdn"].values()) >= 2 * 3  # decode's 3 layers too
