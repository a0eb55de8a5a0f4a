"""The head norm + rope dispatch (kernels/norm_rope/): objects, MLIR, refusals, the custom op of the
export and its splice. The kernel runs only on a GPU: its bit parity with the eager ops is
bench/norm_rope_check.py on the H200 (experiments/2026-11-30-norm-rope/)."""

from __future__ import annotations

import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.kernels.isa import NORM_ROPE_KERNELS, inspect_object
NORM_ROPE_OP = "torch.dflash.head_norm_rope"  # export/ops.py NORM_ROPE_OP (no torch import here)
from dflash_iree.kernels.norm_rope import ARCHS, norm_rope_dispatch, object_file, standalone_module

H, HD = 4, 16


@pytest.mark.parametrize("arch", ARCHS)
def test_objects_are_sound(arch):
    """Every GPU arch's object holds the entry point: gfx with no scratch and no spills, PTX 7.8 with no local memory."""
    assert inspect_object(object_file(arch), arch, NORM_ROPE_KERNELS) == []


@pytest.mark.parametrize("args,match", [((1, 4, 8, 128, "bf16", 1e-6, "host"), "no head norm \\+ rope kernel"),
                                        ((1, 4, 8, 15, "bf16", 1e-6, "sm_80"), "head_dim 15"),
                                        ((1, 4, 8, 128, "f64", 1e-6, "gfx1151"), "dtype f64")])
def test_refusals(args, match):
    with pytest.raises(DFlashError, match=match):
        norm_rope_dispatch(*args)


def test_mlir():
    static = norm_rope_dispatch(1, 16, 32, 128, "bf16", 1e-6, "sm_80", name="nr")
    assert "@nr_exe::@dflash_norm_rope[%n]" in static.mlir and "%n = arith.constant 512 : index" in static.mlir
    assert static.types == ("tensor<1x16x32x128xbf16>", "tensor<128xbf16>", "tensor<1x16x128xbf16>")
    dynamic = norm_rope_dispatch(2, None, 8, 64, "f32", 1e-5, "gfx1151", name="nr")
    assert "tensor<2x?x8x64xf32>{%t}" in dynamic.mlir and "%sh = arith.constant 16 : index" in dynamic.mlir
    pair = norm_rope_dispatch(1, None, 32, 128, "bf16", 1e-6, "sm_80", name="nr", Hk=8)
    assert "@nr_exe::@dflash_norm_rope2[%n](%cnq," in pair.mlir and "%sh = arith.constant 40 : index" in pair.mlir
    assert "%sq = arith.constant 32 : index" in pair.mlir  # q's workgroups: the first rows * 32
    assert pair.result_types == ["tensor<1x?x32x128xbf16>", "tensor<1x?x8x128xbf16>"]


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151", "gfx1030"])
def test_compiles_for_gpu_targets(arch):
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export.compile import compile_flags, resolve_arch

    flags = [f for f in compile_flags(resolve_arch(arch)[0]) if "opt-level" not in f]
    for args in [(1, 16, 32, 128, "bf16"), (1, None, 8, 128, "f16"), (2, 3, 4, 16, "f32")]:
        for Hk in (None, 2):
            d = norm_rope_dispatch(*args, 1e-6, arch, Hk=Hk)
            assert len(ic.compile_str(standalone_module(d), extra_args=flags + d.flags)) > 10000


def _module(attention: str):
    import torch

    from dflash_iree.export.qwen3 import RMSNorm, norm_rope

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(HD, 1e-6)
            with torch.no_grad():
                self.norm.weight.copy_(torch.linspace(0.5, 1.5, HD))

        def forward(self, x, cos, sin):
            return norm_rope(self.norm, x, cos, sin, attention)

    return M().eval()


def _pair_module(use_q_first: bool):
    """q [1, T, H, HD] and k [1, T, 2, HD] through their own norms and one position table, as a layer's
    query and key; with USE_Q_FIRST, q's result is used before k's op (the pair cannot be one call there)."""
    import torch

    from dflash_iree.export.qwen3 import RMSNorm, norm_rope

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_norm, self.k_norm = RMSNorm(HD, 1e-6), RMSNorm(HD, 1e-6)
            with torch.no_grad():
                self.q_norm.weight.copy_(torch.linspace(0.5, 1.5, HD))
                self.k_norm.weight.copy_(torch.linspace(1.5, 0.5, HD))

        def forward(self, q, k, cos, sin):
            q = norm_rope(self.q_norm, q, cos, sin, "fused")
            if use_q_first:
                k = k + q[:, :, :2]
            return q, norm_rope(self.k_norm, k, cos, sin, "fused")

    return M().eval()


def _inputs(T: int = 3):
    import torch

    from dflash_iree.export.qwen3 import rope_tables

    g = torch.Generator().manual_seed(0)
    cos, sin = rope_tables(torch.arange(T)[None] + 7, HD, 1e6, torch.float32)
    return torch.randn(1, T, H, HD, generator=g), cos, sin


def test_eager_forms_agree():
    """Eager, every form computes apply_rope(norm(x)) op by op; the custom op's eager body is the same math."""
    torch = pytest.importorskip("torch")
    from dflash_iree.export.ops import head_norm_rope
    from dflash_iree.export.qwen3 import apply_rope

    x, cos, sin = _inputs()
    m = _module("fused")
    want = apply_rope(m.norm(x), cos, sin)
    assert torch.equal(m(x, cos, sin), want) and torch.equal(_module("matmul")(x, cos, sin), want)
    assert torch.equal(head_norm_rope(x, m.norm.weight, cos, sin, m.norm.eps), want)


def test_eager_op_variants():
    """The op's parameters for the coming families: a zero-centred (1 + w) norm, and a partial rotary
    (the first rotary_dim dims of a head rotate, the rest pass through)."""
    torch = pytest.importorskip("torch")
    from dflash_iree.export.ops import head_norm_rope
    from dflash_iree.export.qwen3 import apply_rope, rms_norm

    x, cos, sin = _inputs()
    w = torch.randn(HD)
    assert torch.equal(head_norm_rope(x, w, cos, sin, 1e-6, True, 0), apply_rope(rms_norm(x, 1 + w, 1e-6), cos, sin))
    half = HD // 2
    y = head_norm_rope(x, w, cos[..., :half], sin[..., :half], 1e-6, False, half)
    normed = rms_norm(x, w, 1e-6)
    assert torch.equal(y[..., half:], normed[..., half:])
    assert torch.equal(y[..., :half], apply_rope(normed[..., :half], cos[..., :half], sin[..., :half]))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The module exported in each form, with a dynamic token count."""
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")
    tmp = tmp_path_factory.mktemp("norm_rope")
    T = torch.export.Dim("T", min=1, max=64)
    out = {}
    for form in ("fused", "matmul"):
        e = aot.export(_module(form), args=_inputs(), dynamic_shapes={"x": {1: T}, "cos": {1: T}, "sin": {1: T}})
        out[form] = tmp / f"{form}.mlir"
        e.save_mlir(out[form])
    return out


def test_only_the_gpu_form_exports_the_op(exported):

    assert NORM_ROPE_OP in exported["fused"].read_text() and NORM_ROPE_OP not in exported["matmul"].read_text()


def test_splice_takes_the_op(exported, tmp_path):
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_flags, resolve_arch

    out, flags, report = splice.splice_file(exported["fused"], tmp_path / "s.mlirbc", "sm_80",
                                            {"norm_rope": splice.lower_norm_rope})
    text = str(splice.load(out))
    assert NORM_ROPE_OP not in text and text.count("util.call @dflash_norm_rope_1xDx4x16_f32_358637bd") == 1
    assert report["norm_rope"] == [{"S": 1, "T": None, "H": H, "head_dim": HD, "dtype": "f32", "ops": 1}]
    extra = [f for f in compile_flags(resolve_arch("sm_80")[0]) if "opt-level" not in f]
    assert len(ic.compile_file(str(out), extra_args=extra + flags)) > 10000


@pytest.mark.parametrize("case", ["static", "dynamic", "q used first"])
def test_splice_pairs_q_and_k(tmp_path, case):
    """A layer's q and k ops (the same cos and sin) become one dispatch, `dflash_norm_rope2`, whose call
    stands where k's op stood, with a dynamic token count too (q's shape annotation moves after it);
    when q's result is used before k's op (the planted control), each keeps its own dispatch. The
    spliced module compiles for sm_80."""
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_flags, resolve_arch

    use_q_first = case == "q used first"
    x, cos, sin = _inputs()
    T = torch.export.Dim("T", min=1, max=64) if case == "dynamic" else None
    dynamic = {n: {1: T} for n in ("q", "k", "cos", "sin")} if T else None
    aot.export(_pair_module(use_q_first), args=(x, x[:, :, :2].clone(), cos, sin),
               dynamic_shapes=dynamic).save_mlir(tmp_path / "m.mlir")
    out, flags, report = splice.splice_file(tmp_path / "m.mlir", tmp_path / "s.mlirbc", "sm_80",
                                            {"norm_rope": splice.lower_norm_rope})
    text = str(splice.load(out))
    report = report["norm_rope"]
    if use_q_first:
        assert "dflash_norm_rope2" not in text and sorted(r["H"] for r in report) == [2, H]
    else:
        T = None if case == "dynamic" else 3
        assert text.count(f"util.call @dflash_norm_rope_1x{T or 'D'}x4_2x16_f32_358637bd") == 1
        assert "@dflash_norm_rope2" in text
        assert report == [{"S": 1, "T": T, "H": [H, 2], "head_dim": HD, "dtype": "f32", "ops": 1}]
    extra = [f for f in compile_flags(resolve_arch("sm_80")[0]) if "opt-level" not in f]
    assert len(ic.compile_file(str(out), extra_args=extra + flags)) > 10000


def test_splice_refuses_the_host(exported, tmp_path):
    """The CPU form never exports the op; forced onto the host, the splice names the missing kernel."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    with pytest.raises(DFlashError, match="no head norm \\+ rope kernel for arch 'host'"):
        splice.splice_file(exported["fused"], tmp_path / "s.mlirbc", "host", {"norm_rope": splice.lower_norm_rope})


def test_a_custom_op_left_unspliced_is_refused(exported, tmp_path):
    """A `splices` dict without the norm + rope splice (a compile experiment) fails at the splice with the reason,
    not in iree-compile."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    with pytest.raises(DFlashError, match="torch.dflash.head_norm_rope left in the module"):
        splice.splice_file(exported["fused"], tmp_path / "s.mlirbc", "sm_80", {"topk": splice.lower_topk})


def test_the_fused_form_is_refused_for_the_host(target_dir, drafter_dir, tmp_path):
    from dflash_iree.export.compile import compile_artifacts

    with pytest.raises(DFlashError, match="attention form 'fused'.*not host"):
        compile_artifacts("host", target_dir, drafter_dir, tmp_path / "out", attention="fused")


def test_numpy_reference_matches_the_eager_ops():
    """kernels/norm_rope/reference.py against export/qwen3.py's rms_norm + apply_rope on float64 inputs
    (rms_norm normalizes in float32, as HF's Qwen3RMSNorm: hence float32's tolerance)."""
    import numpy as np
    import torch

    from dflash_iree.export.qwen3 import apply_rope, rms_norm
    from dflash_iree.kernels.norm_rope.reference import norm_rope

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 3, 4, 16)), rng.standard_normal(16)
    cos, sin = rng.standard_normal((1, 3, 16)), rng.standard_normal((1, 3, 16))
    want = apply_rope(rms_norm(torch.from_numpy(x), torch.from_numpy(w), 1e-6), torch.from_numpy(cos), torch.from_numpy(sin))
    np.testing.assert_allclose(norm_rope(x, w, cos, sin, 1e-6), want.numpy(), rtol=1e-6, atol=1e-6)
