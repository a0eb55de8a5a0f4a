"""4-bit weights (issue #28) through the compiled host path: MLX- and compressed-tensors-written
checkpoints (tests/quant_writers.py, via conftest's quant_dirs) compiled once per session
(quant_artifacts), their packed tensors bound from the safetensors as stored.

- compiled == eager (export/quantized.py's dequantized reference), token for token, f32
  activations, greedy and seeded, plain and drafted, for each format;
- drafted == plain at 4-bit with the scripted drafter (every accepted count), and the planted
  acceptance rule fails it;
- the planted dequantization: the module bound to a copy of the checkpoint whose biases (MLX) or
  zero points (compressed-tensors) are dropped leaves the eager reference's tokens, and matches
  the eager reference with that same bug (quantized.PLANTED = "no-bias"): the check sees a dequant
  that loses them;
- the manifest's quantization records and parameter dtypes, the export cache key, and the refusals
  (a GPU arch without the packed GEMM, f32 activations or scales there; a checkpoint of another
  format: one line each, nothing written). Quantize on load compiled: tests/test_quantize_on_load.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from badinput import assert_refused, cli
from quant_writers import cut_tensor
from test_exactness import PROMPTS, SAMPLINGS, broken_accept
from test_runtime import _kw, _scripted

from dflash_iree.acceptance import accept_length
from dflash_iree.errors import DFlashError
from dflash_iree.export import quantized
from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import generate_plain
from dflash_iree.runtime.engine import Engine

FORMATS = ("mlx", "ct")


@pytest.fixture(scope="module")
def engines(quant_artifacts):
    return {fmt: Engine.load(quant_artifacts[fmt]) for fmt in FORMATS}


@pytest.fixture(scope="module")
def eagers(quant_dirs):
    return {fmt: load_pair(quant_dirs[fmt], quant_dirs["drafter"], 256, "f32") for fmt in FORMATS}


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_4bit_equals_eager(engines, eagers, quant_dirs, fmt, name):
    s, engine, eager = SAMPLINGS[name], engines[fmt], eagers[fmt]
    float_target = load_pair(quant_dirs["float"], quant_dirs["drafter"], 256, "f32")[0]
    for prompt in PROMPTS:
        ref = generate_plain(eager[0], prompt, 40, s).tokens
        assert engine.generate(prompt, 40, speculative=False, **_kw(s)).tokens == ref
        assert engine.generate(prompt, 40, **_kw(s)).tokens == ref
    # the packed weights are what the module reads: the float target of the same seed differs
    assert ref != generate_plain(float_target, prompt, 40, s).tokens


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
def test_drafted_equals_plain_at_4bit_compiled(engines, eagers, name):
    assert _scripted(engines["mlx"], eagers["mlx"], accept_length, SAMPLINGS[name]) == []


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
def test_planted_acceptance_fails_at_4bit_compiled(engines, eagers, name):
    failures = _scripted(engines["mlx"], eagers["mlx"], broken_accept, SAMPLINGS[name])
    assert "tokens differ from plain" in failures and any("measured accepted" in f for f in failures)


def _drop_zeros(src: Path, dst: Path) -> Path:
    """A copy of a 4-bit checkpoint whose MLX biases are 0, or whose compressed-tensors zero points
    are 0 (each packed nibble 8): what a dequantization that ignores them computes."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for key in tensors:
        if key.endswith(".biases"):
            tensors[key] = np.zeros_like(tensors[key])
        elif key.endswith(".weight_zero_point"):
            tensors[key] = np.full_like(tensors[key], np.int32(np.uint32(0x88888888).view(np.int32)))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("fmt", FORMATS)
def test_planted_dequant_without_bias_is_caught(quant_artifacts, quant_dirs, eagers, fmt, tmp_path, monkeypatch):
    dropped = _drop_zeros(quant_dirs[fmt], tmp_path / "dropped")
    broken = Engine.load(quant_artifacts[fmt], target=dropped, drafter=quant_dirs["drafter"])
    s = SAMPLINGS["greedy"]
    got = [broken.generate(p, 30, speculative=False, **_kw(s)).tokens for p in PROMPTS]
    assert got != [generate_plain(eagers[fmt][0], p, 30, s).tokens for p in PROMPTS]  # the check fails it
    monkeypatch.setattr(quantized, "PLANTED", "no-bias")
    planted_eager = load_pair(quant_dirs[fmt], quant_dirs["drafter"], 256, "f32")[0]
    assert got == [generate_plain(planted_eager, p, 30, s).tokens for p in PROMPTS]  # and it is that bug


def test_manifest_records_the_quantization(quant_artifacts, quant_dirs):
    m = json.loads((quant_artifacts["mlx"] / "manifest.json").read_text())
    q = m["target"]["quantization"]
    assert {k: q[k] for k in ("method", "bits", "group_size")} == {"method": "mlx-affine", "bits": 4, "group_size": 64}
    assert "symmetric" not in q  # compressed-tensors' field: MLX affine always has biases
    assert len(q["layers"]) == 30 and "lm_head" in q["layers"] and "model.embed_tokens" in q["layers"]
    params = m["parameters"]["target"]
    assert params["model.layers.0.mlp.up_proj.weight"] == {"shape": [128, 8], "dtype": "u32"}
    assert params["model.layers.0.mlp.up_proj.scales"]["dtype"] == "f32"
    packed = sum(np.prod(v["shape"]) * 4 for k, v in params.items() if v["dtype"] == "u32")
    assert q["bytes"]["packed"] == packed and q["bytes"]["scales"] == q["bytes"]["zeros"] > 0
    assert m["drafter"]["quantization"] is None
    c = json.loads((quant_artifacts["ct"] / "manifest.json").read_text())["target"]["quantization"]
    assert (c["method"], c["group_size"], c["symmetric"], len(c["layers"])) == ("compressed-tensors", 32, False, 28)
    assert "lm_head" not in c["layers"] and c["bytes"]["zeros"] > 0


def test_compile_log_says_4bit_once(quant_artifacts):
    for fmt, says in (("mlx", "4-bit: target mlx-affine, group 64, packed in the checkpoint"),
                      ("ct", "4-bit: target compressed-tensors, group 32, with zero points, packed in the checkpoint")):
        lines = (quant_artifacts[fmt].parent / "compile.log").read_text().splitlines()
        said = [line for line in lines if "4-bit" in line]
        assert len(said) == 1 and said[0].endswith(f"] {says}"), lines  # the float drafter is not named


def test_manifest_that_says_mlx_is_symmetric_still_binds(quant_artifacts, quant_dirs, tmp_path):
    """Manifests written before `symmetric` was left out for MLX recorded `symmetric: true` there: the
    format check compares the format's own fields, so such artifacts still take their checkpoint."""
    from dflash_iree.runtime.artifacts import Artifacts

    old = Path(shutil.copytree(quant_artifacts["mlx"], tmp_path / "host"))
    m = json.loads((old / "manifest.json").read_text())
    m["target"]["quantization"]["symmetric"] = True
    (old / "manifest.json").write_text(json.dumps(m))
    Artifacts.load(old).check_quantization("target", quant_dirs["mlx"])
    with pytest.raises(DFlashError, match="holds compressed-tensors 4-bit, group 32, asymmetric but .* compiled for "
                                          "mlx-affine 4-bit, group 64;"):
        Artifacts.load(old).check_quantization("target", quant_dirs["ct"])


def test_export_key_includes_the_quantization(quant_dirs):
    from dflash_iree.export.compile import export_key, plan

    keys = {fmt: export_key(plan(quant_dirs[fmt], quant_dirs["drafter"], max_context=256, attention="matmul"))
            for fmt in ("float", "mlx", "ct")}
    assert len(set(keys.values())) == 3


def test_bench_runs_on_a_4bit_module(quant_artifacts, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_ids": p}) for p in ([7, 300, 12], list(range(40, 60)))) + "\n")
    out = tmp_path / "bench.json"
    rc, stdout, err = cli(capsys, "bench", "--artifacts", quant_artifacts["mlx"], "--prompts", prompts,
                          "--max-new-tokens", "16", "--json", out, "--quiet")
    assert rc == 0, err
    result = json.loads(out.read_text())
    assert result["same_tokens"] and result["plain"]["tokens"] == result["dflash"]["tokens"] == 2 * 16


# --- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,extra,needles", [
    ("gfx1030", [], ["packed-weight GEMM kernel", "gfx1030", "--arch host"]),  # no GEMM kernel there
    ("sm_80", [], ["--dtype f32", "compute in bf16", "pass --dtype bf16"]),  # the tiny target is float32
    ("sm_80", ["--dtype", "f16"], ["--dtype f16", "compute in bf16", "pass --dtype bf16"]),
    ("gfx1151", ["--dtype", "bf16"], ["q-mlx: lm_head.biases is f32", "reads bf16 scales and biases"])])
def test_gpu_arch_refuses_4bit_it_cannot_take(quant_dirs, arch, extra, needles, capsys, tmp_path):
    """4-bit weights compile for the GPU archs of the packed GEMM in bf16 with bf16 scales and biases
    (tests/test_gemm.py: the kernel and its lowering); anything else is one line, nothing written, and
    no --dtype warning before it (a --dtype other than the float32 checkpoint's would warn)."""
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "compile", "--arch", arch, "--target", quant_dirs["mlx"], "--drafter",
                     quant_dirs["drafter"], "--out", out, *extra)
    assert_refused(rc, err, *needles)
    assert len(err.strip().splitlines()) == 1 and "warning" not in err and not out.exists()


@pytest.mark.parametrize("given", ["float", "ct"])
def test_runtime_refuses_a_checkpoint_of_another_format(quant_artifacts, quant_dirs, given):
    with pytest.raises(DFlashError) as e:
        Engine.load(quant_artifacts["mlx"], target=quant_dirs[given], drafter=quant_dirs["drafter"])
    msg = str(e.value)
    assert "\n" not in msg and "compiled for mlx-affine 4-bit, group 64" in msg and "dflash-iree compile" in msg


def test_runtime_refuses_packed_tensors_of_the_wrong_shape(quant_artifacts, quant_dirs, tmp_path):
    folder = cut_tensor(quant_dirs["mlx"], tmp_path / "cut", "model.layers.1.mlp.up_proj.weight", 64)
    with pytest.raises(DFlashError, match=r"model.layers.1.mlp.up_proj.weight: expected shape \[128, 8\], found \[64, 8\]"):
        Engine.load(quant_artifacts["mlx"], target=folder, drafter=quant_dirs["drafter"])
