"""The block-attention dispatch (kernels/attention/): objects, MLIR, refusals, and the lowering of the
model's attention over the KV cache (the named op `dflash::block_attention`). The kernel runs only on a GPU: parity and speed are bench/attention_bench.py
on the H200 (experiments/2026-11-30-block-attention/)."""

from __future__ import annotations

import functools
import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.kernels.attention import ARCHS, attention_dispatch, object_file, standalone_module
from dflash_iree.kernels.isa import ATTENTION_KERNELS, inspect_object


@pytest.mark.parametrize("arch", ARCHS)
def test_objects_are_sound(arch):
    """Every arch's object holds the entry point: gfx with no scratch and no spills, PTX 7.8 with no local memory."""
    assert inspect_object(object_file(arch), arch, ATTENTION_KERNELS) == []


@pytest.mark.parametrize("args,match", [((1, 8, 65, 128, 36, 4096, "sm_80"), "R=65"),
                                        ((1, 8, 16, 100, 36, 4096, "sm_80"), "head_dim 100"),
                                        ((1, 8, 16, 256, 36, 4096, "gfx1151"), "head_dim 256"),
                                        ((1, 8, 16, 128, 36, 4096, "host"), "no block-attention kernel")])
def test_refusals(args, match):
    with pytest.raises(DFlashError, match=match):
        attention_dispatch(*args)


def test_mlir():
    d = attention_dispatch(1, 8, 64, 128, 36, 4096, "sm_80", name="at")
    assert d.row_groups == 4 and abs(d.scale - 128 ** -0.5) < 1e-12
    assert "@at_exe::@dflash_attention" in d.mlir and "util.global private mutable @at_cnt = dense<0> : tensor<32xi32>" in d.mlir
    assert "tensor<1x36x2x4096x1024xbf16>" in d.mlir and "tensor<1x1x64x?xi1>" in d.mlir


def test_mlir_token_major():
    """With g, q and the result in the model's layout: [S, T, Hkv * g, D] in, [S, T, Hkv * g * D] out."""
    d = attention_dispatch(1, 8, 64, 128, 36, 4096, "sm_80", name="at", g=4)
    assert ("util.func private @at(%q: tensor<1x16x32x128xbf16>, %cache: tensor<1x36x2x4096x1024xbf16>, "
            "%mask: tensor<1x1x64x?xi1>, %layer: i32) -> tensor<1x16x4096xbf16>") in d.mlir
    assert "%cG = arith.constant 4 : i32" in d.mlir and "constants = 10" in d.mlir
    with pytest.raises(DFlashError, match="do not divide"):
        attention_dispatch(1, 8, 18, 128, 36, 4096, "sm_80", g=4)


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151", "gfx1030"])
def test_compiles_for_gpu_targets(arch):
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export.compile import compile_flags, resolve_arch

    flags = [f for f in compile_flags(resolve_arch(arch)[0]) if "opt-level" not in f]
    for S, Hkv, R, D in [(1, 8, 64, 128), (1, 8, 4, 128), (2, 2, 24, 64)]:
        d = attention_dispatch(S, Hkv, R, D, 4, 512, arch)
        assert len(ic.compile_str(standalone_module(d), extra_args=flags + d.flags)) > 10000


# The model's own attention over the cache (export/qwen3.py `cache_attention`: its cache read and the
# named op), over every layer of a tiny bf16 cache: T tokens, g query heads per KV head.
LAYERS, CONTEXT, HKV, HD, PAGE = 2, 128, 2, 16, 32


def _layers_module(scale: float | None = None):
    """forward(q [LAYERS, 1, T, Hq, HD], cache [1, LAYERS, 2, CONTEXT, HKV * HD], start [1], pages [P])
    -> [LAYERS, 1, T, Hq * HD]; with SCALE, the named op is called with that scale."""
    import torch

    from dflash_iree.export import ops, qwen3

    class Layers(torch.nn.Module):
        def forward(self, q, cache, start, pages):
            read_len = pages.shape[0] * PAGE
            positions = start[:, None] + torch.arange(q.shape[2], dtype=torch.int64)
            outs = []
            for layer in range(LAYERS):
                if scale is None:
                    outs.append(qwen3.cache_attention(q[layer], cache, layer, read_len, positions, "fused"))
                    continue
                keys = cache[:, layer, 0, :read_len].view(1, read_len, HKV, HD)
                values = cache[:, layer, 1, :read_len].view(1, read_len, HKV, HD)
                visible = torch.arange(read_len)[None, None, :] <= positions[:, :, None]
                ref = qwen3.attend(q[layer], keys, values, visible)
                mask = qwen3.query_rows_mask(visible, q.shape[3] // HKV)
                outs.append(ops.block_attention(q[layer], cache, layer, mask, ref, None, scale))
            return torch.stack(outs)

    return Layers()


def _export(tmp_path, T: int, g: int, scale: float | None = None):
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")

    q = torch.zeros(LAYERS, 1, T, HKV * g, HD, dtype=torch.bfloat16)
    cache = torch.zeros(1, LAYERS, 2, CONTEXT, HKV * HD, dtype=torch.bfloat16)
    pages = torch.export.Dim("P", min=1, max=CONTEXT // PAGE)
    out = aot.export(_layers_module(scale), args=(q, cache, torch.tensor([5]), torch.zeros(2, dtype=torch.int8)),
                     dynamic_shapes={"q": None, "cache": None, "start": None, "pages": {0: pages}})
    path = tmp_path / f"attn-t{T}{'' if scale is None else '-scaled'}.mlir"
    out.save_mlir(path)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attention")
    return {T: _export(tmp, T, 2) for T in (1, 4)}


@pytest.mark.parametrize("arch,T,taken", [("sm_80", 4, True), ("gfx1151", 4, True), ("host", 4, False),
                                          ("sm_80", 1, True), ("gfx1030", 1, False)])
def test_splice_takes_the_block_attention(exported, tmp_path, arch, T, taken):
    """Verify's attention takes the kernel, one call per layer with the cache read whole, and so does
    decode's (R = g) on an arch with the skinny GEMM (row invariance); decode's on gfx1030 (no GEMM:
    under ATTENTION_MIN_ROWS) and the host's go to IREE: the op's reference, the model's sdpa."""
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_flags, resolve_arch

    src = exported[T]
    out, flags, report = splice.splice_file(src, tmp_path / "s.mlirbc", arch, {"attention": splice.lower_attention})
    text = str(splice.load(out))
    assert "torch.operator" not in text
    if not taken:
        assert flags == [] and "attention" not in report and sum(report["iree"]["attention"].values()) == LAYERS
        assert text.count("torch.aten.scaled_dot_product_attention") == LAYERS
        return
    # q and the result in the model's layout (g = 2 query heads a KV head); the reference ops are dead
    name = f"dflash_attention_1x{HKV}x{2 * T}x{HD}_{LAYERS}x{CONTEXT}_g2"
    assert text.count(f"util.call @{name}(") == LAYERS and "iree" not in report
    assert report["attention"] == [{"S": 1, "Hkv": HKV, "R": 2 * T, "head_dim": HD, "ops": LAYERS, "g": 2}]
    extra = [f for f in compile_flags(resolve_arch(arch)[0]) if "opt-level" not in f]
    assert len(ic.compile_file(str(out), extra_args=extra + flags)) > 10000


def test_splice_min_rows(exported, tmp_path):
    """min_rows sets the floor: ATTENTION_MIN_ROWS (the rules before row invariance) gives decode's
    attention to IREE on sm_80, 1 takes it on gfx1030 (bench/attention_bench.py)."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    before = functools.partial(splice.lower_attention, min_rows=splice.ATTENTION_MIN_ROWS)
    _, _, report = splice.splice_file(exported[1], tmp_path / "s.mlirbc", "sm_80", {"attention": before})
    assert "attention" not in report and sum(report["iree"]["attention"].values()) == LAYERS
    take = functools.partial(splice.lower_attention, min_rows=1)
    _, _, report = splice.splice_file(exported[1], tmp_path / "s.mlirbc", "gfx1030", {"attention": take})
    assert report["attention"][0]["R"] == 2


def test_splice_scale(tmp_path):
    """An explicit scale is passed on (one function per f32 scale, named by its bits)."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    src = _export(tmp_path, 4, 2, scale=0.125)
    out, _, _ = splice.splice_file(src, tmp_path / "s.mlirbc", "sm_80", {"attention": splice.lower_attention})
    text = str(splice.load(out))
    assert text.count(f"util.call @dflash_attention_1x{HKV}x8x{HD}_{LAYERS}x{CONTEXT}_s3e000000_g2") == LAYERS
    assert "arith.constant 1043900987 : i32" in text  # 0.125 * log2(e) as f32 bits: the scale push constant


def test_numpy_reference_matches_torch():
    """kernels/attention/reference.py against torch's scaled_dot_product_attention in float64, over a
    layer of the cache with a partial mask (what bench/attention_bench.py scores the kernel with)."""
    import numpy as np
    import torch

    from dflash_iree.kernels.attention.reference import attention

    rng = np.random.default_rng(0)
    S, H, R, D, L, C, N, layer = 2, 2, 5, 16, 3, 64, 40, 1
    q = rng.standard_normal((S, H, R, D))
    cache = rng.standard_normal((S, L, 2, C, H * D))
    mask = rng.random((S, 1, R, N)) < 0.7
    mask[..., 0] = True
    kv = torch.from_numpy(cache[:, layer, :, :N]).reshape(S, 2, N, H, D).transpose(2, 3)
    want = torch.nn.functional.scaled_dot_product_attention(torch.from_numpy(q), kv[:, 0], kv[:, 1],
                                                            attn_mask=torch.from_numpy(mask))
    np.testing.assert_allclose(attention(q, cache, mask, layer), want.numpy(), rtol=1e-12, atol=1e-12)
