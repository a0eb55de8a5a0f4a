"""Qwen3.5-family hybrid targets against transformers' own `qwen3_5_text` causal LM (the oracle,
pinned in the test extra), on tiny random float32 checkpoints: the config's two spellings, the
refusals, and logits over prefill / decode / verify splits of one sequence, rollback to every
accepted length (with its planted control), row invariance of the recurrent state, and YaRN."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tiny_qwen35 import as_wrapper, hf_model, make_hybrid

from dflash_iree.config import load_drafter_config, load_target_config
from dflash_iree.config_qwen35 import HybridConfig
from dflash_iree.errors import DFlashError
from dflash_iree.export.load import load_target
from dflash_iree.export.recurrent_state import RecurrentState

B = 8  # verify block (state slots)
ATOL = 1e-3  # f32 logits of magnitude ~10: ours and transformers' differ in summation order only


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_hybrid(tmp_path_factory.mktemp("q35") / "text")


@pytest.fixture(scope="module")
def wrapper_dir(hybrid_dir, tmp_path_factory):
    return as_wrapper(hybrid_dir, tmp_path_factory.mktemp("q35") / "wrapper")


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    """transformers' logits of one random 48-token sequence: (ids [1, 48], logits [1, 48, V])."""
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (1, 48))
    with torch.no_grad():
        return ids, hf_model(hybrid_dir)(ids).logits


def _run(target, ids, splits):
    """Our logits of ids run as consecutive calls of the given lengths: [1, sum(splits), V]."""
    out, at = [], 0
    with torch.no_grad():
        for n in splits:
            out.append(target(ids[:, at:at + n], torch.tensor([at]))[1])
            at += n
    return torch.cat(out, 1)


def test_config_both_spellings(hybrid_dir, wrapper_dir):
    text = load_target_config(hybrid_dir)
    with pytest.warns(UserWarning, match=r"vision tower \(model.visual.\*\) is not loaded.*mtp"):
        wrapped = load_target_config(wrapper_dir)
    for cfg in (text, wrapped):
        assert isinstance(cfg, HybridConfig)
        assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert (cfg.rotary_dim, cfg.conv_dim, cfg.gdn_layers, cfg.attention_layers) == (8, 64, (0, 1, 2), (3,))
    assert (text.weight_prefix, wrapped.weight_prefix) == ("model.", "model.language_model.")
    shapes = text.state_shapes(streams=1)
    assert shapes["gdn_state"] == ((1, 3, 4, 8, 8), "f32") and shapes["conv_state"] == ((1, 3, 3, 64), "f32")


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "qwen3_5_moe"}, "model_type 'qwen3_5_moe': Qwen3.5 mixture-of-experts targets are not implemented"),
    ({"model_type": "qwen3_next"}, "model_type 'qwen3_next': Qwen3-Next"),
    ({"num_experts": 8}, "mixture-of-experts targets are not implemented"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "layer_types entry 'sliding_attention' is not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries but num_hidden_layers is 4"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope' is not implemented"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
])
def test_refusals(hybrid_dir, tmp_path, edit, message):
    raw = {**json.loads((hybrid_dir / "config.json").read_text()), **edit}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match=message) as e:
        load_target_config(tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_hybrid_as_drafter_refused(hybrid_dir, target_dir):
    with pytest.raises(DFlashError, match="qwen3_5_text model, not a DFlash drafter .*MTP head"):
        load_drafter_config(hybrid_dir, load_target_config(target_dir))


@pytest.mark.parametrize("spelling", ["text", "wrapper"])
@pytest.mark.parametrize("splits", [(48,), (30, 1, 1, 8, 8), (5, 8, 1, 8, 1, 25)], ids=["prefill", "p-d-v", "v-mixed"])
def test_logits_match_transformers(hybrid_dir, wrapper_dir, reference, spelling, splits):
    """Prefill (chunked when longer than the block), decode and verify splits of one sequence."""
    ids, want = reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = load_target(hybrid_dir if spelling == "text" else wrapper_dir, max_context=256, block_size=B)
    torch.testing.assert_close(_run(target, ids, splits), want, atol=ATOL, rtol=0)


def _rollback_logits(target, ids, a: int):
    """Prefill 16, verify [ids 16, 7 rejected-to-be tokens] at 16, accept a drafts, then verify the
    true continuation at 17 + a: that call's logits [1, B, V] (positions 17 + a ..)."""
    P = 16
    junk = (ids[:, P:P + B] + 1 + torch.arange(B)) % 512  # drafts the target rejects past row a
    block = torch.cat([ids[:, P:P + 1 + a], junk[:, 1 + a:]], 1)[:, :B]
    with torch.no_grad():
        target(ids[:, :P], torch.tensor([0]))
        target(block, torch.tensor([P]))
        nxt = P + 1 + a
        return target(ids[:, nxt:nxt + B], torch.tensor([nxt]))[1]


def test_rollback_every_accepted_length(hybrid_dir, reference):
    """Every accepted length 0..B-1: the rejected rows leave no trace in the state."""
    ids, want = reference
    target = load_target(hybrid_dir, max_context=256, block_size=B)
    for a in range(B):
        nxt = 17 + a
        torch.testing.assert_close(_rollback_logits(target, ids, a), want[:, nxt:nxt + B], atol=ATOL, rtol=0)


class KeepsOneRejected(RecurrentState):
    """Planted control: resumes from the state one row later, one rejected draft's state kept."""

    def slot(self, start, stream=None):
        return super().slot(start + 1, stream)


def test_planted_rollback_keeps_a_rejected_state_fails(hybrid_dir, reference, monkeypatch):
    ids, want = reference
    target = load_target(hybrid_dir, max_context=256, block_size=B)
    target.state.__class__ = KeepsOneRejected
    failures = 0
    for a in range(B - 1):  # with a = B - 1 no row was rejected
        nxt = 17 + a
        got = _rollback_logits(target, ids, a)
        failures += not torch.allclose(got, want[:, nxt:nxt + B], atol=ATOL, rtol=0)
    assert failures == B - 1


def test_decode_and_verify_share_one_rule():
    """Row invariance of the recurrence: fed the same inputs, a verify block's rows and decode steps
    one at a time leave bit-identical states, conv windows and rule outputs (one per-token rule). The
    projections feeding it are the backend's matmuls over M = 1 or B rows; eager CPU's are not
    bit-identical across M (measured), so the whole model is compared with a tolerance."""
    from dflash_iree.export.gdn import causal_conv, prepare, recurrent_rule

    torch.manual_seed(0)
    S, T, Hk, Hv, dk, K, D = 1, B, 2, 4, 8, 4, 24
    q, k, v = torch.randn(S, T, Hk, dk), torch.randn(S, T, Hk, dk), torch.randn(S, T, Hv, dk)
    beta, g = torch.rand(S, T, Hv), -torch.rand(S, T, Hv)
    state0 = torch.randn(S, Hv, dk, dk)
    o, states = recurrent_rule(*prepare(q, k, v, beta, g), state0)
    rows, weight = torch.randn(S, T, D), torch.randn(D, K)
    window0 = torch.randn(S, K - 1, D)
    conv, inputs = causal_conv(rows, window0, weight)
    state, window = state0, window0
    for t in range(T):
        o_t, (state,) = recurrent_rule(*prepare(*(x[:, t:t + 1] for x in (q, k, v, beta, g))), state)
        conv_t, step_inputs = causal_conv(rows[:, t:t + 1], window, weight)
        window = step_inputs[:, 1:]
        assert torch.equal(state, states[t]) and torch.equal(o_t[:, :, 0], o[:, :, t])
        assert torch.equal(window, inputs[:, t + 1:t + K])
        # the same ops; eager CPU's vectorised multiply-add / SiLU round a 1-row and a B-row tensor
        # differently in the last bit (measured), so the conv output is compared to 1 ulp-ish
        torch.testing.assert_close(conv_t[:, 0], conv[:, t], atol=1e-6, rtol=1e-6)


def test_chunked_prefill_matches_per_token(hybrid_dir, reference):
    ids, _ = reference
    chunked = load_target(hybrid_dir, max_context=256, block_size=B)
    per_token = load_target(hybrid_dir, max_context=256, block_size=B)
    per_token.prefill_form = "per_token"
    with torch.no_grad():
        a = chunked(ids, torch.tensor([0]))[1]
        b = per_token(ids, torch.tensor([0]))[1]
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    torch.testing.assert_close(chunked.state.gdn_slots[:, 0], per_token.state.gdn_slots[:, 0], atol=1e-4, rtol=0)


def test_yarn_matches_transformers_past_the_original_context(tmp_path):
    """YaRN (factor 4 over 256 positions): prefill 290, verify 8 at positions 290..297."""
    folder = make_hybrid(tmp_path / "yarn", seed=3, yarn=True)
    cfg = load_target_config(folder)
    assert cfg.yarn is not None and cfg.yarn.factor == 4.0 and cfg.yarn.original_max_position_embeddings == 256
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (1, 298))
    with torch.no_grad():
        want = hf_model(folder)(ids).logits
    target = load_target(folder, max_context=512, block_size=B)
    torch.testing.assert_close(_run(target, ids, (290, 8)), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name, layers, gdn, state_mb", [("qwen3.5-9b", 32, 24, 50.3), ("qwen3.5-27b", 64, 48, 151.0)])
def test_published_geometry_fixtures(name, layers, gdn, state_mb):
    """The config fixtures of Qwen3.5-9B / 27B and their drafters read; one step's DeltaNet state
    is the size the notes give (27B: 3 MiB a layer, ~151 MB)."""
    from pathlib import Path

    fixtures = Path(__file__).parent / "fixtures"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_target_config(fixtures / name)
    drafter = load_drafter_config(fixtures / f"{name}-dflash", cfg)
    assert cfg.num_hidden_layers == layers and len(cfg.gdn_layers) == gdn and cfg.rotary_dim == 64
    assert cfg.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    shape, dtype = cfg.state_shapes()["gdn_state"]
    nbytes = 4
    for d in shape:
        nbytes *= d
    assert dtype == "f32" and round(nbytes / 1e6, 1) == state_mb
    assert drafter.mask_token_id == 248070 and max(drafter.target_layer_ids) < layers
