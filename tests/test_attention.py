"""The block-attention dispatch (kernels/attention/): objects, MLIR, refusals, and the lowering of the
model's attention over the KV cache (the named op `dflash::block_attention`), gated (Qwen3.5 family)
too. The kernel runs only on a GPU: parity and speed are bench/attention_bench.py
on the H200 (experiments/2026-11-30-block-attention/)."""

from __future__ import annotations

import functools
import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.kernels.attention import ARCHS, attention_dispatch, object_file, standalone_module
from dflash_iree.kernels.isa import (ATTENTION_GATED_D256_KERNELS, ATTENTION_GATED_KERNELS, ATTENTION_KERNELS,
                                     amdgpu_kernels, inspect_object)

VARIANTS = [(128, False, ATTENTION_KERNELS), (128, True, ATTENTION_GATED_KERNELS),
            (256, True, ATTENTION_GATED_D256_KERNELS)]


@pytest.mark.parametrize("D,gated,kernels", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_objects_are_sound(arch, D, gated, kernels):
    """Every arch's object of each variant holds its entry point: gfx with no scratch and no spills,
    PTX 7.8 with no local memory."""
    assert inspect_object(object_file(arch, D, gated), arch, kernels) == []


@pytest.mark.parametrize("arch", [a for a in ARCHS if a.startswith("gfx")])
def test_gfx_budgets(arch):
    """Shared memory and registers per variant on gfx (attention_body.h's limits): every variant within
    64 KiB of LDS and 256 VGPRs, the wide one under CUDA's 48 KiB static limit too, and the Qwen3
    entry point's 43,652 bytes and 138 VGPRs as they were before the gated variants."""
    metas = {k: amdgpu_kernels(object_file(arch, D, gated))[k[0]] for D, gated, k in VARIANTS}
    lds = {k[0]: m[".group_segment_fixed_size"] for k, m in metas.items()}
    assert lds == {"dflash_attention": 43652, "dflash_attention_gated": 43652, "dflash_attention_gated_d256": 47492}
    assert max(lds.values()) <= 48 * 1024
    assert metas[ATTENTION_KERNELS][".vgpr_count"] == 138
    assert all(m[".vgpr_count"] <= 160 for m in metas.values())


def test_ptx_shared_memory_under_48k():
    """CUDA's static shared memory limit (48 KiB) holds for the wide variant's PTX."""
    import re

    ptx = object_file("sm_80", 256, True).read_text()
    total = sum(int(n) for n in re.findall(r"^\s*\.shared \.align \d+ \.b8 \S+\[(\d+)\];", ptx, re.M)) + 4
    assert total == 47492 and total <= 48 * 1024


@pytest.mark.parametrize("args,match", [((1, 8, 129, 128, 36, 4096, "sm_80"), "R=129"),
                                        ((1, 8, 16, 100, 36, 4096, "sm_80"), "head_dim 100"),
                                        ((1, 8, 16, 256, 36, 4096, "gfx1151"), "head_dim 256"),
                                        ((1, 8, 16, 264, 36, 4096, "gfx1151", True), "head_dim 264"),
                                        ((1, 8, 16, 128, 36, 4096, "host"), "no block-attention kernel")])
def test_refusals(args, match):
    with pytest.raises(DFlashError, match=match):
        attention_dispatch(*args[:7], gated=args[7] if len(args) > 7 else False)


def test_mlir():
    d = attention_dispatch(1, 8, 64, 128, 36, 4096, "sm_80", name="at")
    assert d.row_groups == 4 and abs(d.scale - 128 ** -0.5) < 1e-12
    assert "@at_exe::@dflash_attention" in d.mlir and "util.global private mutable @at_cnt = dense<0> : tensor<32xi32>" in d.mlir
    assert "tensor<1x36x2x4096x1024xbf16>" in d.mlir and "tensor<1x1x64x?xi1>" in d.mlir


def test_mlir_gated():
    """The gated variants: %gate of the result's type after the mask, a read-only binding (4 of 7), the
    entry point per head_dim; R up to 128 (27B verify: 16 x 6 = 96 rows)."""
    d = attention_dispatch(1, 4, 96, 256, 16, 4096, "sm_80", name="at", g=6, gated=True)
    assert d.entry == "dflash_attention_gated_d256" and d.row_groups == 6
    assert ("util.func private @at(%q: tensor<1x16x24x256xbf16>, %cache: tensor<1x16x2x4096x1024xbf16>, "
            "%mask: tensor<1x1x96x?xi1>, %gate: tensor<1x16x6144xbf16>, %layer: i32) -> tensor<1x16x6144xbf16>") in d.mlir
    assert "@at_exe::@dflash_attention_gated_d256" in d.mlir and "attention_gated_d256_sm_80.ptx" in d.mlir
    assert "constants = 10, bindings = [" + ", ".join(["#hal.pipeline.binding<storage_buffer, ReadOnly>"] * 4) in d.mlir
    assert "%m8, %gate, %cnt)" in d.mlir
    d = attention_dispatch(1, 2, 24, 64, 2, 1024, "gfx1151", name="at", g=3, gated=True)
    assert d.entry == "dflash_attention_gated" and "attention_gated_gfx1151.co" in d.mlir
    assert attention_dispatch(1, 8, 128, 128, 4, 512, "sm_80").row_groups == 8  # Qwen3 at g = 8, block 16


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
    for S, Hkv, R, D, gated in [(1, 8, 64, 128, False), (1, 8, 4, 128, False), (2, 2, 24, 64, False),
                                (1, 4, 96, 256, True), (1, 2, 24, 64, True)]:
        d = attention_dispatch(S, Hkv, R, D, 4, 512, arch, gated=gated)
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


def _head_major(x, Hkv: int, D: int):
    """[S, T, Hkv * g * D] (or [S, T, Hkv * g, D]) -> [S, Hkv, T * g, D]: row t * g + j of KV head h is
    query head h * g + j of token t (the kernel's rows)."""
    S, T = x.shape[:2]
    return x.reshape(S, T, Hkv, -1, D).permute(0, 2, 1, 3, 4).reshape(S, Hkv, -1, D)


@pytest.mark.parametrize("D,Hkv,g,T", [(256, 2, 3, 4), (64, 2, 3, 8)])
def test_numpy_reference_gated_matches_torch_eager(D, Hkv, g, T):
    """The gated reference (kernels/attention/reference.py, `gate`) against eager bf16 torch: given the
    attention in float64, bf16(o) * torch.sigmoid(gate) in bf16 is the reference's rule bit for bit but
    for near-ties of the sigmoid (at most 1 ulp); and the model's own eager bf16 gated attention
    (export/qwen35.py `gated_cache_attention`, its gate in [S, T, Hq * hd]) is within bf16 rounding
    of it, so that the reference reads the gate where the model keeps it."""
    import numpy as np
    import torch

    from dflash_iree.export import qwen35
    from dflash_iree.export.qwen3 import attention_fn, query_rows_mask
    from dflash_iree.kernels.attention.reference import attention, bits
    from dflash_iree.kernels.gemm.reference import ulp_distance

    torch.manual_seed(0)
    S, L, C, layer, start = 1, 2, 64, 1, 37
    Hq, N = Hkv * g, start + T
    q = torch.randn(S, T, Hq, D).to(torch.bfloat16)
    gate = (3 * torch.randn(S, T, Hq * D)).to(torch.bfloat16)
    cache = (0.5 * torch.randn(S, L, 2, C, Hkv * D)).to(torch.bfloat16)
    positions = start + torch.arange(T)[None]
    eager = qwen35.gated_cache_attention(q, gate, cache, layer, N, positions, "fused")  # bf16 [S, T, Hq * D]
    keys = cache[:, layer, 0, :N].view(S, N, Hkv, D).double()
    values = cache[:, layer, 1, :N].view(S, N, Hkv, D).double()
    visible = torch.arange(N)[None, None, :] <= positions[:, :, None]
    o64 = attention_fn("fused")(q.double(), keys, values, visible)
    rule = o64.to(torch.bfloat16) * torch.sigmoid(gate)  # eager bf16 from the exact attention

    mask = query_rows_mask(visible, g).numpy()
    want = attention(_head_major(q.float(), Hkv, D).numpy(), cache.float().numpy(), mask, layer,
                     gate=_head_major(gate.float(), Hkv, D).numpy())
    want = torch.from_numpy(want).reshape(S, Hkv, T, g, D).permute(0, 2, 1, 3, 4).reshape(S, T, Hq * D)
    d = ulp_distance(bits(want.numpy()), bits(rule.float().numpy()))
    assert d.max() <= 1 and (d == 0).mean() > 0.999, (d.max(), (d != 0).sum())
    np.testing.assert_allclose(eager.float().numpy(), want.numpy(), rtol=2 ** -6, atol=2 ** -10)


def _export_gated(tmp_path, T: int, g: int = 2):
    """The hybrid target's gated attention over every layer of the tiny cache (export/qwen35.py
    `gated_cache_attention`: the named op with its gate): forward(q [LAYERS, 1, T, Hq, HD], gate
    [LAYERS, 1, T, Hq * HD], cache, start, pages) -> [LAYERS, 1, T, Hq * HD]."""
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")
    from dflash_iree.export import qwen35

    class Layers(torch.nn.Module):
        def forward(self, q, gate, cache, start, pages):
            read_len = pages.shape[0] * PAGE
            positions = start[:, None] + torch.arange(q.shape[2], dtype=torch.int64)
            return torch.stack([qwen35.gated_cache_attention(q[layer], gate[layer], cache, layer, read_len, positions,
                                                             "fused") for layer in range(LAYERS)])

    q = torch.zeros(LAYERS, 1, T, HKV * g, HD, dtype=torch.bfloat16)
    gate = torch.zeros(LAYERS, 1, T, HKV * g * HD, dtype=torch.bfloat16)
    cache = torch.zeros(1, LAYERS, 2, CONTEXT, HKV * HD, dtype=torch.bfloat16)
    pages = torch.export.Dim("P", min=1, max=CONTEXT // PAGE)
    out = aot.export(Layers(), args=(q, gate, cache, torch.tensor([5]), torch.zeros(2, dtype=torch.int8)),
                     dynamic_shapes={"q": None, "gate": None, "cache": None, "start": None, "pages": {0: pages}})
    path = tmp_path / f"gated-t{T}.mlir"
    out.save_mlir(path)
    return path


@pytest.mark.parametrize("arch,T,taken", [("sm_80", 4, True), ("gfx1151", 1, True), ("gfx1030", 1, False),
                                          ("host", 4, False)])
def test_splice_takes_the_gated_attention(tmp_path, arch, T, taken):
    """A gated op (the Qwen3.5 family's) takes the gated kernel, its gate the extra operand: verify, and
    decode (R = g) on an arch with the skinny GEMM; gfx1030's decode and the host's stay IREE's."""
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_flags, resolve_arch

    out, flags, report = splice.splice_file(_export_gated(tmp_path, T), tmp_path / "s.mlirbc", arch,
                                            {"attention": splice.lower_attention})
    text = str(splice.load(out))
    assert "torch.operator" not in text
    if not taken:
        assert "attention" not in report and sum(report["iree"]["attention"].values()) == LAYERS
        return
    name = f"dflash_attention_1x{HKV}x{2 * T}x{HD}_{LAYERS}x{CONTEXT}_g2_gated"
    assert text.count(f"util.call @{name}(") == LAYERS and "iree" not in report
    assert "@dflash_attention_gated" in text
    assert report["attention"] == [{"S": 1, "Hkv": HKV, "R": 2 * T, "head_dim": HD, "ops": LAYERS, "g": 2,
                                     "gated": True}]
    extra = [f for f in compile_flags(resolve_arch(arch)[0]) if "opt-level" not in f]
    assert len(ic.compile_file(str(out), extra_args=extra + flags)) > 10000
