"""The compiled path on the host CPU: compiled dflash == compiled plain == eager, the scripted drafter
and planted control through the runtime, the transfer contract, repeat requests, refusals, and the
draft top-K (`draft_top_k`). The artifacts' manifest and checkpoints: tests/test_artifacts.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_exactness import BLOCK, PROMPTS, SAMPLINGS, ScriptedDrafter, broken_accept

from dflash_iree.acceptance import accept_length
from dflash_iree.errors import DFlashError
from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import generate_plain
from dflash_iree.kernels.topk.reference import score
from dflash_iree.runtime.engine import Engine, GenerateOptions, Seams
from dflash_iree.runtime.module import Staging


@pytest.fixture(scope="module")
def engine(host_artifacts):
    return Engine.load(host_artifacts)


@pytest.fixture(scope="module")
def eager(target_dir, drafter_dir):
    return load_pair(target_dir, drafter_dir, 256)


def _kw(s):
    return dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
@pytest.mark.parametrize("max_new_tokens", [4, 90], ids=["short", "long"])
def test_compiled_dflash_equals_plain_equals_eager(engine, eager, name, max_new_tokens):
    s = SAMPLINGS[name]
    for prompt in PROMPTS:
        ref = generate_plain(eager[0], prompt, max_new_tokens, s).tokens
        plain = engine.generate(prompt, max_new_tokens, speculative=False, **_kw(s))
        drafted = engine.generate(prompt, max_new_tokens, **_kw(s))
        assert plain.tokens == ref
        assert drafted.tokens == ref
        assert len(drafted.accepted) >= 1 and sum(drafted.histogram) == len(drafted.accepted)


def test_exact_mode_equals_plain(engine):
    for prompt in PROMPTS:
        assert engine.generate(prompt, 30, speculative=False, exact=True).tokens == \
            engine.generate(prompt, 30, speculative=False).tokens


def _scripted(engine, eager, accept, sampling):
    failures = []
    prompt = PROMPTS[0]
    plan = [0, 3, 7, 1, 6, 2, 5, 4]
    needed = sum(a + 1 for a in plan) + BLOCK
    truth = list(prompt) + generate_plain(eager[0], prompt, needed, sampling).tokens
    scripted = engine.with_seams(proposer=ScriptedDrafter(truth, plan), accept=accept)
    gen = scripted.generate(prompt, needed - BLOCK, **_kw(sampling))
    if gen.tokens != truth[len(prompt):len(prompt) + needed - BLOCK]:
        failures.append("tokens differ from plain")
    if gen.accepted[: len(plan)] != plan:
        failures.append(f"measured accepted {gen.accepted[:len(plan)]} != planted {plan}")
    return failures


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
def test_scripted_drafter_through_compiled_path(engine, eager, name):
    assert _scripted(engine, eager, accept_length, SAMPLINGS[name]) == []


def test_planted_control_fails_through_compiled_path(engine, eager):
    failures = _scripted(engine, eager, broken_accept, SAMPLINGS["greedy"])
    assert "tokens differ from plain" in failures and any("measured accepted" in f for f in failures)


@pytest.mark.parametrize("fused_round", [True, False], ids=["fused", "two-calls"])
def test_only_token_ids_cross_to_the_host(engine, fused_round):
    """Per round: draft ids [B-1] and chosen tokens [B], int64 (fused: with the device's row count,
    one [2B] row); never logits or taps."""
    before = engine.module.host_bytes
    gen = engine.with_seams(fused_round=fused_round).generate(PROMPTS[1], 60)
    per_round = (engine.module.host_bytes - before) / len(gen.accepted)
    # the prefill's first token and the first round's separate draft, spread over the rounds
    assert per_round <= 8 * 2 * BLOCK + 8 * BLOCK / len(gen.accepted)


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
def test_fused_round_equals_two_calls(engine, name):
    """verify_draft gives the same tokens and the same drafts (hence accepted counts) as a draft
    call plus a verify call, and its device count agrees with the host rule in every round."""
    s = SAMPLINGS[name]
    for prompt in PROMPTS:
        fused = engine.generate(prompt, 90, **_kw(s))
        two = engine.with_seams(fused_round=False).generate(prompt, 90, **_kw(s))
        assert fused.tokens == two.tokens
        assert fused.accepted == two.accepted
        assert fused.redrafts == 0


def test_planted_control_fails_through_fused_round(engine):
    """A broken host rule disagrees with the device count: the engine drafts again, and the
    tokens differ from plain decoding (the control is not masked by the device's own count)."""
    plain = engine.generate(PROMPTS[0], 60, speculative=False)
    broken = engine.with_seams(accept=broken_accept).generate(PROMPTS[0], 60)
    assert broken.tokens != plain.tokens and broken.redrafts > 0


def test_draft_top_k_is_the_only_extra_transfer(engine):
    """With draft_top_k, per round exactly the [B-1, K] int32 ids and float32 log-probs more (K the
    compiled 8, whatever k was asked for) than the same rounds as two calls without it."""
    before = engine.module.host_bytes
    plain = engine.with_seams(fused_round=False).generate(PROMPTS[1], 60)
    mid = engine.module.host_bytes
    top = engine.generate(PROMPTS[1], 60, draft_top_k=3)
    assert top.accepted == plain.accepted
    assert (engine.module.host_bytes - mid) - (mid - before) == len(top.accepted) * (BLOCK - 1) * 8 * (4 + 4)


@pytest.mark.parametrize("name", ["greedy", "t0.7-topk20-topp0.9"])
def test_draft_top_k_leaves_decoding_unchanged(engine, name):
    """The same draft ids, hence the same tokens and accepted counts; per round k ids per drafted
    position, best first. A greedy draft is the top id (checked where the draft was kept); a sampled
    one is drafted with the target's noise (export/sampling.py draft_tokens), so need not be."""
    kw = _kw(SAMPLINGS[name])
    base = engine.generate(PROMPTS[0], 50, num_speculative_tokens=5, **kw)
    top = engine.generate(PROMPTS[0], 50, num_speculative_tokens=5, draft_top_k=3, **kw)
    assert top.tokens == base.tokens and top.accepted == base.accepted and base.draft_top_k == []
    assert len(top.draft_top_k) == len(top.accepted)
    at = 0
    for r, (ids, lps) in enumerate(top.draft_top_k):
        assert len(ids) == len(lps) == 5 and all(len(row) == 3 for row in ids + lps)
        assert all(row[0] >= row[1] >= row[2] and row[0] <= 0 for row in lps)
        assert all(len(set(row)) == 3 and all(0 <= t < 512 for t in row) for row in ids)
        kept = top.accepted[r]
        if name == "greedy":
            assert [row[0] for row in ids[:kept]] == top.tokens[at + 1:at + 1 + kept]
        at += kept + 1


def first_draft_topk(engine, target, drafter, prompt):
    """The first round's draft of a sampled request (T = 0.7, K = 8), compiled and eager: ((ids,
    log-probs) of the compiled module, torch [B - 1, 8]; the eager drafter's logits [1, B - 1, V]; its
    top_k (ids, log-probs) [1, B - 1, 8])."""
    gen = engine.generate(prompt, 3, temperature=0.7, seed=4, draft_top_k=8)
    P, B = len(prompt), drafter.block_size
    with torch.no_grad():
        _, _, taps = target(torch.tensor([prompt]), torch.zeros(1, dtype=torch.int64), read_len=P, last_only=True)
        drafter.absorb(taps, torch.zeros(1, dtype=torch.int64))
        _, logits = drafter(target, torch.zeros(1, B, taps.shape[-1]), torch.tensor([P]), torch.tensor([0]),
                            torch.tensor([gen.tokens[0]]), read_len=P + B)
        want = drafter.top_k(logits, torch.tensor([0.7]), 8)
    return tuple(torch.tensor(x) for x in gen.draft_top_k[0]), logits, want


def test_draft_top_k_equals_eager_drafter(engine, eager):
    """First round of a sampled request (T = 0.7): the compiled top-K against the eager drafter's
    top_k at the request temperature; ids exact (ties only by kernels/topk/reference.py), log-probs 1e-4."""
    target, drafter = eager
    (ids, lps), logits, (want_ids, want_lps) = first_draft_topk(engine, target, drafter, PROMPTS[1])
    s = score(logits[0].numpy(), 0.7, ids.numpy(), lps.numpy())
    assert s["id_mismatch"] == 0 and s["max_lp_err"] <= 1e-4, s
    assert torch.equal(ids, want_ids[0]) or s["tie_swap"] > 0
    assert (lps - want_lps[0]).abs().max().item() <= 1e-4


def test_draft_top_k_refusals(engine, host_artifacts, tmp_path):
    with pytest.raises(DFlashError, match=r"draft_top_k 9 is more than the 8 .* compiled for .*--draft-top-k 9"):
        engine.generate(PROMPTS[0], 10, draft_top_k=9)
    with pytest.raises(DFlashError, match=r"draft_top_k -1 is out of range"):
        engine.generate(PROMPTS[0], 10, draft_top_k=-1)
    with pytest.raises(DFlashError, match=r"draft_top_k needs drafted decoding"):
        engine.generate(PROMPTS[0], 10, draft_top_k=2, speculative=False)
    arts = shutil.copytree(host_artifacts, tmp_path / "no-topk")
    m = json.loads((arts / "manifest.json").read_text())
    m["draft_top_k"] = 0  # as compiled with --draft-top-k 0
    (arts / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DFlashError, match=r"has no draft_topk entry point .*recompile with dflash-iree compile "
                                          r"--draft-top-k 2"):
        Engine.load(arts).generate(PROMPTS[0], 10, draft_top_k=2)
    with pytest.raises(DFlashError, match=r"no draft_topk entry point .*--draft-top-k K"):
        Engine.load(arts).module.draft_topk(None, 0, 0, 1, 0, 1.0)  # the module itself refuses too


def test_repeat_requests_equal_fresh_engines(engine, host_artifacts):
    a1 = engine.generate(PROMPTS[1], 40, temperature=1.0, seed=5).tokens
    b1 = engine.generate(PROMPTS[0], 40).tokens
    a2 = Engine.load(host_artifacts).generate(PROMPTS[1], 40, temperature=1.0, seed=5).tokens
    b2 = Engine.load(host_artifacts).generate(PROMPTS[0], 40).tokens
    assert (a1, b1) == (a2, b2)


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
def test_decode_ahead_equals_synchronous_calls(engine, name):
    """Plain decoding one step ahead (the `$async` entry points, the token kept on the device) gives
    the tokens of one synchronous `decode` call a step; a consumer that stops early leaves the next
    request unaffected, and without the VM context the same tokens come from synchronous calls."""
    s = SAMPLINGS[name]
    m = engine.module
    m.set_sampling(s.temperature, s.top_k, s.top_p, s.seed)
    ids = PROMPTS[0]
    first, _ = m.prefill(ids)
    sync, token = [], first
    for i in range(20):
        token = m.decode(token, len(ids) + i)
        sync.append(token)
    ahead = m.decode_ahead(first, len(ids), 20)
    assert [next(ahead) for _ in range(5)] == sync[:5]
    ahead.close()  # one step ran past the last token taken: its KV rows lie past the committed length
    assert list(m.decode_ahead(first, len(ids), 20)) == sync
    context = m._context, m._vm_module
    try:
        m._context = m._vm_module = None
        assert list(m.decode_ahead(first, len(ids), 20)) == sync
    finally:
        m._context, m._vm_module = context
    assert list(m.decode_ahead(first, len(ids), 0)) == []


def test_staging_reuses_pinned_buffers(engine):
    """Arguments go through a ring of Staging.DEPTH pinned buffers per shape: the last DEPTH values
    written are intact and the ring does not grow; an output buffer is kept per shape, dtype and slot."""
    st = engine.module._stage
    args = [st.arg(np.array([[i, -i]], np.int64)) for i in range(3 * Staging.DEPTH)]
    recent = args[-Staging.DEPTH:]
    assert [st.value(a).tolist() for a in recent] == [[[i, -i]] for i in range(2 * Staging.DEPTH, 3 * Staging.DEPTH)]
    assert len(st._args[((1, 2), np.dtype(np.int64).str)][0]) == Staging.DEPTH
    pages = engine.module._pages(100)
    assert pages is engine.module._pages(97) and st.value(pages).shape == (-(-100 // engine.module.kv_page),)
    out = st.out((1, 3), np.int32)
    assert out is st.out((1, 3), np.int32) and out is not st.out((1, 3), np.int32, slot=1)
    assert st.value(out).dtype == np.int32 and st.value(out).shape == (1, 3)


def test_written_arguments_checked_against_the_manifest(engine):
    """An entry point called through the runtime (CompiledPair.fn) refuses a written buffer of the
    wrong dtype or shape, a numpy array in its place, and a wrong argument count, naming the entry
    point, the argument, expected and got (IREE fails in hal.buffer.assert without the name, and
    takes a larger buffer silently); a right buffer is written as by the runtime's own call."""
    import iree.runtime as rt

    m = engine.module
    m.set_sampling(0.0, 0, 1.0, 0)
    P = len(PROMPTS[0])
    first, _ = m.prefill(PROMPTS[0])
    args = (m._i64([[first]]), m._i64([P]), m._pages(P + 1))
    for out, match in [
        (m._out(1, 1, dtype=np.int32), r"^entry point decode, argument 'chosen' \(written by the call, manifest "
                                       r"'writes'\): expected int64 \[1, 1\], got int32 \[1, 1\]$"),
        (m._out(1, 2), r"argument 'chosen' .*: expected int64 \[1, 1\], got int64 \[1, 2\]$"),
        (np.zeros((1, 1), np.int64), r"argument 'chosen' .*: got a ndarray; pass a device array"),
    ]:
        with pytest.raises(DFlashError, match=match):
            m.fn["decode"](*args, out)
    with pytest.raises(DFlashError, match=r"entry point decode: 3 arguments passed, it takes 4: tokens, start, pages, chosen"):
        m.fn["decode"](*args)
    out = rt.asdevicearray(m.device, np.zeros((1, 1), np.int64))
    m.fn["decode"](*args, out)
    assert out.to_host()[0, 0] == m.decode(first, P)


def test_generate_options_and_seams(engine):
    """The defaults live in GenerateOptions; `options=` and keywords give the same request; a seam
    passed as an option is refused naming with_seams; with_seams leaves the engine as it was."""
    assert GenerateOptions().max_new_tokens == 128 and GenerateOptions.of(None, top_k=3).top_k == 3
    o = GenerateOptions(max_new_tokens=12, num_speculative_tokens=3)
    a = engine.generate(PROMPTS[0], options=o)
    assert a.block_size == 4 and a.tokens == engine.generate(PROMPTS[0], 12, num_speculative_tokens=3).tokens
    assert engine.generate(PROMPTS[0], 20, options=o, num_speculative_tokens=None).block_size == BLOCK
    with pytest.raises(DFlashError, match=r"^temperature -1(\.0)? is out of range: use 0 \(greedy\)"):
        engine.generate(PROMPTS[0], 10, temperature=-1)
    with pytest.raises(TypeError, match=r"unknown generate option fused_round: .*Engine\.with_seams"):
        engine.generate(PROMPTS[0], 10, fused_round=False)
    two = engine.with_seams(fused_round=False)
    assert two.module is engine.module and engine.seams == Seams() and two.seams == Seams(fused_round=False)


def test_num_speculative_tokens(engine):
    gen = engine.generate(PROMPTS[0], 30, num_speculative_tokens=3)
    assert gen.block_size == 4 and gen.tokens == engine.generate(PROMPTS[0], 30, speculative=False).tokens
    with pytest.raises(DFlashError, match="num_speculative_tokens 8 is out of range: use 1..7"):
        engine.generate(PROMPTS[0], 30, num_speculative_tokens=8)


def test_over_long_request_refused(engine):
    with pytest.raises(DFlashError, match=r"\+ block \(8\) = 268 exceeds max_context 256; .*--max-context"):
        engine.generate(list(range(200)), 60)


def test_stop_token_ids(engine):
    full = engine.generate(PROMPTS[1], 40).tokens
    stop = full[12]
    gen = engine.generate(PROMPTS[1], 40, stop=[stop])
    assert gen.tokens == full[: full.index(stop) + 1]


def test_cli_generate_json_and_refusals(host_artifacts, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "dflash_iree", "generate", "--artifacts", *args],
                              capture_output=True, text=True, timeout=300)

    ok = run(str(host_artifacts), "--prompt-ids", "7 300 12", "--max-new-tokens", "10", "--json")
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    plain = json.loads(run(str(host_artifacts), "--prompt-ids", "7 300 12", "--max-new-tokens", "10", "--json",
                           "--no-draft").stdout)
    assert out["tokens"] == plain["tokens"] and out["stats"]["tau_mean"] >= 1 and "draft_top_k" not in out
    top = run(str(host_artifacts), "--prompt-ids", "7 300 12", "--max-new-tokens", "10", "--json", "--draft-top-k", "2")
    assert top.returncode == 0, top.stderr
    top = json.loads(top.stdout)
    assert top["tokens"] == out["tokens"] and len(top["draft_top_k"]) == len(top["stats"]["accepted"])
    assert all(len(r["ids"]) == 7 and len(r["ids"][0]) == len(r["logprobs"][0]) == 2 for r in top["draft_top_k"])
    over = run(str(host_artifacts), "--prompt-ids", "7 300 12", "--draft-top-k", "9")
    assert over.returncode == 2 and "draft_top_k 9 is more than the 8" in over.stderr and "Traceback" not in over.stderr
    missing = run(str(tmp_path / "nothing"), "--prompt-ids", "1")
    assert missing.returncode == 2 and "manifest.json does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    long = run(str(host_artifacts), "--prompt-ids", " ".join(["1"] * 250), "--max-new-tokens", "10")
    assert long.returncode == 2 and "exceeds max_context 256" in long.stderr
