"""YaRN RoPE scaling of Qwen3 dense targets and DFlash drafters (v1 and DFlash2), against transformers.

- the cos / sin tables equal transformers' `Qwen3RotaryEmbedding` bit for bit in float32 (and after
  the bf16 cast), for several factor / original context / beta / attention-factor settings, in both
  spellings (`rope_scaling` with `type`, transformers >= 5's `rope_parameters` with rope_theta inside)
  and with a top-level `original_max_position_embeddings` (which transformers prefers);
- a tiny YaRN target's logits equal transformers' Qwen3ForCausalLM past the original context;
- a YaRN drafter's tables equal `Qwen3RotaryEmbedding` of its config (the z-lab reference drafter
  builds that class), its cached rounds equal a from-scratch forward rotated by transformers'
  `apply_rotary_pos_emb`, and drafted == plain holds for tiny pairs with YaRN drafters and a YaRN target;
- planted controls: the tables without the attention factor (mscale) or without the ramp, and the
  plain-RoPE reference for a YaRN drafter, must fail the same checks;
- refusals: other rope types, a yarn dict without factor or with a non-number; the manifest guard
  compares the yarn field (an older manifest without it reads as plain RoPE);
- no rope scaling: the tables and their exported graph stay those of plain RoPE.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_drafter
import torch
from test_exactness import SAMPLINGS, broken_accept, run_exactness
from tiny import TINY, make_dflash2_drafter, make_drafter, make_target
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_iree import guard
from dflash_iree.acceptance import accept_length
from dflash_iree.config import load_drafter_config, load_target_config
from dflash_iree.errors import DFlashError
from dflash_iree.export import rope as export_rope
from dflash_iree.export.load import load_pair, load_target
from dflash_iree.export.qwen3 import rope_tables
from dflash_iree.rope import YaRN

YARN_TARGET = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
YARN_DRAFTER = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _write_config(folder: Path, head_dim: int, theta: float, spelling: str, yarn: dict, top: dict | None = None,
                  max_positions: int = 1024) -> Path:
    """A Qwen3 config.json with YaRN in `spelling`: "rope_scaling" (old: `type`, rope_theta at the top
    level) or "rope_parameters" (transformers >= 5: `rope_type`, rope_theta inside)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = {**TINY, "model_type": "qwen3", "head_dim": head_dim, "max_position_embeddings": max_positions,
           "torch_dtype": "float32", **(top or {})}
    if spelling == "rope_scaling":
        raw["rope_theta"] = theta
        raw["rope_scaling"] = {"type": "yarn", **yarn}
    else:
        del raw["rope_theta"]
        raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": theta, **yarn}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def _hf_tables(folder: Path, positions: torch.Tensor, dtype=torch.float32):
    """transformers' cos, sin [1, N, head_dim] of `folder`'s config at positions [1, N]."""
    config = Qwen3Config.from_pretrained(folder)
    rotary = Qwen3RotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=dtype), positions)


def _ours(folder: Path, positions: torch.Tensor, dtype=torch.float32, drafter_of: Path | None = None):
    cfg = load_target_config(folder) if drafter_of is None else load_drafter_config(folder, load_target_config(drafter_of))
    assert cfg.yarn is not None
    return rope_tables(positions, cfg.head_dim, cfg.rope_theta, dtype, cfg.yarn)


def _positions(original: int) -> torch.Tensor:
    """[1, N]: the start, around the original context, and up to 4x past it."""
    return torch.cat([torch.arange(0, 300), torch.arange(max(original - 40, 0), original + 40),
                      torch.arange(4 * original - 60, 4 * original)])[None]


def _tables_equal(folder: Path, original: int, dtype=torch.float32) -> bool:
    pos = _positions(original)
    ours, ref = _ours(folder, pos, dtype), _hf_tables(folder, pos, dtype)
    assert ours[0].shape == ref[0].shape == (1, pos.shape[1], json.loads((folder / "config.json").read_text())["head_dim"])
    return all(torch.equal(a, b) for a, b in zip(ours, ref))


SETTINGS = {  # name: head_dim, theta, yarn fields, top-level fields
    "qwen3-128k": (128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 32768}, {"max_position_embeddings": 40960}),
    "f2.5-orig300": (64, 10000.0, {"factor": 2.5, "original_max_position_embeddings": 300}, {}),
    "f8-orig64-betas": (16, 10000.0, {"factor": 8, "original_max_position_embeddings": 64, "beta_fast": 16,
                                      "beta_slow": 2}, {}),
    "attention-factor": (32, 5e5, {"factor": 4.0, "original_max_position_embeddings": 512,
                                   "attention_factor": 0.75}, {}),
    "mscale-pair": (32, 10000.0, {"factor": 16.0, "original_max_position_embeddings": 128, "mscale": 0.707,
                                  "mscale_all_dim": 0.5}, {}),
    "no-truncate": (64, 1e6, {"factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False}, {}),
    "orig-from-max-positions": (16, 10000.0, {"factor": 4.0}, {"max_position_embeddings": 200}),
    "orig-at-top-level": (16, 10000.0, {"factor": 4.0, "original_max_position_embeddings": 512},
                          {"original_max_position_embeddings": 96}),
}


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("setting", SETTINGS, ids=SETTINGS.keys())
def test_target_tables_equal_transformers(tmp_path, setting, spelling):
    head_dim, theta, yarn, top = SETTINGS[setting]
    folder = _write_config(tmp_path, head_dim, theta, spelling, yarn, top)
    original = (top.get("original_max_position_embeddings") or yarn.get("original_max_position_embeddings")
                or top.get("max_position_embeddings"))
    assert load_target_config(folder).yarn.original_max_position_embeddings == original
    assert _tables_equal(folder, original, torch.float32)
    assert _tables_equal(folder, original, torch.bfloat16)


def test_yarn_fields_read():
    """What the reader keeps of a config: defaults, both spellings, the original context's priority."""
    from dflash_iree.rope import rope_scaling, rope_theta

    path = Path("config.json")
    assert rope_scaling({"rope_scaling": None, "rope_theta": 1e6}, path) is None
    assert rope_scaling({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, path) is None
    y = rope_scaling({"rope_scaling": {"type": "yarn", "factor": 4}, "max_position_embeddings": 40960}, path)
    assert y == YaRN(factor=4.0, original_max_position_embeddings=40960)
    assert rope_scaling({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, path).original_max_position_embeddings == 32768
    assert rope_theta({"rope_scaling": {"type": "yarn", "factor": 4}, "rope_theta": 5e5}, path) == 5e5
    assert rope_theta({"rope_parameters": {"rope_type": "yarn", "factor": 4, "rope_theta": 7e5}}, path) == 7e5
    assert YaRN(4.0, 32768).cos_sin_scale() == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert YaRN(1.0, 32768).cos_sin_scale() == 1.0 and YaRN(4.0, 32768, attention_factor=0.5).cos_sin_scale() == 0.5


def test_context_limit_is_original_times_factor(tmp_path):
    """vLLM's rule: a YaRN target's context is original x factor when that exceeds max_position_embeddings."""
    head_dim, theta, yarn, top = SETTINGS["qwen3-128k"]
    cfg = load_target_config(_write_config(tmp_path / "y", head_dim, theta, "rope_scaling", yarn, top))
    assert cfg.max_position_embeddings == 40960 and cfg.context_limit()[0] == 131072
    assert "original_max_position_embeddings 32768 x factor 4" in cfg.context_limit()[1]
    small = load_target_config(_write_config(tmp_path / "s", 16, 1e4, "rope_scaling", {"factor": 2.0,
                                             "original_max_position_embeddings": 256}, {"max_position_embeddings": 1024}))
    assert small.context_limit() == (1024, "the target's max_position_embeddings")


def test_compile_plan_takes_the_yarn_context(yarn_drafters):
    """compile's --max-context range: up to original x factor for a YaRN target (1024 here, the tiny
    target's max_position_embeddings; 256 x 8 = 2048 with factor 8), refused past it by that name."""
    from dflash_iree.export.compile import plan

    target, drafter = yarn_drafters["yarn-target"]
    assert plan(target, drafter, max_context=1024).max_context == 1024
    with pytest.raises(DFlashError, match=r"--max-context 2048 is out of range: .* 1024 \(the target's max_position"):
        plan(target, drafter, max_context=2048)
    raw = json.loads((target / "config.json").read_text())
    wider = target.parent / "target-f8"
    shutil.copytree(target, wider)
    raw["rope_parameters"]["factor"] = 8.0
    (wider / "config.json").write_text(json.dumps(raw))
    assert plan(wider, drafter, max_context=2048).max_context == 2048
    with pytest.raises(DFlashError, match=r"2080 is out of range: .* 2048 \(YaRN's original_max_position_embeddings "
                                          r"256 x factor 8\)"):
        plan(wider, drafter, max_context=2080)


def _no_mscale(monkeypatch):
    monkeypatch.setattr(YaRN, "cos_sin_scale", lambda self: 1.0)


def _no_ramp(monkeypatch):  # every dim interpolated: position interpolation, not YaRN
    def interpolated(yarn, dim, theta, device=None):
        return 1.0 / (yarn.factor * theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))

    monkeypatch.setattr(export_rope, "yarn_inv_freq", interpolated)


BROKEN = {"no-mscale": _no_mscale, "no-ramp": _no_ramp}


@pytest.mark.parametrize("broken", BROKEN, ids=BROKEN.keys())
def test_planted_control_tables_differ(tmp_path, monkeypatch, broken):
    """The table check bites: without the attention factor, or without the ramp, the tables differ."""
    for setting in ("qwen3-128k", "f8-orig64-betas"):
        head_dim, theta, yarn, top = SETTINGS[setting]
        folder = _write_config(tmp_path / setting, head_dim, theta, "rope_parameters", yarn, top)
        original = yarn["original_max_position_embeddings"]
        assert _tables_equal(folder, original)
        with monkeypatch.context() as m:
            BROKEN[broken](m)
            assert not _tables_equal(folder, original)


# ---- a tiny YaRN target against transformers' Qwen3ForCausalLM


@pytest.fixture(scope="module")
def yarn_target(tmp_path_factory) -> Path:
    """The tiny target (head_dim 16, max_position_embeddings 1024) with YaRN factor 4 over 256 positions."""
    return make_target(tmp_path_factory.mktemp("yarn") / "target", seed=5, rope_scaling=dict(YARN_TARGET))


@pytest.fixture(scope="module")
def yarn_target_old_spelling(yarn_target, tmp_path_factory) -> Path:
    """The same checkpoint, its config.json in the old spelling (rope_scaling with `type`, rope_theta on top)."""
    folder = tmp_path_factory.mktemp("yarn-old") / "target"
    shutil.copytree(yarn_target, folder)
    raw = json.loads((folder / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@torch.no_grad()
def _logits(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') float32 logits [1, 330, 512] of 330 random tokens, ours run in pieces
    (prefill 200, 13, 1, 100, 16) through the KV cache: positions up to 329, past the original 256."""
    hf = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_target(folder, 512)
    tokens = torch.randint(0, 512, (1, 330), generator=torch.Generator().manual_seed(4))
    ref = hf(tokens).logits
    pieces, start = [], 0
    for size in (200, 13, 1, 100, 16):
        pieces.append(ours(tokens[:, start:start + size], torch.tensor([start]))[1])
        start += size
    return torch.cat(pieces, 1), ref


def _logit_error(folder: Path) -> float:
    """max |ours - transformers| / max(1, max |transformers|) of `_logits`."""
    got, ref = _logits(folder)
    return ((got - ref).abs().max() / max(1.0, ref.abs().max().item())).item()


TOLERANCE = 1e-4  # float32 summation order, as tests/test_target.py


def test_target_logits_match_transformers(yarn_target, yarn_target_old_spelling):
    assert load_target_config(yarn_target).yarn == YaRN(4.0, 256)
    assert load_target_config(yarn_target_old_spelling).yarn == YaRN(4.0, 256)
    for folder in (yarn_target, yarn_target_old_spelling):
        got, ref = _logits(folder)
        assert (got - ref).abs().max().item() <= TOLERANCE * max(1.0, ref.abs().max().item())
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("broken", BROKEN, ids=BROKEN.keys())
def test_planted_control_target_logits_differ(yarn_target, monkeypatch, broken):
    BROKEN[broken](monkeypatch)
    assert _logit_error(yarn_target) > 100 * TOLERANCE


# ---- YaRN drafters


@pytest.fixture(scope="module")
def yarn_drafters(target_dir, yarn_target, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """(target, drafter) pairs: v1 and DFlash2 YaRN drafters (factor 4 over 16 positions, old
    spelling; the v1 one also in the new spelling) for the plain tiny target, and a YaRN drafter for
    the YaRN target."""
    root = tmp_path_factory.mktemp("yarn-drafters")
    new = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 16}}
    return {
        "v1": (target_dir, make_drafter(root / "v1", target_dir, seed=3, rope_scaling=dict(YARN_DRAFTER))),
        "v1-rope_parameters": (target_dir, make_drafter(root / "v1-new", target_dir, seed=3, **new)),
        "dflash2": (target_dir, make_dflash2_drafter(root / "v2", target_dir, seed=4, rope_scaling=dict(YARN_DRAFTER))),
        "yarn-target": (yarn_target, make_drafter(root / "for-yarn", yarn_target, seed=6,
                                                  rope_scaling=dict(YARN_DRAFTER))),
    }


@pytest.mark.parametrize("name", ["v1", "v1-rope_parameters", "dflash2"])
def test_drafter_tables_equal_transformers(yarn_drafters, name):
    """What the z-lab reference drafter computes: Qwen3RotaryEmbedding of the drafter's own config."""
    target, drafter = yarn_drafters[name]
    cfg = load_drafter_config(drafter, load_target_config(target))
    assert cfg.yarn == YaRN(4.0, 16) and (cfg.dflash2 is not None) == (name == "dflash2")
    pos = _positions(16)
    for dtype in (torch.float32, torch.bfloat16):
        ours, ref = _ours(drafter, pos, dtype, drafter_of=target), _hf_tables(drafter, pos, dtype)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def _rounds_error(target_dir: Path, drafter_dir: Path) -> float:
    """max |cached rounds - from-scratch forward| of tests/test_drafter.py's check (positions 0..32,
    past the drafter's original 16), with whatever `test_drafter._rope` rotates by."""
    target, drafter = load_pair(target_dir, drafter_dir, 128)
    tokens = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, _, taps = target(tokens, torch.tensor([0]))
        drafter.absorb(taps[:, :17], torch.tensor([0]))
        drafter(target, taps[:, 17:20], torch.tensor([17]), torch.tensor([3]), tokens[:, 20])
        _, logits = drafter(target, taps[:, 20:25], torch.tensor([20]), torch.tensor([5]), tokens[:, 25])
    ref = test_drafter.reference_draft(target, drafter, taps[0, :25], int(tokens[0, 25]), 511)
    return (logits[0] - ref).abs().max().item()


def _hf_rope(drafter_dir: Path):
    """test_drafter._rope's signature, rotating by transformers' YaRN tables of the drafter's config."""
    rotary = Qwen3RotaryEmbedding(Qwen3Config.from_pretrained(drafter_dir))

    def rope(x, pos):  # x [N, H, hd], pos [N]
        cos, sin = rotary(x, pos[None])
        return apply_rotary_pos_emb(x, x, cos[0], sin[0], unsqueeze_dim=1)[0]

    return rope


def test_drafter_rounds_match_reference_with_yarn(yarn_drafters, monkeypatch):
    """The v1 drafter's cached rounds (absorb, two rounds) against the reference-way from-scratch
    forward rotated by transformers; the plain-RoPE reference (the planted control) must not match."""
    target, drafter = yarn_drafters["v1"]
    plain = _rounds_error(target, drafter)
    monkeypatch.setattr(test_drafter, "_rope", _hf_rope(drafter))
    assert _rounds_error(target, drafter) < 1e-4
    assert plain > 1e-2


@pytest.mark.parametrize("name, sampling", [("v1", "greedy"), ("dflash2", "t1-seed3"), ("yarn-target", "greedy"),
                                             ("yarn-target", "t1-seed3")])
def test_drafted_equals_plain_with_yarn(yarn_drafters, name, sampling):
    """tests/test_exactness.py's check (a random and a scripted drafter, every accepted length) on pairs
    with YaRN drafters, past their original context; positions reach about 100."""
    assert run_exactness(load_pair(*yarn_drafters[name], 512), accept_length, 30, SAMPLINGS[sampling]) == []


def test_drafted_equals_plain_planted_control(yarn_drafters):
    """The same check bites on a YaRN pair: an acceptance rule that keeps one rejected draft fails it."""
    failures = run_exactness(load_pair(*yarn_drafters["yarn-target"], 512), broken_accept, 30, SAMPLINGS["greedy"])
    assert any("measured accepted" in f for f in failures)


# ---- refusals and the manifest guard


REFUSED = [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling\.rope_type 'linear' is not implemented"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_scaling\.rope_type 'dynamic' is not implemented"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     r"rope_parameters\.rope_type 'llama3' is not implemented \(plain RoPE and yarn are\)"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, r"rope_parameters\.rope_type 'longrope'"),
    ({"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 256}},
     r"rope_scaling\.factor is missing; YaRN needs it"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": "4"}},
     r"rope_parameters\.factor is '4'; it must be a number > 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": "big"}},
     r"rope_scaling\.original_max_position_embeddings is 'big'; it must be an integer >= 1"),
]


@pytest.mark.parametrize("edit, message", REFUSED,
                         ids=["linear", "dynamic", "llama3", "longrope", "no-factor", "factor-str", "original-str"])
@pytest.mark.parametrize("scope", ["target", "drafter"])
def test_refusals_name_file_and_field(target_dir, drafter_dir, tmp_path, scope, edit, message):
    folder = tmp_path / scope
    shutil.copytree(target_dir if scope == "target" else drafter_dir, folder)
    raw = {**json.loads((folder / "config.json").read_text()), **edit}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DFlashError, match=message) as e:
        if scope == "target":
            load_target_config(folder)
        else:
            load_drafter_config(folder, load_target_config(target_dir))
    assert "\n" not in str(e.value) and str(folder / "config.json") in str(e.value)


def test_guard_compares_yarn(target_dir, yarn_target):
    """A manifest compiled with plain RoPE (written before the yarn field existed, or with it null)
    does not serve a YaRN checkpoint of the same shapes, nor one YaRN setting another."""
    plain, yarn = load_target_config(target_dir).to_dict(), load_target_config(yarn_target).to_dict()
    old = {k: v for k, v in plain.items() if k != "yarn"}
    manifest_yarn = json.loads(json.dumps(yarn))  # as read back from manifest.json

    def problems(recorded, found):
        return guard._differences("target", guard.TARGET_FIELDS, recorded, found, yarn_target)

    assert problems(manifest_yarn, yarn) == [] and problems(old, plain) == [] and problems(plain, plain) == []
    (line,) = problems(old, yarn)
    assert line.startswith("  target yarn: {'factor': 4.0") and line.endswith("None in the manifest")
    assert len(problems(plain, yarn)) == 1
    other = {**yarn, "yarn": {**yarn["yarn"], "factor": 2.0}}
    assert len(problems(manifest_yarn, other)) == 1


def test_plain_rope_graph_unchanged():
    """Without scaling the tables are computed as before YaRN existed: no scale multiply in the
    exported graph (the committed per-arch records compare compiled modules)."""

    def before(positions, head_dim, theta, dtype):  # export/qwen3.py rope_tables before YaRN, verbatim
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
                                    / head_dim))
        freqs = positions[..., None].to(torch.float32) * inv_freq
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    class Tables(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, positions):
            return self.fn(positions, 16, 1e6, torch.bfloat16)

    pos = torch.arange(8)[None] + 3
    graphs = [torch.export.export(Tables(fn), (pos,)).graph_module.code for fn in (before, rope_tables)]
    assert graphs[0] == graphs[1]
