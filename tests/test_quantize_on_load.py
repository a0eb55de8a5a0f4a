"""Quantize on load compiled (issue #28): `dflash-iree compile --target-bits 4 --drafter-bits 4` of the
tiny float32 pair (one artifact for the module, compiled once), the runtime quantizing the float
safetensors as it binds them (runtime/quantize_on_load.py).

- The runtime's NumPy rule equals the eager loader's (export/quantized.py `quantize_on_load`, torch
  casts) bit for bit, on random weights with constant, zero, negative and sub-step groups, for
  stored / compute dtypes f32 and bf16.
- The module is built as for an MLX-written checkpoint of the geometry (same parameter keys, shapes
  and dtypes for the linears), its manifest records the quantization and its source, and the export
  key tells it apart.
- Compiled == eager with the same options, token for token in f32, greedy and seeded T = 1, drafted
  and plain (the target's packed layers), and the first draft's top-K ids and log-probs (the
  drafter's). Planted: a quantizer that drops the bias fails both, and matches the eager reference
  with that same bug (quantized.PLANTED = "no-bias").
- The cache: made on the first load, bound again without quantizing, made again when the source is
  rewritten, when the file is cut off or altered, or for another rule; never half-written; off, it
  quantizes in memory.
- Refusals, one line and exit status 2: bits for a checkpoint already 4-bit, for a hybrid target, a
  GPU arch with f32 scales; at load, a 4-bit checkpoint for a module that quantizes a float one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from badinput import assert_refused, cli
from test_exactness import PROMPTS, SAMPLINGS
from test_runtime import _kw, first_draft_topk

from dflash_iree.checkpoint import sha256_file
from dflash_iree.errors import DFlashError
from dflash_iree.export import quantized
from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import generate_plain
from dflash_iree.runtime import quantize_on_load as qol
from dflash_iree.runtime.engine import Engine

BITS = dict(target_bits=4, drafter_bits=4)


@pytest.fixture(scope="module")
def on_load_artifacts(tmp_path_factory, target_dir, drafter_dir) -> Path:
    """The tiny float32 pair compiled for the host with --target-bits 4 --drafter-bits 4 (block 8,
    max_context 256), once for this module; the compile's log beside the folder (`compile.log`)."""
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = tmp_path_factory.mktemp("compiled-on-load") / "host"
    with open(out.parent / "compile.log", "w") as log:
        compile_artifacts("host", target_dir, drafter_dir, out, max_context=256, log=Progress(log), **BITS)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh $DFLASH_IREE_CACHE for the test (the quantized tensors go to its quantized/)."""
    monkeypatch.setenv("DFLASH_IREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "quantized"


@pytest.fixture(scope="module")
def engine(on_load_artifacts, tmp_path_factory) -> Engine:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_IREE_CACHE", str(tmp_path_factory.mktemp("cache")))
        return Engine.load(on_load_artifacts)


@pytest.fixture(scope="module")
def eager(target_dir, drafter_dir):
    return load_pair(target_dir, drafter_dir, 256, "f32", **BITS)


# --- the rule: NumPy (runtime) == torch (eager), bit for bit --------------------------------------

def _weights(seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights [N, 128] whose groups of 64 include the edge cases: constant, all
    zero, all negative, a range below bf16's smallest step, and large magnitudes."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 128)).astype(np.float32)
    a[0, :64] = 0.0
    a[1, 64:] = -3.25
    a[2] = -np.abs(a[2]) - 1.0
    a[3, :64] = 0.0
    a[3, 5] = 1e-40
    a[4] *= 1e4
    a[5, :64] = np.linspace(-1, 1, 64)  # values on the half steps: round-half-even in both
    b = rng.uniform(-0.02, 0.02, (8, 192)).astype(np.float32)
    return {"a": a, "b": b}


def _eager_quantized(weights: dict, stored: str, compute: str) -> dict:
    """quantize_on_load's tensors (as the eager loader makes them: the stored tensor cast to the
    compute dtype by torch, scales and biases in the stored dtype), as numpy bits."""
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}
    module = torch.nn.Module()
    for name, w in weights.items():
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dt[compute])
        lin.weight.data = torch.from_numpy(w).to(dt[stored]).to(dt[compute])
        module.add_module(name, lin)
    quantized.quantize_on_load(module, dt[stored])
    out = {}
    for name in weights:
        q = getattr(module, name)
        out[f"{name}.weight"] = q.weight.numpy().view(np.uint32)
        for role in ("scales", "biases"):
            t = getattr(q, role)
            out[f"{name}.{role}"] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return out


@pytest.mark.parametrize("stored,compute", [("f32", "f32"), ("bf16", "f32"), ("f32", "bf16"), ("bf16", "bf16")])
def test_numpy_rule_equals_eager_bit_for_bit(tmp_path, stored, compute):
    from safetensors.torch import save_file

    weights = _weights(seed=len(stored) + len(compute))
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}
    save_file({f"{n}.weight": torch.from_numpy(w).to(dt[stored]) for n, w in weights.items()},
              str(tmp_path / "model.safetensors"))
    spec = qol.OnLoad({n: w.shape for n, w in weights.items()}, 64, compute, stored)
    ours = qol.quantize(tmp_path, spec)
    want = _eager_quantized(weights, stored, compute)
    assert set(ours) == set(want) == spec.keys()
    for key, (dtype, array) in ours.items():
        bits = array.view(np.uint32 if dtype in ("u32", "f32") else np.int16)
        np.testing.assert_array_equal(bits, want[key].view(bits.dtype), err_msg=key)
    scales, biases = ours["a.scales"][1].astype(np.float32), ours["a.biases"][1].astype(np.float32)
    assert scales[0, 0] == 1 and biases[0, 0] == 0  # all zero: scale 1, as a constant group
    assert scales[1, 1] == 1 and biases[1, 1] == -3.25
    assert np.isfinite(scales).all() and (scales > 0).all() and (biases[2] < 0).all()
    if stored == "bf16":  # a range below bf16's smallest step: a scale of 0 would divide by zero
        assert scales[3, 0] == 1 and biases[3, 0] == 0


# --- the module, its manifest, its export key --------------------------------------------------

def test_module_is_built_as_for_an_mlx_checkpoint(target_dir, drafter_dir, quant_dirs):
    """The linears of a target quantized on load have the parameters an MLX-written checkpoint of the
    same geometry gives (mlx-lm packs the embedding and lm_head too; quantize on load does not)."""
    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export import aot

    def table(target, drafter, on_load=()):
        tcfg = load_target_config(target)
        pair = aot.build_pair(tcfg, load_drafter_config(drafter, tcfg), 256, 8, 1, torch.float32, 8, "matmul",
                              on_load=on_load)
        return aot.parameter_table(pair)

    ours = table(target_dir, drafter_dir, on_load=("target",))
    mlx = table(quant_dirs["mlx"], quant_dirs["drafter"])
    linears = {k: v for k, v in mlx["target"].items() if k.startswith("model.layers.")}
    assert {k: ours["target"][k] for k in linears} == linears
    assert any(v["dtype"] == "u32" for v in linears.values())
    assert ours["target"]["model.embed_tokens.weight"]["dtype"] == "f32"
    assert ours["drafter"] == table(target_dir, drafter_dir)["drafter"]  # the drafter as stored
    drafter_only = table(target_dir, drafter_dir, on_load=("drafter",))
    assert drafter_only["target"] == table(target_dir, drafter_dir)["target"]
    assert drafter_only["drafter"]["fc.weight"] == {"shape": [64, 16], "dtype": "u32"}


def test_manifest_records_quantize_on_load(on_load_artifacts, target_dir):
    m = json.loads((on_load_artifacts / "manifest.json").read_text())
    for scope, layers in (("target", 28), ("drafter", 1 + 6 * 2)):  # the drafter's down_proj: K = 96
        q = m[scope]["quantization"]
        assert (q["method"], q["bits"], q["group_size"]) == ("mlx-affine", 4, 64)
        assert "symmetric" not in q  # compressed-tensors' field
        assert len(q["layers"]) == layers and "lm_head" not in q["layers"]
        assert q["on_load"]["rule"] == 1 and q["on_load"]["scale_dtype"] == "f32"
    source = m["target"]["quantization"]["on_load"]["source"]["files"]["model.safetensors"]
    path = target_dir / "model.safetensors"
    assert source == {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    assert m["parameters"]["target"]["model.layers.0.mlp.up_proj.weight"] == {"shape": [128, 8], "dtype": "u32"}
    assert m["parameters"]["target"]["model.layers.0.mlp.up_proj.scales"] == {"shape": [128, 1], "dtype": "f32"}


def test_compile_log_says_4bit_once(on_load_artifacts):
    lines = (on_load_artifacts.parent / "compile.log").read_text().splitlines()
    said = [line for line in lines if "4-bit" in line]
    on_load = "mlx-affine, group 64, quantized on load from the float checkpoint by the runtime"
    assert len(said) == 1 and said[0].endswith(f"] 4-bit: target {on_load} (--target-bits 4); drafter {on_load} "
                                               "(--drafter-bits 4)"), lines


def test_export_key_includes_quantize_on_load(target_dir, drafter_dir):
    from dflash_iree.export.compile import export_key, plan

    keys = {bits: export_key(plan(target_dir, drafter_dir, max_context=256, attention="matmul",
                                  **({f"{bits}_bits": 4} if bits else {})))
            for bits in (None, "target", "drafter")}
    assert len(set(keys.values())) == 3


# --- compiled == eager ---------------------------------------------------------------------------

def _first_draft_topk(engine, target, drafter, prompt):
    """The first round's draft top-K (T = 0.7, K = 8) of the compiled module and of the eager
    drafter: ((ids, log-probs) compiled, (ids, log-probs) eager), torch tensors [B - 1, 8]."""
    compiled, _, (ids, lps) = first_draft_topk(engine, target, drafter, prompt)
    return compiled, (ids[0], lps[0])


def _draft_matches(compiled, eager) -> bool:
    (ids, lps), (want_ids, want_lps) = compiled, eager
    return torch.equal(ids, want_ids) and (lps - want_lps).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
def test_compiled_equals_eager(engine, eager, target_dir, drafter_dir, name):
    s = SAMPLINGS[name]
    for prompt in PROMPTS:
        ref = generate_plain(eager[0], prompt, 40, s).tokens
        assert engine.generate(prompt, 40, speculative=False, **_kw(s)).tokens == ref
        assert engine.generate(prompt, 40, **_kw(s)).tokens == ref
    # the 4-bit weights are what the module reads, not the float ones
    float_target = load_pair(target_dir, drafter_dir, 256, "f32")[0]
    assert ref != generate_plain(float_target, prompt, 40, s).tokens


def test_compiled_draft_equals_eager_drafter(engine, eager):
    for prompt in PROMPTS[:2]:
        assert _draft_matches(*_first_draft_topk(engine, *eager, prompt))


def test_planted_quantizer_without_bias_is_caught(on_load_artifacts, eager, target_dir, drafter_dir, cache,
                                                  monkeypatch):
    monkeypatch.setattr(qol, "PLANTED", "no-bias")
    broken = Engine.load(on_load_artifacts)
    s = SAMPLINGS["greedy"]
    got = [broken.generate(p, 30, speculative=False, **_kw(s)).tokens for p in PROMPTS]
    draft = _first_draft_topk(broken, *eager, PROMPTS[1])
    assert got != [generate_plain(eager[0], p, 30, s).tokens for p in PROMPTS]  # the checks fail it
    assert not _draft_matches(*draft)
    monkeypatch.setattr(quantized, "PLANTED", "no-bias")  # and it is that bug
    planted = load_pair(target_dir, drafter_dir, 256, "f32", **BITS)
    assert got == [generate_plain(planted[0], p, 30, s).tokens for p in PROMPTS]
    assert _draft_matches(draft[0], _first_draft_topk(broken, *planted, PROMPTS[1])[1])


# --- the cache -----------------------------------------------------------------------------------

def _files(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cache.glob("*.safetensors")} if cache.is_dir() else {}


def test_cache_is_made_then_reused(on_load_artifacts, cache, monkeypatch):
    Engine.load(on_load_artifacts)
    made = _files(cache)
    assert len(made) == 2 and not list(cache.glob(".*"))  # target and drafter, no partial left

    def no_quantizing(*_):
        raise AssertionError("quantized again")

    monkeypatch.setattr(qol, "quantize", no_quantizing)
    engine = Engine.load(on_load_artifacts)
    assert _files(cache) == made
    assert len(engine.generate(PROMPTS[0], 8).tokens) == 8


def test_the_cli_says_when_it_quantizes_and_when_it_reuses(on_load_artifacts, target_dir, drafter_dir, cache, capsys,
                                                           monkeypatch):
    """One line per scope on stderr: made now (the layers, group, seconds and the cache file), then
    on the next load reused from that file; with the cache off, made in memory."""
    args = ("generate", "--artifacts", on_load_artifacts, "--prompt-ids", "7 300 12", "--max-new-tokens", "4",
            "--quiet")
    rc, _, err = cli(capsys, *args)
    assert rc == 0, err
    made = [line for line in err.splitlines() if "quantized to 4 bits on load" in line]
    assert [line.split(":")[0] for line in made] == ["dflash-iree"] * 2, err
    assert made[0].startswith(f"dflash-iree: the target {target_dir.resolve()}: quantized to 4 bits on load (28 "
                              "linears, group 64) in ")
    assert made[1].startswith(f"dflash-iree: the drafter {drafter_dir.resolve()}: quantized to 4 bits on load (13 ")
    assert all(f"s, cached as {cache.resolve()}/" in line for line in made), made
    rc, _, err = cli(capsys, *args)
    assert rc == 0 and "quantized to 4 bits" not in err, err
    reused = [line for line in err.splitlines() if "is reused from the cache" in line]
    assert len(reused) == 2 and reused[0].startswith(f"dflash-iree: the target {target_dir.resolve()}: its 4-bit copy")
    monkeypatch.setenv("DFLASH_IREE_CACHE", "off")
    rc, _, err = cli(capsys, *args)
    assert rc == 0 and sum(line.endswith("in memory (DFLASH_IREE_CACHE=off)") for line in err.splitlines()) == 2, err


def _rewrite(folder: Path, scale: float) -> None:
    """Rewrite the checkpoint's safetensors in place (same keys, shapes and size), its linears scaled."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for key in tensors:
        if key.endswith("proj.weight"):
            tensors[key] = tensors[key] * scale
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_cache_is_made_again_when_the_source_changes(on_load_artifacts, target_dir, drafter_dir, cache, tmp_path):
    target = Path(shutil.copytree(target_dir, tmp_path / "target"))
    Engine.load(on_load_artifacts, target=target)
    before = _files(cache)
    _rewrite(target, 1.5)
    engine = Engine.load(on_load_artifacts, target=target)
    after = _files(cache)
    assert set(after) == set(before) and after != before  # the target's file, made again in place
    s = SAMPLINGS["greedy"]
    rewritten = load_pair(target, drafter_dir, 256, "f32", **BITS)[0]
    for prompt in PROMPTS[:2]:
        assert engine.generate(prompt, 30, **_kw(s)).tokens == generate_plain(rewritten, prompt, 30, s).tokens


@pytest.mark.parametrize("damage", ["flip", "cut", "rule"])
def test_stale_or_corrupt_cache_is_made_again(on_load_artifacts, eager, cache, damage, monkeypatch):
    Engine.load(on_load_artifacts)
    victim = max(cache.glob("*.safetensors"), key=lambda p: p.stat().st_size)  # the target's
    original = victim.read_bytes()
    if damage == "flip":
        victim.write_bytes(original[:-5] + bytes([original[-5] ^ 0x10]) + original[-4:])
    elif damage == "cut":
        victim.write_bytes(original[:len(original) // 2])
    else:
        monkeypatch.setattr(qol.quant, "ON_LOAD_RULE", 2)
    engine = Engine.load(on_load_artifacts)
    if damage == "rule":
        assert victim.read_bytes() != original
    else:
        assert victim.read_bytes() == original  # made again, as it was
    spec = qol.on_load(engine.artifacts.manifest, "target")
    assert qol.fits(victim, qol.record(engine.artifacts.target_folder, spec), spec)
    s = SAMPLINGS["greedy"]
    assert engine.generate(PROMPTS[0], 30, **_kw(s)).tokens == generate_plain(eager[0], PROMPTS[0], 30, s).tokens


def test_interrupted_cache_write_leaves_no_file(on_load_artifacts, cache, monkeypatch):
    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(qol.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Engine.load(on_load_artifacts)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_cache_off_quantizes_in_memory(on_load_artifacts, eager, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_IREE_CACHE", "off")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    engine = Engine.load(on_load_artifacts)
    s = SAMPLINGS["t1-seed3"]
    assert engine.generate(PROMPTS[0], 20, **_kw(s)).tokens == generate_plain(eager[0], PROMPTS[0], 20, s).tokens
    assert not any(tmp_path.rglob("*.safetensors"))


def test_unwritable_cache_warns_with_resolved_paths(on_load_artifacts, target_dir, drafter_dir, monkeypatch,
                                                   tmp_path):
    """A cache that cannot be written warns once per scope, naming the checkpoint and the cache file
    by their resolved paths (a checkpoint found relative to the artifacts is a `..` path), and
    quantizes in memory."""
    from dflash_iree.guard import DFlashWarning

    (tmp_path / "sub").mkdir()
    (tmp_path / "blocked").write_text("a file where the cache folder would be")
    monkeypatch.setenv("DFLASH_IREE_CACHE", str(tmp_path / "sub" / ".." / "blocked"))
    winding = tmp_path / "sub" / ".." / "sub" / os.path.relpath(target_dir, tmp_path / "sub")
    with pytest.warns(DFlashWarning) as caught:
        engine = Engine.load(on_load_artifacts, target=winding, drafter=drafter_dir)
    said = [str(w.message) for w in caught if "cannot write the quantized" in str(w.message)]
    assert len(said) == 2 and not any("/../" in m or "/./" in m for m in said), said
    cache = (tmp_path / "blocked" / "quantized").resolve()
    assert f"cannot write the quantized {target_dir.resolve()} to {cache}/" in said[0]
    assert len(engine.generate(PROMPTS[0], 8).tokens) == 8


def test_compile_help_says_what_the_bits_options_do(capsys):
    rc, out, _ = cli(capsys, "compile", "--help")
    text = " ".join(out.split())  # argparse wraps the lines
    assert rc == 0 and "only config.json is read" not in text
    for scope in ("target", "drafter"):
        assert f"--{scope}-bits BITS 4: build the {scope} as an MLX-format 4-bit module (affine, group 64, for" in text
        assert f"with --{scope}-bits 4 each safetensors file is hashed for the manifest" in text
    assert "the runtime quantizes the float weights when it binds them" in text


# --- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--target-bits", "--drafter-bits"])
def test_bits_on_a_4bit_checkpoint_is_refused(quant_dirs, option, capsys, tmp_path):
    target, drafter = quant_dirs["float"], quant_dirs["drafter"]
    if option == "--target-bits":
        target = quant_dirs["mlx"]
    else:  # a drafter whose config.json says MLX 4-bit: refused before any tensor is read
        drafter = Path(shutil.copytree(drafter, tmp_path / "drafter"))
        cfg = json.loads((drafter / "config.json").read_text())
        (drafter / "config.json").write_text(json.dumps({**cfg, "quantization": {"group_size": 64, "bits": 4}}))
    scope = option[2:].split("-")[0]
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "compile", "--target", target, "--drafter", drafter, "--out", out, option, "4")
    assert_refused(rc, err, f"{option} 4: the {scope} checkpoint", "is already 4-bit", f"leave {option} out")
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_bits_on_a_hybrid_target_is_refused(hybrid_pair, capsys, tmp_path):
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "compile", "--target", hybrid_pair[0], "--drafter", hybrid_pair[1], "--out", out,
                     "--target-bits", "4")
    assert_refused(rc, err, "--target-bits is not implemented for", "Qwen3.5-family", "leave it out")
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_gpu_arch_refuses_float32_scales_on_load(target_dir, drafter_dir, capsys, tmp_path):
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "compile", "--arch", "sm_80", "--dtype", "bf16", "--target", target_dir, "--drafter",
                     drafter_dir, "--out", out, "--drafter-bits", "4")
    assert_refused(rc, err, "--drafter-bits 4", "is f32", "reads bf16 ones", "--arch host")
    assert len(err.strip().splitlines()) == 1 and "warning" not in err and not out.exists()  # no --dtype warning first


def test_runtime_refuses_a_4bit_checkpoint_for_quantize_on_load(on_load_artifacts, quant_dirs, drafter_dir):
    with pytest.raises(DFlashError) as e:
        Engine.load(on_load_artifacts, target=quant_dirs["mlx"], drafter=drafter_dir)
    msg = str(e.value)
    assert "\n" not in msg and "compiled to quantize a float target on load" in msg and "--target-bits" in msg


def test_runtime_names_a_float_weight_of_the_wrong_shape(on_load_artifacts, target_dir, drafter_dir, tmp_path):
    from quant_writers import cut_tensor

    cut = cut_tensor(target_dir, tmp_path / "cut", "model.layers.1.mlp.up_proj.weight", 64)
    with pytest.raises(DFlashError, match=r"model.layers.1.mlp.up_proj.weight: expected shape \[128, 64\], "
                                          r"found \[64, 64\]"):
        Engine.load(on_load_artifacts, target=cut, drafter=drafter_dir)
