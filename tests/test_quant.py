"""4-bit weights (issue #28) in the eager reference: MLX affine and compressed-tensors checkpoints
written by their own libraries (tests/quant_writers.py), quantize on load, and the refusals.

- Our dequantized weights equal the format library's own dequantization (float32).
- A 4-bit target generates, greedy and seeded, the tokens of a float target holding the library's
  dequantized weights.
- Drafted == plain at 4-bit (an MLX target, a drafter quantized on load), greedy and seeded, with
  the planted acceptance control that must fail.
- Every refusal is one line with exit status 2, and a refused compile writes nothing (the compiled
  4-bit path: tests/test_quant_compile.py; quantize on load compiled: tests/test_quantize_on_load.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from badinput import assert_refused, cli
from quant_writers import cut_tensor, library_dequantized, write_compressed_tensors, write_mlx
from test_exactness import broken_accept, run_exactness
from tiny import make_drafter, make_target

from dflash_iree.errors import DFlashError
from dflash_iree.export.load import load_pair, load_target
from dflash_iree.export.quantized import QuantLinear
from dflash_iree.export.reference import SamplingConfig, generate_plain
from dflash_iree.acceptance import accept_length
from dflash_iree.quant import quantize_affine, unpack_nibbles

FORMATS = ("mlx", "ct_sym", "ct_asym")
SAMPLINGS = {"greedy": SamplingConfig(), "t1-seed3": SamplingConfig(temperature=1.0, seed=3)}


@pytest.fixture(scope="module")
def qdirs(tmp_path_factory) -> dict[str, Path]:
    """A bf16 tiny target, its bf16 drafter, and the target written 4-bit by each format's library."""
    root = tmp_path_factory.mktemp("quant")
    target = make_target(root / "bf16", dtype="bfloat16", seed=1)
    dirs = {"bf16": target, "drafter": make_drafter(root / "drafter", target, seed=1, dtype=torch.bfloat16)}
    dirs["mlx"] = write_mlx(target, root / "mlx")
    dirs["ct_sym"] = write_compressed_tensors(target, root / "ct_sym", symmetric=True)
    dirs["ct_asym"] = write_compressed_tensors(target, root / "ct_asym", symmetric=False)
    return dirs


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_weights_equal_the_librarys(qdirs, fmt):
    target = load_target(qdirs[fmt], 64, "f32")
    ref = library_dequantized(qdirs[fmt])
    ours = {n: m for n, m in target.named_modules() if isinstance(m, QuantLinear)}
    assert set(ours) == set(ref)
    expected = 30 if fmt == "mlx" else 28  # 7 linears x 4 layers, + embedding and lm_head in MLX
    assert len(ours) == expected
    for name, w in ref.items():
        torch.testing.assert_close(ours[name].dequantized(), w, rtol=0, atol=1e-6, msg=name)
    assert target.model.norm.weight.dtype == torch.float32


def _float_twin(qdirs, fmt):
    """The float target (f32) with every packed layer's weight set to the library's dequantization."""
    twin = load_target(qdirs["bf16"], 64, "f32")
    with torch.no_grad():
        for name, w in library_dequantized(qdirs[fmt]).items():
            twin.get_submodule(name).weight.copy_(w)
    return twin


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("fmt", FORMATS)
def test_4bit_target_generates_the_dequantized_reference(qdirs, fmt, sampling):
    quantized, twin = load_target(qdirs[fmt], 64, "f32"), _float_twin(qdirs, fmt)
    plain = load_target(qdirs["bf16"], 64, "f32")
    prompt = [5, 17, 300, 2]
    got = generate_plain(quantized, prompt, 24, sampling).tokens
    assert got == generate_plain(twin, prompt, 24, sampling).tokens
    assert got != generate_plain(plain, prompt, 24, sampling).tokens  # the 4-bit weights are what is read


def test_tied_mlx_target_loads_with_its_packed_embedding_as_lm_head(tmp_path):
    """mlx-lm writes a tied target without lm_head: the lm_head is the packed embedding, and the
    target generates the tokens of the float target holding the library's dequantized embedding."""
    tied = make_target(tmp_path / "tied", tie=True, dtype="bfloat16", seed=2)
    mlx = write_mlx(tied, tmp_path / "mlx")
    target = load_target(mlx, 64, "f32")
    assert isinstance(target.lm_head, QuantLinear) and target.lm_head.weight is target.model.embed_tokens.weight
    twin = load_target(tied, 64, "f32")
    with torch.no_grad():
        for name, w in library_dequantized(mlx).items():
            twin.get_submodule(name).weight.copy_(w)
    for sampling in SAMPLINGS.values():
        assert generate_plain(target, [5, 17, 300, 2], 24, sampling).tokens == \
            generate_plain(twin, [5, 17, 300, 2], 24, sampling).tokens


def test_quantize_on_load_bound_and_layers(qdirs):
    target, drafter = load_pair(qdirs["bf16"], qdirs["drafter"], 64, "f32", target_bits=4, drafter_bits=4)
    float_target = load_target(qdirs["bf16"], 64, "f32")
    packed = {n for n, m in target.named_modules() if isinstance(m, QuantLinear)}
    assert "lm_head" not in packed and len(packed) == 28
    # fc and 6 linears a layer: the drafter's down_proj (K = 96, not a multiple of 64) stays float
    assert sum(isinstance(m, QuantLinear) for m in drafter.modules()) == 1 + 6 * 2
    assert isinstance(drafter.layers[0].mlp.down_proj, torch.nn.Linear)
    lin = target.get_submodule("model.layers.0.mlp.down_proj")
    w = float_target.get_submodule("model.layers.0.mlp.down_proj").weight
    half_step = lin.scales.float().repeat_interleave(64, -1) / 2
    assert ((lin.dequantized() - w).abs() <= half_step * 1.01 + 1e-6).all()


def test_quantize_affine_packs_as_mlx():
    """quantize_affine's layout is MLX's: mlx.dequantize reads it back to our dequantization."""
    import mlx.core as mx

    w = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    packed, scales, biases = quantize_affine(w, 64)
    ref = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=64, bits=4))
    ours = unpack_nibbles(packed) * np.repeat(scales, 64, -1) + np.repeat(biases, 64, -1)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def pair_4bit(qdirs):
    return load_pair(qdirs["mlx"], qdirs["drafter"], 512, "f32", drafter_bits=4)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_drafted_equals_plain_at_4bit(pair_4bit, sampling):
    assert run_exactness(pair_4bit, accept_length, 40, sampling) == []


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_planted_control_fails_at_4bit(pair_4bit, sampling):
    failures = run_exactness(pair_4bit, broken_accept, 40, sampling)
    assert any("random drafter" in f for f in failures)
    assert any("measured accepted" in f for f in failures)


# --- refusals ---------------------------------------------------------------------------------

def _copy_with(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in config.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _bad_folders(qdirs, tmp: Path) -> dict[str, tuple[Path, str]]:
    mlx_q = {"group_size": 64, "bits": 4, "mode": "affine"}
    cases = {
        "gptq": (_copy_with(qdirs["bf16"], tmp / "gptq", quantization_config={"quant_method": "gptq", "bits": 4}), "GPTQ"),
        "awq": (_copy_with(qdirs["bf16"], tmp / "awq", quantization_config={"quant_method": "awq", "bits": 4}), "AWQ"),
        "fp8": (_copy_with(qdirs["bf16"], tmp / "fp8", quantization_config={"quant_method": "fp8"}), "FP8"),
        "bits8": (_copy_with(qdirs["mlx"], tmp / "bits8", quantization={**mlx_q, "bits": 8}, quantization_config=None),
                  "accepted bits: 4"),
        "group16": (_copy_with(qdirs["mlx"], tmp / "group16", quantization={**mlx_q, "group_size": 16},
                               quantization_config=None), "group_size 16 is not supported"),
        "mismatch": (_copy_with(qdirs["mlx"], tmp / "mismatch", quantization_config={**mlx_q, "bits": 8}), "disagree"),
        "ct_bits8": (_copy_with(qdirs["ct_sym"], tmp / "ct_bits8", quantization_config=_ct_with(qdirs, num_bits=8)),
                     "accepted bits: 4"),
    }
    gguf = tmp / "gguf"
    gguf.mkdir()
    (gguf / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    cases["gguf"] = (gguf, "GGUF")
    return cases


def _ct_with(qdirs, **weights) -> dict:
    qc = json.loads((qdirs["ct_sym"] / "config.json").read_text())["quantization_config"]
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


@pytest.fixture(scope="module")
def bad(qdirs, tmp_path_factory):
    return _bad_folders(qdirs, tmp_path_factory.mktemp("bad_quant"))


CASES = ("gptq", "awq", "fp8", "gguf", "bits8", "group16", "mismatch", "ct_bits8")


@pytest.mark.parametrize("case", CASES)
def test_eager_refuses_by_name(bad, case, capsys):
    folder, needle = bad[case]
    rc, out, err = cli(capsys, "eager", "--target", folder, "--prompt-ids", "1 2", "--max-new-tokens", "2")
    assert_refused(rc, err, needle)
    assert len(err.strip().splitlines()) == 1 and out == ""


@pytest.mark.parametrize("case", CASES)
def test_compile_refuses_and_writes_nothing(bad, qdirs, case, capsys, tmp_path):
    folder, needle = bad[case]
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "compile", "--target", folder, "--drafter", qdirs["drafter"], "--out", out)
    assert_refused(rc, err, needle)
    assert not out.exists()


def test_packed_tensor_of_the_wrong_shape_is_refused(qdirs, tmp_path, capsys):
    key = "model.layers.1.mlp.up_proj.scales"
    folder = cut_tensor(qdirs["mlx"], tmp_path / "cut", key, 64)
    rc, _, err = cli(capsys, "eager", "--target", folder, "--prompt-ids", "1 2", "--max-new-tokens", "2")
    assert_refused(rc, err, key, "expected shape [128, 1], found [64, 1]", "quantize it again")


@pytest.mark.parametrize("option", ["--target-bits", "--drafter-bits"])
def test_other_bit_widths_are_refused_with_the_accepted_list(qdirs, option, capsys, tmp_path):
    rc, _, err = cli(capsys, "eager", "--target", qdirs["bf16"], "--drafter", qdirs["drafter"], "--prompt-ids", "1",
                     option, "3")
    assert_refused(rc, err, f"{option} 3 is not supported; accepted: 4")
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "compile", "--target", qdirs["bf16"], "--drafter", qdirs["drafter"], "--out", out, option, "8")
    assert_refused(rc, err, f"{option} 8 is not supported; accepted: 4")
    assert not out.exists()


def test_eager_cli_runs_a_4bit_pair(qdirs, capsys):
    rc, out, err = cli(capsys, "eager", "--target", qdirs["mlx"], "--drafter", qdirs["drafter"], "--drafter-bits", "4",
                       "--prompt-ids", "1 2 3", "--max-new-tokens", "8", "--json", "--dtype", "f32")
    assert rc == 0, err
    assert len(json.loads(out)["tokens"]) == 8


def test_load_target_refuses_bits_on_a_4bit_checkpoint(qdirs):
    with pytest.raises(DFlashError, match="already 4-bit"):
        load_target(qdirs["mlx"], 64, "f32", bits=4)
