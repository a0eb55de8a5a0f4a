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


@pytest.mark.parametrize("kw,match", [({"rotary_dim": 63}, "rotary_dim 63 must be even"),
                                      ({"rotary_dim": 512}, "rotary_dim 512 must be even and in 2..256"),
                                      ({"rotary_dim": 0}, "rotary_dim 0"),
                                      ({"x_stride": 128}, "x's 128 values a head are fewer than head_dim 256"),
                                      ({"Hk": 4, "k_stride": 255}, "k's 255 values")])
def test_variant_refusals(kw, match):
    with pytest.raises(DFlashError, match=match):
        norm_rope_dispatch(1, 4, 24, 256, "bf16", 1e-6, "sm_80", **kw)


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
    # Qwen3's text whatever the defaults are spelled as: a full rotary and strides of head_dim
    assert norm_rope_dispatch(1, None, 32, 128, "bf16", 1e-6, "sm_80", name="nr", Hk=8, rotary_dim=128,
                              x_stride=128, k_stride=128).mlir == pair.mlir


def test_variant_mlir():
    """The 27B's q and k: zero-centred, 64 of 256 dims rotated, q read in place from [Hq, 2 * hd]; the
    `_v` entry point with its push constants in norm_rope_gpu.cu's order."""
    d = norm_rope_dispatch(1, None, 24, 256, "bf16", 1e-6, "sm_80", name="nr", Hk=4, zero_centered=True,
                           rotary_dim=64, x_stride=512)
    assert d.variant and d.operand_types == ["tensor<1x?x24x512xbf16>", "tensor<256xbf16>", "tensor<1x?x4x256xbf16>",
                                             "tensor<256xbf16>", "tensor<1x?x64xbf16>", "tensor<1x?x64xbf16>"]
    assert d.result_types == ["tensor<1x?x24x256xbf16>", "tensor<1x?x4x256xbf16>"]
    assert "@nr_exe::@dflash_norm_rope2_v[%n](%cnq, %cH, %cHk, %cD, %cR, %cXS, %cXSk, %czc, %cdt, %ceps, %x," in d.mlir
    assert "%cR = arith.constant 64 : i32" in d.mlir and "%cXS = arith.constant 512 : i32" in d.mlir
    assert "%cXSk = arith.constant 256 : i32" in d.mlir and "%czc = arith.constant 1 : i32" in d.mlir
    assert "tensor.dim %x, %c1 : tensor<1x?x24x512xbf16>" in d.mlir
    one = norm_rope_dispatch(1, 1, 6, 64, "bf16", 1e-6, "gfx1151", name="nr", rotary_dim=16)
    assert "@nr_exe::@dflash_norm_rope_v[%n](%cH, %cD, %cR, %cXS, %czc, %cdt, %ceps, %x," in one.mlir
    assert "%czc = arith.constant 0 : i32" in one.mlir and one.operand_types[2] == "tensor<1x1x16xbf16>"


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151", "gfx1030"])
def test_compiles_for_gpu_targets(arch):
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export.compile import compile_flags, resolve_arch

    flags = [f for f in compile_flags(resolve_arch(arch)[0]) if "opt-level" not in f]
    for args in [(1, 16, 32, 128, "bf16"), (1, None, 8, 128, "f16"), (2, 3, 4, 16, "f32")]:
        for Hk in (None, 2):
            d = norm_rope_dispatch(*args, 1e-6, arch, Hk=Hk)
            assert len(ic.compile_str(standalone_module(d), extra_args=flags + d.flags)) > 10000
    for Hk, kw in ((4, {"x_stride": 512}), (None, {})):  # the 27B's q and k, then k alone
        d = norm_rope_dispatch(1, None, 24, 256, "bf16", 1e-6, arch, Hk=Hk, zero_centered=True, rotary_dim=64, **kw)
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


# (Hq, Hkv, head_dim, rotary_dim) of Qwen3.5-27B and of the demo pair's target (models/demo-qwen35/target)
HYBRID_SHAPES = {"27B": (24, 4, 256, 64), "demo": (6, 2, 64, 16)}


def _hybrid_inputs(shape: str, dtype, T: int = 3, seed: int = 0):
    """q_proj's output viewed as [1, T, Hq, 2 * hd] (query and gate interleaved per head), k [1, T, Hkv, hd],
    the two zero-centred weights (around 0, as trained ones) and cos, sin [1, T, rotary_dim] of
    export/qwen35_rope.py at positions 7.. (`rope_tables`, what `Qwen35.step` computes)."""
    import dataclasses

    import torch

    from dflash_iree.config import load_target_config
    from dflash_iree.export.qwen35_rope import rope_tables

    Hq, Hkv, hd, R = HYBRID_SHAPES[shape]
    cfg = dataclasses.replace(load_target_config("models/demo-qwen35/target"), head_dim=hd,
                              partial_rotary_factor=R / hd, rope_theta=1e7 if shape == "27B" else 1e4)
    assert cfg.rotary_dim == R
    g = torch.Generator().manual_seed(seed)
    qg = (torch.randn(1, T, Hq, 2 * hd, generator=g) * 3).to(dtype)
    k = (torch.randn(1, T, Hkv, hd, generator=g) * 3).to(dtype)
    wq, wk = ((0.3 * torch.randn(hd, generator=g)).to(dtype) for _ in range(2))
    cos, sin = rope_tables(torch.arange(T)[None] + 7, cfg, dtype)
    return qg, k, wq, wk, cos, sin


@pytest.mark.parametrize("shape", HYBRID_SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eager_op_variants(shape, dtype):
    """The op's eager body with Qwen3.5's parameters (zero-centred, rotary_dim, q read from the
    interleaved [query, gate] heads) is GatedAttention's eager q/k path bit for bit: `partial_rope`
    of `zc_rms_norm` of the chunked q. Planted control: `rms_norm` by (1 + w), which rounds the normed
    value before the product, differs in bf16 (the rounding the kernel must not copy from Qwen3)."""
    torch = pytest.importorskip("torch")
    from dflash_iree.export.ops import head_norm_rope
    from dflash_iree.export.qwen3 import apply_rope, rms_norm, rope_tables
    from dflash_iree.export.qwen35 import partial_rope, zc_rms_norm

    qg, k, wq, wk, cos, sin = _hybrid_inputs(shape, getattr(torch, dtype))
    R = cos.shape[-1]
    q = qg.chunk(2, -1)[0]
    want_q = partial_rope(zc_rms_norm(q, wq, 1e-6), cos, sin)
    assert torch.equal(head_norm_rope(qg, wq, cos, sin, 1e-6, True, R), want_q)
    assert torch.equal(head_norm_rope(k, wk, cos, sin, 1e-6, True, R), partial_rope(zc_rms_norm(k, wk, 1e-6), cos, sin))
    normed = zc_rms_norm(q, wq, 1e-6)
    assert torch.equal(want_q[..., R:], normed[..., R:])  # the dims past rotary_dim pass through
    planted = partial_rope(rms_norm(q, 1 + wq, 1e-6), cos, sin)
    assert torch.equal(planted, want_q) == (dtype == "float32")
    # Qwen3's parameters: rotary_dim 0 and head_dim alike
    c, s_ = rope_tables(torch.arange(3)[None] + 7, k.shape[-1], 1e6, k.dtype)
    for rd in (0, k.shape[-1]):
        assert torch.equal(head_norm_rope(k, wk, c, s_, 1e-6, False, rd), apply_rope(rms_norm(k, wk, 1e-6), c, s_))


def test_hybrid_eager_forward_unchanged():
    """GatedAttention.qkv_gate outside an export computes q and k op by op in every form, the same bits
    as the ops of the code before the named op (chunk, zc_rms_norm, partial_rope), and the named op's
    eager body gives those bits too."""
    import dataclasses

    torch = pytest.importorskip("torch")
    from dflash_iree.config import load_target_config
    from dflash_iree.export.ops import head_norm_rope
    from dflash_iree.export.qwen35 import GatedAttention, partial_rope, zc_rms_norm

    cfg = load_target_config("models/demo-qwen35/target")
    _, _, _, _, cos, sin = _hybrid_inputs("demo", torch.bfloat16)
    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = {}
    for form in ("fused", "matmul"):
        torch.manual_seed(2)
        m = GatedAttention(cfg, torch.bfloat16, attention=form)
        with torch.no_grad():
            m.q_norm.weight.uniform_(-0.5, 0.5)
            m.k_norm.weight.uniform_(-0.5, 0.5)
            got[form] = m.qkv_gate(x, cos, sin)
    with torch.no_grad():
        qg = m.q_proj(x).view(1, 3, cfg.num_attention_heads, 2 * cfg.head_dim)
        k = m.k_proj(x).view(1, 3, cfg.num_key_value_heads, cfg.head_dim)
        q = partial_rope(zc_rms_norm(qg.chunk(2, -1)[0], m.q_norm.weight, cfg.rms_norm_eps), cos, sin)
        kr = partial_rope(zc_rms_norm(k, m.k_norm.weight, cfg.rms_norm_eps), cos, sin)
        op_q = head_norm_rope(qg, m.q_norm.weight, cos, sin, cfg.rms_norm_eps, True, cfg.rotary_dim)
    for form in got:
        assert torch.equal(got[form][0], q) and torch.equal(got[form][1], kr)
    assert torch.equal(op_q, q)


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


@pytest.mark.parametrize("shape", HYBRID_SHAPES)
def test_numpy_reference_matches_the_eager_ops_variants(shape):
    """norm_rope/reference.py's variants against export/qwen35.py's zc_rms_norm + partial_rope on
    float64 inputs at the 27B and demo shapes: q read from the interleaved [query, gate] heads, k."""
    import numpy as np
    import torch

    from dflash_iree.export.qwen35 import partial_rope, zc_rms_norm
    from dflash_iree.kernels.norm_rope.reference import norm_rope

    qg, k, wq, wk, cos, sin = _hybrid_inputs(shape, torch.float64)
    R = cos.shape[-1]
    for x, w, head in ((qg, wq, qg.chunk(2, -1)[0]), (k, wk, k)):
        want = partial_rope(zc_rms_norm(head, w, 1e-6), cos, sin)
        got = norm_rope(x.numpy(), w.numpy(), cos.numpy(), sin.numpy(), 1e-6, zero_centered=True, rotary_dim=R)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rotary_dim 7"):
        norm_rope(k.numpy(), wk.numpy(), cos.numpy(), sin.numpy(), 1e-6, rotary_dim=7)


def _gated_attention(form: str):
    """The demo target's GatedAttention (6 q heads, 2 kv heads, head_dim 64, 16 dims rotated), float32
    (its weights become the export's literals, which NumPy cannot hold in bf16), as a module of
    (x, cos, sin) -> (q, k)."""
    import torch

    from dflash_iree.config import load_target_config
    from dflash_iree.export.qwen35 import GatedAttention

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = GatedAttention(load_target_config("models/demo-qwen35/target"), attention=form)

        def forward(self, x, cos, sin):
            q, k, _, _ = self.attn.qkv_gate(x, cos, sin)
            return q, k

    return M().eval()


def test_hybrid_splice_takes_the_variants(tmp_path):
    """GatedAttention exported in the GPU form: its q and k become one `dflash_norm_rope2_v` (zero-centred,
    16 of 64 dims rotated, q read from [6, 128] in place), which compiles for sm_80; the CPU form
    exports no op (the host's lowering is as before)."""
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_flags, resolve_arch

    _, _, _, _, cos, sin = _hybrid_inputs("demo", torch.float32)
    x = torch.randn(1, 3, 384)
    T = torch.export.Dim("T", min=1, max=64)
    dynamic = {"x": {1: T}, "cos": {1: T}, "sin": {1: T}}
    for form in ("fused", "matmul"):
        aot.export(_gated_attention(form), args=(x, cos, sin), dynamic_shapes=dynamic).save_mlir(tmp_path / f"{form}.mlir")
    assert NORM_ROPE_OP not in (tmp_path / "matmul.mlir").read_text()
    assert (tmp_path / "fused.mlir").read_text().count(NORM_ROPE_OP) == 2
    out, flags, report = splice.splice_file(tmp_path / "fused.mlir", tmp_path / "s.mlirbc", "sm_80")
    text = str(splice.load(out))
    assert NORM_ROPE_OP not in text and "@dflash_norm_rope2_v" in text
    assert text.count("util.call @dflash_norm_rope_1xDx6_2x64_f32_358637bd_zc_r16_s128_64(") == 1
    assert report["norm_rope"] == [{"S": 1, "T": None, "H": [6, 2], "head_dim": 64, "dtype": "f32", "ops": 1,
                                    "zero_centered": True, "rotary_dim": 16, "head_stride": [128, 64]}]
    extra = [f for f in compile_flags(resolve_arch("sm_80")[0]) if "opt-level" not in f]
    assert len(ic.compile_file(str(out), extra_args=extra + flags)) > 10000


def test_tiny_hybrid_target_takes_the_kernel_on_sm_80(hybrid_pair, tmp_path):
    """The tiny hybrid target (tests/tiny_qwen35.py: 4 q heads, 2 kv heads, head_dim 16, 8 dims rotated)
    exported as the compile exports it for sm_80 (bf16, the arch's "fused" form), its `verify` entry
    point: the attention layer's q/k norms and rope are one `dflash_norm_rope2_v` dispatch in the
    splice report the manifest keeps (`splices`), and the module compiles for sm_80. Its `host` form
    exports no op, so the host's compile is as before."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("iree.compiler")
    from dflash_iree.arch import ARCHS
    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export import aot
    from dflash_iree.export import entry_points as E
    from dflash_iree.export.iree_tool import run_iree_compile
    from dflash_iree.export.splice import load, splice_file

    tcfg = load_target_config(hybrid_pair[0])
    dcfg = load_drafter_config(hybrid_pair[1], tcfg)
    shapes = E.ExportShapes(1, 8, 64, "bf16", dcfg.num_taps * tcfg.hidden_size)
    assert ARCHS["sm_80"].attention == "fused" and ARCHS["host"].attention == "matmul"
    for arch in ("host", "sm_80"):
        pair = aot.build_pair(tcfg, dcfg, 64, 8, 1, torch.bfloat16, attention=ARCHS[arch].attention)
        aot.export_module(pair, shapes, sampled=False, only=("verify",))[0].save_mlir(tmp_path / f"{arch}.mlir")
    assert NORM_ROPE_OP not in (tmp_path / "host.mlir").read_text()
    src, flags, report = splice_file(tmp_path / "sm_80.mlir", tmp_path / "s.mlirbc", "sm_80")
    assert report["norm_rope"] == [{"S": 1, "T": 8, "H": [4, 2], "head_dim": 16, "dtype": "bf16", "ops": 1,
                                    "zero_centered": True, "rotary_dim": 8, "head_stride": [32, 16]}]
    assert str(load(src)).count("util.call @dflash_norm_rope_1x8x4_2x16_bf16_358637bd_zc_r8_s32_16(") == 1
    run_iree_compile(src, tmp_path / "m.vmfb", list(ARCHS["sm_80"].flags), tmp_path / "stats.csv", flags)
    assert (tmp_path / "m.vmfb").stat().st_size > 10000


@pytest.mark.parametrize("shape", HYBRID_SHAPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_variant_rounding_rule_is_eagers(shape, dtype):
    """norm_rope_body.h's rule for the variants, repeated in torch float32 with the body's roundings to
    the dtype (x * r * (1 + w) in f32 and one rounding; the rope's products and sum each rounded over
    the first R dims; the rest as normed), equals zc_rms_norm + partial_rope bit for bit when given
    eager's scale r. (The kernel's r, 1 / sqrt over its own sum order, can differ from ATen's rsqrt
    by an ulp or two: bench/norm_rope_check.py's bound on the GPU.)"""
    torch = pytest.importorskip("torch")
    from dflash_iree.export.qwen35 import partial_rope, zc_rms_norm

    dt = getattr(torch, dtype)
    qg, k, wq, wk, cos, sin = _hybrid_inputs(shape, dt, T=4)
    R, half = cos.shape[-1], cos.shape[-1] // 2
    c, s = cos.float()[:, :, None], sin.float()[:, :, None]

    def rnd(t):
        return t.to(dt).float()

    for x, w in ((qg, wq), (k, wk)):
        x32 = x[..., :w.shape[-1]].float()
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        y = rnd(x32 * r * (1.0 + w.float()))
        a, b = y[..., :half], y[..., half:R]
        lo = rnd(rnd(a * c[..., :half]) + rnd(-b * s[..., :half]))
        hi = rnd(rnd(b * c[..., half:]) + rnd(a * s[..., half:]))
        want = partial_rope(zc_rms_norm(x[..., :w.shape[-1]], w, 1e-6), cos, sin)
        assert torch.equal(torch.cat([lo, hi, y[..., R:]], -1).to(dt), want)


def test_kv_mlir_and_refusals():
    """The KV-writing pair's function takes the cache as a tied operand, its rows int64 [S * 2T]."""
    from dflash_iree.kernels.norm_rope import norm_rope_kv_dispatch

    d = norm_rope_kv_dispatch(1, 3, H, 2, HD, "f32", 1e-6, (1, 4, 2, 64, 2 * HD), "sm_80", name="kv")
    assert "-> (tensor<1x3x4x16xf32>, %cache)" in d.mlir and "%rows: tensor<6xi64>" in d.mlir
    assert "@kv_exe::@dflash_norm_rope2_kv[%n](%cnq, %cH, %cHk, %cD, %cT, %cdt, %ceps, %x, %w, %k, %wk," in d.mlir
    with pytest.raises(DFlashError, match="does not have rows of Hk \\* D = 32 values"):
        norm_rope_kv_dispatch(1, 3, H, 2, HD, "f32", 1e-6, (1, 4, 2, 64, HD), "sm_80")
    with pytest.raises(DFlashError, match="no head norm \\+ rope kernel"):
        norm_rope_kv_dispatch(1, 3, H, 2, HD, "f32", 1e-6, (1, 4, 2, 64, 2 * HD), "host")


def test_kv_standalone_module_compiles():
    """The check module of the KV-writing pair (bench/norm_rope_check.py's KV cases) takes q, wq, k, wk,
    cos, sin, v, rows and the cache and returns q's result and the cache, and compiles for sm_80."""
    import iree.compiler as ic

    from dflash_iree.export.compile import compile_flags, resolve_arch
    from dflash_iree.kernels.norm_rope import norm_rope_kv_dispatch, standalone_module

    d = norm_rope_kv_dispatch(1, None, H, 2, HD, "f32", 1e-6, (1, 2, 2, 64, 2 * HD), "sm_80")
    assert d.operand_types[6:] == ["tensor<1x?x2x16xf32>", "tensor<?xi64>", "tensor<1x2x2x64x32xf32>"]
    assert d.result_types == ["tensor<1x?x4x16xf32>", "tensor<1x2x2x64x32xf32>"]
    text = standalone_module(d)
    assert "util.func public @norm_rope(%a0: tensor<1x?x4x16xf32>" in text and "%a8: tensor<1x2x2x64x32xf32>" in text
    assert ic.compile_str(text, extra_args=compile_flags(resolve_arch("sm_80")[0]) + d.flags)


def test_kv_check_fails_a_misplaced_write(monkeypatch):
    """bench/norm_rope_check.py's KV comparison passes the eager ops' own results and fails them with
    the write one row off (a planted control: the check can fail)."""
    from pathlib import Path

    import ml_dtypes
    import numpy as np
    import torch

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import norm_rope_check

    from dflash_iree.export.qwen3 import apply_rope, rms_norm, written_cache

    class Result:  # an IREE result's `to_host`
        def __init__(self, a):
            self.a = a

        def to_host(self):
            return self.a

    def eager(shift: int):
        def fn(q, wq, k, wk, cos, sin, v, rows, cache):
            q, wq, k, wk, cos, sin, v, cache = (torch.from_numpy(a.copy()) for a in (q, wq, k, wk, cos, sin, v, cache))
            k_out = apply_rope(rms_norm(k, wk, 1e-6), cos, sin)
            out = written_cache(cache, (torch.from_numpy(rows) + shift) % (cache.numel() // cache.shape[-1]), k_out, v)
            return Result(apply_rope(rms_norm(q, wq, 1e-6), cos, sin).numpy()), Result(out.numpy())
        return fn

    np_dtype = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
    case = (2, 3, 4, 2, 16, "f32", 1e-6, 16)
    assert norm_rope_check.kv_check(case, eager(0), np_dtype)["ok"]
    broken = norm_rope_check.kv_check(case, eager(1), np_dtype)
    assert not broken["ok"] and broken["cache_not_equal"] > 0


@pytest.mark.parametrize("dynamic,streams", [(False, 1), (True, 1), (False, 2)])
def test_qwen3_gpu_export_writes_the_cache_in_the_norm_rope(target_dir, tmp_path, dynamic, streams):
    """The tiny Qwen3 target exported in the GPU ("fused") form: each layer's q and k norm + rope and
    its KV cache write are one `dflash::norm_rope_kv_write` op, spliced into one `dflash_norm_rope2_kv`
    dispatch a layer (no index_copy left for IREE's scatter), which compiles for sm_80; with two streams
    too (each layer's rows a vector of S * 2T). (Its bits on a
    GPU: bench/gpu_check.py, the compiled tiny pair against eager tokens.)"""
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.config import load_target_config
    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_flags, resolve_arch
    from dflash_iree.export.qwen3 import Qwen3

    cfg = load_target_config(target_dir)
    torch.manual_seed(0)
    target = Qwen3(cfg, 64, streams=streams, attention="fused").eval()

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.target = target

        def forward(self, tokens, start):
            return self.target(tokens, start)[1]

    tokens, start = torch.tensor([[5, 7, 9]] * streams), torch.tensor([4] * streams)
    T = torch.export.Dim("T", min=1, max=32) if dynamic else None
    aot.export(Step(), args=(tokens, start), dynamic_shapes={"tokens": {1: T}, "start": None} if T else None
               ).save_mlir(tmp_path / "m.mlir")
    exported = (tmp_path / "m.mlir").read_text()
    assert exported.count("torch.dflash.norm_rope_kv_write") == cfg.num_hidden_layers
    assert NORM_ROPE_OP not in exported
    out, flags, report = splice.splice_file(tmp_path / "m.mlir", tmp_path / "s.mlirbc", "sm_80")
    text = str(splice.load(out))
    assert "torch.dflash" not in text and text.count("util.call @dflash_norm_rope_kv_") == cfg.num_hidden_layers
    assert report["norm_rope"] == [{"S": streams, "T": None if dynamic else 3, "H": [cfg.num_attention_heads,
                                    cfg.num_key_value_heads], "head_dim": cfg.head_dim, "dtype": "f32",
                                    "ops": cfg.num_hidden_layers, "kv_cache": True}]
    extra = [f for f in compile_flags(resolve_arch("sm_80")[0]) if "opt-level" not in f]
    assert len(ic.compile_file(str(out), extra_args=extra + flags)) > 10000


def test_written_cache_is_write_cache_out_of_place():
    """The named op's reference cache (`written_cache`) is `write_cache`'s, without touching its input."""
    torch = pytest.importorskip("torch")
    from dflash_iree.export.qwen3 import cache_rows, write_cache, written_cache

    torch.manual_seed(0)
    cache = torch.randn(1, 3, 2, 16, 2 * HD)
    k, v = torch.randn(1, 4, 2, HD), torch.randn(1, 4, 2, HD)
    rows = cache_rows(cache, torch.tensor([[5, 6, 7, 8]]))[1]
    before, want = cache.clone(), cache.clone()
    write_cache(want, rows, k, v)
    got = written_cache(cache, rows, k, v)
    assert torch.equal(got, want) and torch.equal(cache, before) and not torch.equal(got, before)
