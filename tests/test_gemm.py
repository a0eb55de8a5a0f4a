"""Skinny-GEMM custom dispatch: committed objects, MLIR text and plans, refusals, compile for GPU targets,
the parity rule. The kernel itself runs only on a GPU (bench/gemm_bench.py on the H200)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.kernels.gemm import reference as gref
from dflash_iree.kernels.gemm import ARCHS, CUDA_ARCHS, HIP_ARCHS, gemm_dispatch, gemm_plan, object_file, standalone_module
from dflash_iree.kernels.isa import GEMM_KERNELS, Elf, amdgpu_kernels, inspect_object

SHAPES_8B = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]


@pytest.mark.parametrize("arch", ARCHS)
def test_object_is_sound(arch):
    path = object_file(arch)
    assert path.is_file(), f"{path} missing: make kernels"
    assert inspect_object(path, arch, GEMM_KERNELS) == []
    if arch in CUDA_ARCHS:
        ptx = path.read_text()
        assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") >= 2
        assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx
    else:
        metas = amdgpu_kernels(path)
        for k in GEMM_KERNELS:
            # the last-arrival flag; swiglu: and up's rounded sums, 2 KiB an m-tile
            lds = 4 + (2048 * int(k[-1]) if k.startswith("dflash_swiglu") else 0)
            assert metas[k][".vgpr_count"] <= 256 and metas[k][".group_segment_fixed_size"] <= lds, k
        # 1, 2 and 3 weights x 1..4 m-tiles, each tile's WMMAs of a round
        assert wmma_count(path) >= 3 * 4 * (1 + 2 + 3 + 4), "v_wmma_f32_16x16x16_bf16 missing from the ISA"


def wmma_count(path) -> int:
    """Instructions whose first dword is 0xCC41xxxx (v_wmma_f32_16x16x16_bf16, VOP3P, gfx11 and gfx12
    alike: llvm-objdump-19 shows CC41....) in the .text section, at 4-byte steps."""
    elf = Elf(path.read_bytes())
    sec = elf.sections[elf.section_names.index(".text")]
    off, size = sec[4], sec[5]
    words = np.frombuffer(elf.data[off:off + size - size % 4], dtype="<u4")
    return int(((words >> 16) == 0xCC41).sum())


def test_plan_depends_on_n_k_arch_only():
    for N, K in SHAPES_8B:
        for arch in ARCHS:
            texts = {M: gemm_dispatch(M, N, K, arch) for M in (1, 8, 16, 17, 64)}
            assert len({(d.plan.splits, d.plan.block_n) for d in texts.values()}) == 1
            kr = re.findall(r"%cKR = arith.constant (\d+)", texts[1].mlir)
            assert kr == [str(K // texts[1].plan.splits)]


def test_plans_for_the_h200():
    # 2.9 workgroups of 128 threads per SM at least (132 SMs), fewest splits: what measured best.
    got = {nk: gemm_plan(*nk, "sm_80").splits for nk in SHAPES_8B}
    assert got == {(4096, 4096): 4, (1024, 4096): 16, (12288, 4096): 1, (4096, 12288): 3, (151936, 4096): 1}


def test_mlir_text():
    d = gemm_dispatch(16, 4096, 4096, "sm_80", name="mm_a")
    assert "util.func private @mm_a(%x: tensor<16x4096xbf16>, %w: tensor<4096x4096xbf16>) -> tensor<16x4096xbf16>" in d.mlir
    assert "@mm_a_mm::@dflash_gemm_mt1" in d.mlir and "reduce" not in d.mlir
    assert "tensor<4x16x4096xf32>" in d.mlir and "util.global private mutable @mm_a_cnt = dense<0> : tensor<128xi32>" in d.mlir
    one = gemm_dispatch(64, 151936, 4096, "sm_80", name="lm")
    assert "dflash_gemm_mt4" in one.mlir and "tensor<1xf32>" in one.mlir
    defined = re.findall(r"(?:hal\.executable\.source|util\.global|util\.func) private (?:mutable )?@(\w+)", one.mlir)
    assert defined == ["lm_mm", "lm_cnt", "lm"]
    assert d.flags == [f"--iree-hal-executable-object-search-path={object_file('sm_80').parent}"]


def test_plan_spreads_a_partial_second_wave():
    """On CUDA an unsplit pass of 2..4 waves of resident workgroups (4 a SM) becomes that many
    passes of fewer workgroups; many waves (lm_head) keep one column block a workgroup, and so does
    every plan with k splits (fewer splits is the better way there) and every gfx plan (the gfx
    objects are built without the block loop)."""
    gu = gemm_plan((12288, 12288), 4096, "sm_80")
    assert (gu.col_blocks, gu.splits, gu.grid_x, gu.passes) == (768, 1, 384, 2)
    assert "%gx = arith.constant 384 : index" in gemm_dispatch(16, (12288, 12288), 4096, "sm_80").mlir
    lm = gemm_plan(151936, 4096, "sm_80")
    assert lm.grid_x == lm.col_blocks == 4748
    shapes = SHAPES_8B + [((4096, 1024, 1024), 4096), ((12288, 12288), 4096), ((4096, 1024), 4096),
                          (5120, 5120), (5120, 17408), ((17408, 17408), 5120), ((8192, 1024, 1024), 8192)]
    for N, K in shapes:
        for arch in ARCHS:
            p = gemm_plan(N, K, arch)
            assert p.passes == 1 or (p.splits == 1 and arch in CUDA_ARCHS), (N, K, arch, p)
            if arch in HIP_ARCHS:
                assert p.grid_x == p.col_blocks


def test_entry_points_match_the_pipeline_layout():
    """Each PTX entry point takes the layout's bindings as pointers, then its push constants."""
    from dflash_iree.kernels.gemm import pipeline_layout

    ptx = object_file("sm_80").read_text()
    for G in (1, 2, 3):
        d = gemm_dispatch(16, (64,) * G, 128, "sm_80")
        entry = f"dflash_gemm{G if G > 1 else ''}_mt1"
        params = re.search(rf"\.entry {entry}\((.*?)\)", ptx, re.S)[1]
        assert params.count(".param .u64") == 2 * G + 3 and params.count(".param .u32") == 5 + G
        assert pipeline_layout(5 + G, 1 + G, 2 * G + 3) in d.mlir
    for epilogue, N, entry in (("residual", 64, "dflash_gemm_res_mt1"), ("swiglu", (64, 64), "dflash_swiglu_mt1")):
        d = gemm_dispatch(16, N, 128, "sm_80", epilogue=epilogue)
        params = re.search(rf"\.entry {entry}\((.*?)\)", ptx, re.S)[1]
        assert params.count(".param .u64") == 6 and params.count(".param .u32") == 6
        assert pipeline_layout(6, 3, 6) in d.mlir and f"::@{entry}[" in d.mlir


def test_epilogue_mlir_text():
    """residual: r in, r + x.W^T out, in the model's [1, M, N]; swiglu: gate and up in, one [M, N]
    out, the plan of the two weights side by side (the same splits as the plain pair)."""
    d = gemm_dispatch(16, 4096, 12288, "sm_80", name="down", epilogue="residual", out_shape=(1, 16, 4096))
    assert ("util.func private @down(%x: tensor<16x12288xbf16>, %w: tensor<4096x12288xbf16>, "
            "%res: tensor<1x16x4096xbf16>) -> tensor<1x16x4096xbf16>") in d.mlir
    assert d.plan == gemm_plan(4096, 12288, "sm_80") and "tensor<3x16x4096xf32>" in d.mlir
    s = gemm_dispatch(16, (12288, 12288), 4096, "sm_80", name="mlp", epilogue="swiglu")
    assert ("util.func private @mlp(%x: tensor<16x4096xbf16>, %w0: tensor<12288x4096xbf16>, "
            "%w1: tensor<12288x4096xbf16>) -> tensor<16x12288xbf16>") in s.mlir
    plain = gemm_plan((12288, 12288), 4096, "sm_80")
    assert (s.plan.col_blocks, s.plan.splits, s.plan.grid_x) == (plain.col_blocks, plain.splits, plain.grid_x)
    for n in (752, 528, 1024, 3072, 12288):  # the plain pair's splits, so each weight's bits are the plain dispatch's
        for K, arch in ((4096, "sm_80"), (2048, "gfx1151"), (4096, "gfx1100")):
            assert gemm_plan((n, n), K, arch, paired=True).splits == gemm_plan((n, n), K, arch).splits, (n, K, arch)
    small = gemm_dispatch(16, (1024, 1024), 4096, "gfx1151", name="m2", epilogue="swiglu")
    assert small.plan.col_blocks == 1024 // 64 and f"tensor<{small.plan.splits}x16x2048xf32>" in small.mlir
    for args, kw, match in [((16, (64, 64), 128, "sm_80"), {"epilogue": "residual"}, "one weight"),
                            ((16, (64, 128), 128, "sm_80"), {"epilogue": "swiglu"}, "equal rows"),
                            ((16, 64, 128, "sm_80"), {"epilogue": "gelu"}, "epilogue 'gelu'"),
                            ((16, 64, 128, "sm_80"), {"epilogue": "residual", "out_shape": (2, 16, 64)}, "out_shape")]:
        with pytest.raises(DFlashError, match=match):
            gemm_dispatch(*args, **kw)


def test_grouped_mlir_text():
    """q, k and v of one x in one dispatch: one grid over the three weights' column blocks."""
    d = gemm_dispatch(16, (4096, 1024, 1024), 4096, "sm_80", name="qkv")
    assert ("util.func private @qkv(%x: tensor<16x4096xbf16>, %w0: tensor<4096x4096xbf16>, %w1: tensor<1024x4096xbf16>, "
            "%w2: tensor<1024x4096xbf16>) -> (tensor<16x4096xbf16>, tensor<16x1024xbf16>, tensor<16x1024xbf16>)") in d.mlir
    assert "@qkv_mm::@dflash_gemm3_mt1[%gx, %gy]" in d.mlir and "constants = 8" in d.mlir
    assert d.mlir.count("#hal.pipeline.binding<storage_buffer, ReadOnly>") == 4
    assert d.mlir.count("#hal.pipeline.binding<storage_buffer>") == 5
    # 128 + 32 + 32 column blocks of 32: 2 splits reach 2.9 workgroups per SM where q alone needs 4.
    assert d.plan.col_blocks == 192 and d.plan.splits == 2 and "tensor<2x16x6144xf32>" in d.mlir
    assert "dense<0> : tensor<192xi32>" in d.mlir
    assert gemm_plan((12288, 12288), 4096, "sm_80").splits == 1
    with pytest.raises(DFlashError, match="1..3 weights"):
        gemm_dispatch(16, (64, 64, 64, 64), 128, "sm_80")
    with pytest.raises(DFlashError, match="multiple of 16"):
        gemm_dispatch(16, (64, 24), 128, "sm_80")


@pytest.mark.parametrize("args,match", [((0, 64, 128, "sm_80"), "outside 1..64"), ((65, 64, 128, "sm_80"), "outside"),
                                        ((1, 24, 128, "sm_80"), "multiple of 16"), ((1, 64, 48, "sm_80"), "multiple of 32"),
                                        ((1, 64, 40, "gfx1151"), "multiple of 16"), ((1, 64, 128, "host"), "no skinny-GEMM"),
                                        ((1, 64, 128, "gfx1030"), "no skinny-GEMM")])
def test_refusals(args, match):
    with pytest.raises(DFlashError, match=match):
        gemm_dispatch(*args)


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151"])
def test_compiles_for_gpu_targets(arch):
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.kernels.topk import device_flags

    for M, N, K, epi in [(1, 1024, 4096, None), (16, 4096, 4096, None), (64, 4096, 12288, None), (16, 128, 384, None),
                         (16, (128, 64, 64), 384, None), (8, (256, 256), 384, None), (16, 4096, 12288, "residual"),
                         (33, (256, 256), 384, "swiglu"), (16, (12288, 12288), 4096, "swiglu")]:
        d = gemm_dispatch(M, N, K, arch, epilogue=epi)
        vmfb = ic.compile_str(standalone_module(d), extra_args=device_flags(arch) + d.flags)
        assert len(vmfb) > 10000


def test_parity_rule():
    rng = np.random.default_rng(0)
    x = gref.bf16_bits(rng.standard_normal((4, 256)).astype(np.float32))
    w = gref.bf16_bits(rng.standard_normal((32, 256)).astype(np.float32))
    ref, _ = gref.reference(x, w)
    exact = gref.bf16_bits(ref.astype(np.float32))
    assert gref.score(exact, x, w)["bad"] == 0
    off = exact.copy()
    i = np.unravel_index(np.argmax(np.abs(ref)), ref.shape)
    off[i] = off[i] + 2  # two ulps away on the largest output: must fail
    assert gref.score(off, x, w)["bad"] == 1


# A torch-dialect linear as the export writes it: mm(x, transpose(weight global)).
_LINEAR = """
module @m {{
  util.global private @w = dense<0.5> : tensor<{N}x{K}xbf16>
  func.func @f(%x: !torch.vtensor<[{M},{K}],bf16>) -> !torch.vtensor<[{M},{N}],bf16> {{
    %w = util.global.load @w : tensor<{N}x{K}xbf16>
    %wt = torch_c.from_builtin_tensor %w : tensor<{N}x{K}xbf16> -> !torch.vtensor<[{N},{K}],bf16>
    %i0 = torch.constant.int 0
    %i1 = torch.constant.int 1
    %t = torch.aten.transpose.int %wt, %i0, %i1 : !torch.vtensor<[{N},{K}],bf16>, !torch.int, !torch.int -> !torch.vtensor<[{K},{N}],bf16>
    %y = torch.aten.mm %x, %t : !torch.vtensor<[{M},{K}],bf16>, !torch.vtensor<[{K},{N}],bf16> -> !torch.vtensor<[{M},{N}],bf16>
    return %y : !torch.vtensor<[{M},{N}],bf16>
  }}
}}
"""


@pytest.mark.parametrize("arch,M,taken", [("sm_80", 16, True), ("gfx1151", 8, True), ("host", 16, False),
                                          ("gfx1030", 16, False), ("sm_80", 1, False), ("sm_80", 65, False)])
def test_splice_replaces_linear(tmp_path, arch, M, taken):
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    src = tmp_path / "m.mlir"
    src.write_text(_LINEAR.format(M=M, N=128, K=512))
    gemm = functools.partial(splice.splice_gemm, min_weight_bytes=0)  # a small weight, to compile fast
    out, flags = splice.splice_file(src, tmp_path / "s.mlirbc", arch, {"gemm": gemm})
    report = splice.last_report()
    if not taken:
        assert (out, flags, report) == (src, [], {})
        return
    text = str(splice.load(out))
    assert "torch.aten.mm" not in text and f"util.call @dflash_gemm_{M}x128x512" in text
    assert report == {"gemm": [{"M": M, "N": 128, "K": 512, "ops": 1, "mms": 1, "splits": gemm_plan(128, 512, arch).splits}]}
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.kernels.topk import device_flags

    assert len(ic.compile_file(str(out), extra_args=device_flags(arch) + flags)) > 10000


@pytest.mark.parametrize("N,taken", [(128, False), (4096, True)])
def test_splice_leaves_small_weights_to_iree(tmp_path, N, taken):
    """By default only weights of at least GEMM_MIN_WEIGHT_BYTES (4 MiB) take the dispatch."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    src = tmp_path / "m.mlir"
    src.write_text(_LINEAR.format(M=16, N=N, K=512))
    out, _ = splice.splice_file(src, tmp_path / "s.mlirbc", "sm_80", {"gemm": splice.splice_gemm})
    assert (out != src) == taken and (2 * N * 512 >= splice.GEMM_MIN_WEIGHT_BYTES) == taken


# The q, k and v projections as the export writes them: three views of one [1, M, K] value, each
# multiplied by a transposed weight global; o's input is another value.
_QKVO = """
module @m {{
  util.global private @q = dense<0.5> : tensor<{N}x{K}xbf16>
  util.global private @k = dense<0.25> : tensor<{Nkv}x{K}xbf16>
  util.global private @v = dense<0.125> : tensor<{Nv}x{K}xbf16>
  util.global private @o = dense<0.5> : tensor<{N}x{K}xbf16>
  func.func @f(%h: !torch.vtensor<[1,{M},{K}],bf16>, %a: !torch.vtensor<[{M},{K}],bf16>) -> (!torch.vtensor<[{M},{N}],bf16>, !torch.vtensor<[{M},{Nkv}],bf16>, !torch.vtensor<[{M},{Nv}],bf16>, !torch.vtensor<[{M},{N}],bf16>) {{
    %i0 = torch.constant.int 0
    %i1 = torch.constant.int 1
    %iM = torch.constant.int {M}
    %iK = torch.constant.int {K}
    %shape = torch.prim.ListConstruct %iM, %iK : (!torch.int, !torch.int) -> !torch.list<int>
{mms}
    return %y_q, %y_k, %y_v, %y_o : !torch.vtensor<[{M},{N}],bf16>, !torch.vtensor<[{M},{Nkv}],bf16>, !torch.vtensor<[{M},{Nv}],bf16>, !torch.vtensor<[{M},{N}],bf16>
  }}
}}
"""
_MM = """    %g_{w} = util.global.load @{w} : tensor<{n}x{K}xbf16>
    %t_{w} = torch_c.from_builtin_tensor %g_{w} : tensor<{n}x{K}xbf16> -> !torch.vtensor<[{n},{K}],bf16>
    %tt_{w} = torch.aten.transpose.int %t_{w}, %i0, %i1 : !torch.vtensor<[{n},{K}],bf16>, !torch.int, !torch.int -> !torch.vtensor<[{K},{n}],bf16>
    %x_{w} = {x}
    %y_{w} = torch.aten.mm %x_{w}, %tt_{w} : !torch.vtensor<[{M},{K}],bf16>, !torch.vtensor<[{K},{n}],bf16> -> !torch.vtensor<[{M},{n}],bf16>
"""


@pytest.mark.parametrize("M", [16, 1])
def test_splice_groups_the_mms_of_one_x(tmp_path, M):
    """q, k and v (views of one value) become one grouped dispatch; o (another x) its own. At M = 1
    (decode) only the run of three is taken: a lone weight stays IREE's matvec, faster there."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    N, Nkv, Nv, K = 128, 64, 96, 384
    view = "torch.aten.view %h, %shape : !torch.vtensor<[1,{M},{K}],bf16>, !torch.list<int> -> !torch.vtensor<[{M},{K}],bf16>"
    mms = "".join(_MM.format(w=w, n=n, K=K, M=M, x=(view if w != "o" else "torch.aten.clone %a, %none : !torch.vtensor<[{M},{K}],bf16>, !torch.none -> !torch.vtensor<[{M},{K}],bf16>").format(M=M, K=K))
                  for w, n in (("q", N), ("k", Nkv), ("v", Nv), ("o", N)))
    mms = "    %none = torch.constant.none\n" + mms
    src = tmp_path / "m.mlir"
    src.write_text(_QKVO.format(M=M, N=N, Nkv=Nkv, Nv=Nv, K=K, mms=mms))
    gemm = functools.partial(splice.splice_gemm, min_weight_bytes=0)
    out, flags = splice.splice_file(src, tmp_path / "s.mlirbc", "sm_80", {"gemm": gemm})
    group = {"M": M, "N": [N, Nkv, Nv], "K": K, "ops": 1, "mms": 3, "splits": gemm_plan((N, Nkv, Nv), K, "sm_80").splits}
    lone = {"M": M, "N": N, "K": K, "ops": 1, "mms": 1, "splits": gemm_plan(N, K, "sm_80").splits}
    assert splice.last_report() == {"gemm": [group] if M == 1 else [lone, group]}
    text = str(splice.load(out))  # the module verified: each result went to its own mm's uses (the types differ)
    assert text.count("torch.aten.mm") == (M == 1) and f"util.call @dflash_gemm_{M}x{N}_{Nkv}_{Nv}x{K}" in text
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.kernels.topk import device_flags

    assert len(ic.compile_file(str(out), extra_args=device_flags("sm_80") + flags)) > 10000


@pytest.mark.parametrize("M", [16, 1])
def test_splice_runs_of_three_and_mutable_globals(tmp_path, M):
    """Five mms of one x become a run of 3 and a run of 2, in module order; an mm of a mutable
    global (state, not a weight) is left to IREE. At M = 1 only a group of exactly three (a layer's
    q, k and v) is taken: five stay IREE's."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    K, ns = 384, [64, 80, 96, 112, 128]
    head = [f"  util.global private @w{i} = dense<0.5> : tensor<{n}x{K}xbf16>" for i, n in enumerate(ns)]
    head.append(f"  util.global private mutable @s = dense<0.5> : tensor<64x{K}xbf16>")
    outs = [f"!torch.vtensor<[{M},{n}],bf16>" for n in ns + [64]]
    body = [f"    %i0 = torch.constant.int 0", f"    %i1 = torch.constant.int 1",
            f"    %iM = torch.constant.int {M}", f"    %iK = torch.constant.int {K}",
            "    %shape = torch.prim.ListConstruct %iM, %iK : (!torch.int, !torch.int) -> !torch.list<int>"]
    for i, n in enumerate(ns + [64]):
        g = f"w{i}" if i < len(ns) else "s"
        body.append(_MM.format(w=g, n=n, K=K, M=M, x=f"torch.aten.view %h, %shape : !torch.vtensor<[1,{M},{K}],bf16>, "
                               f"!torch.list<int> -> !torch.vtensor<[{M},{K}],bf16>"))
    rets = ", ".join(f"%y_w{i}" for i in range(len(ns))) + ", %y_s"
    src = tmp_path / "m.mlir"
    src.write_text("module @m {\n" + "\n".join(head) + f"\n  func.func @f(%h: !torch.vtensor<[1,{M},{K}],bf16>) -> "
                   f"({', '.join(outs)}) {{\n" + "\n".join(body) + f"\n    return {rets} : {', '.join(outs)}\n  }}\n}}\n")
    out, _ = splice.splice_file(src, tmp_path / "s.mlirbc", "sm_80",
                                {"gemm": functools.partial(splice.splice_gemm, min_weight_bytes=0)})
    if M == 1:
        assert out == src and splice.last_report() == {}
        return
    assert [g["N"] for g in splice.last_report()["gemm"]] == [[64, 80, 96], [112, 128]]
    assert str(splice.load(out)).count("torch.aten.mm") == 1


# A Qwen3 MLP block as the export writes it (gate and up of one [1, M, K] value, silu(gate) * up,
# down, then the residual add), for the epilogues.
_MLP = """
module @m {{
  util.global private @g = dense<0.5> : tensor<{I}x{K}xbf16>
  util.global private @u = dense<0.25> : tensor<{I}x{K}xbf16>
  util.global private @d = dense<0.125> : tensor<{K}x{I}xbf16>
  func.func @f(%h: !torch.vtensor<[1,{M},{K}],bf16>, %res: !torch.vtensor<[1,{M},{K}],bf16>) -> ({rtypes}) {{
    %i0 = torch.constant.int 0
    %i1 = torch.constant.int 1
    %alpha = torch.constant.int {alpha}
    %iM = torch.constant.int {M}
    %iK = torch.constant.int {K}
    %iI = torch.constant.int {I}
    %s2 = torch.prim.ListConstruct %iM, %iK : (!torch.int, !torch.int) -> !torch.list<int>
    %s3 = torch.prim.ListConstruct %i1, %iM, %iI : (!torch.int, !torch.int, !torch.int) -> !torch.list<int>
    %s2i = torch.prim.ListConstruct %iM, %iI : (!torch.int, !torch.int) -> !torch.list<int>
    %s3k = torch.prim.ListConstruct %i1, %iM, %iK : (!torch.int, !torch.int, !torch.int) -> !torch.list<int>
{body}
  }}
}}
"""
_MLP_BODY = """{mm_g}    %vg = torch.aten.view %y_g, %s3 : !torch.vtensor<[{M},{I}],bf16>, !torch.list<int> -> !torch.vtensor<[1,{M},{I}],bf16>
    %sg = torch.aten.silu %vg : !torch.vtensor<[1,{M},{I}],bf16> -> !torch.vtensor<[1,{M},{I}],bf16>
{mm_u}    %vu = torch.aten.view %y_u, %s3 : !torch.vtensor<[{M},{I}],bf16>, !torch.list<int> -> !torch.vtensor<[1,{M},{I}],bf16>
    %p = torch.aten.mul.Tensor %vu, %sg : !torch.vtensor<[1,{M},{I}],bf16>, !torch.vtensor<[1,{M},{I}],bf16> -> !torch.vtensor<[1,{M},{I}],bf16>
{mm_d}    %vd = torch.aten.view %y_d, %s3k : !torch.vtensor<[{M},{K}],bf16>, !torch.list<int> -> !torch.vtensor<[1,{M},{K}],bf16>
    %out = torch.aten.add.Tensor %res, %vd, %alpha : !torch.vtensor<[1,{M},{K}],bf16>, !torch.vtensor<[1,{M},{K}],bf16>, !torch.int -> !torch.vtensor<[1,{M},{K}],bf16>
    return %out{extra} : {rtypes}
"""


def _mlp_module(M: int, K: int, I: int, alpha: int = 1, leak: bool = False) -> str:
    """LEAK: silu(gate) is returned too (a second use), so the swiglu epilogue must not take it."""
    view = f"torch.aten.view %h, %s2 : !torch.vtensor<[1,{M},{K}],bf16>, !torch.list<int> -> !torch.vtensor<[{M},{K}],bf16>"
    mm_d = _MM.format(w="d", n=K, K=I, M=M, x=f"torch.aten.view %p, %s2i : !torch.vtensor<[1,{M},{I}],bf16>, "
                      f"!torch.list<int> -> !torch.vtensor<[{M},{I}],bf16>")
    rtypes = f"!torch.vtensor<[1,{M},{K}],bf16>" + (f", !torch.vtensor<[1,{M},{I}],bf16>" if leak else "")
    body = _MLP_BODY.format(mm_g=_MM.format(w="g", n=I, K=K, M=M, x=view), mm_u=_MM.format(w="u", n=I, K=K, M=M, x=view),
                            mm_d=mm_d, M=M, K=K, I=I, extra=", %sg" if leak else "", rtypes=rtypes)
    return _MLP.format(M=M, K=K, I=I, alpha=alpha, rtypes=rtypes, body=body)


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151"])
def test_splice_epilogues(tmp_path, arch):
    """gate + up + silu * mul become one swiglu dispatch, down + the residual add one residual
    dispatch; with epilogues off, the plain grouped and single dispatches (and the elementwise ops
    stay with IREE)."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    M, K, I = 16, 256, 512
    src = tmp_path / "m.mlir"
    src.write_text(_mlp_module(M, K, I))
    out, flags = splice.splice_file(src, tmp_path / "s.mlirbc", arch,
                                    {"gemm": functools.partial(splice.splice_gemm, min_weight_bytes=0)})
    assert [(g["N"], g["K"], g.get("epilogue")) for g in splice.last_report()["gemm"]] == [
        (K, I, "residual"), ([I, I], K, "swiglu")]
    text = str(splice.load(out))
    for gone in ("torch.aten.mm", "torch.aten.silu", "torch.aten.mul.Tensor", "torch.aten.add.Tensor"):
        assert gone not in text, gone
    assert f"util.call @dflash_gemm_{M}x{I}_{I}x{K}_swiglu_1x{M}x{I}" in text
    assert f"util.call @dflash_gemm_{M}x{K}x{I}_residual_1x{M}x{K}" in text
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.kernels.topk import device_flags

    assert len(ic.compile_file(str(out), extra_args=device_flags(arch) + flags)) > 10000
    out, _ = splice.splice_file(src, tmp_path / "p.mlirbc", arch,
                                {"gemm": functools.partial(splice.splice_gemm, min_weight_bytes=0, epilogues=False)})
    assert [g.get("epilogue") for g in splice.last_report()["gemm"]] == [None, None]
    text = str(splice.load(out))
    assert "torch.aten.silu" in text and "torch.aten.add.Tensor" in text


@pytest.mark.parametrize("alpha,leak", [(2, False), (1, True)])
def test_splice_epilogue_needs_the_exact_pattern(tmp_path, alpha, leak):
    """An add with alpha != 1, or a silu(gate) used elsewhere too, keeps the plain dispatch for that op."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    src = tmp_path / "m.mlir"
    src.write_text(_mlp_module(16, 256, 512, alpha=alpha, leak=leak))
    splice.splice_file(src, tmp_path / "s.mlirbc", "sm_80",
                       {"gemm": functools.partial(splice.splice_gemm, min_weight_bytes=0)})
    got = [g.get("epilogue") for g in splice.last_report()["gemm"]]
    assert got == ([None, "swiglu"] if alpha != 1 else ["residual", None])


def test_entry_points_stay_apart_in_one_module():
    """Dispatches of one object with the same layout and grid but different entry points (1 and 2
    m-tiles; the residual and swiglu epilogues) keep an executable each: iree-compile would
    otherwise merge them and launch one kernel for both (kernels/hal.py entry_attribute)."""
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.kernels.topk import device_flags

    for arch in ("sm_80", "gfx1151"):
        ds = [gemm_dispatch(16, 256, 512, arch, name="a"), gemm_dispatch(32, 256, 512, arch, name="b"),
              gemm_dispatch(16, 512, 256, arch, name="c", epilogue="residual"),
              gemm_dispatch(16, (512, 512), 256, arch, name="d", epilogue="swiglu")]
        x = {16: "tensor<16x512xbf16>", 32: "tensor<32x512xbf16>"}
        y = {16: "tensor<16x256xbf16>", 32: "tensor<32x256xbf16>"}
        w, x2, w2, o = "tensor<256x512xbf16>", "tensor<16x256xbf16>", "tensor<512x256xbf16>", "tensor<16x512xbf16>"
        text = "module @m {\n" + "".join(d.mlir for d in ds) + f"""
util.func public @f(%x: {x[16]}, %xb: {x[32]}, %w: {w}, %x2: {x2}, %w2: {w2}, %r: {o}) -> ({y[16]}, {y[32]}, {o}, {o}) {{
  %a = util.call @a(%x, %w) : ({x[16]}, {w}) -> {y[16]}
  %b = util.call @b(%xb, %w) : ({x[32]}, {w}) -> {y[32]}
  %c = util.call @c(%x2, %w2, %r) : ({x2}, {w2}, {o}) -> {o}
  %d = util.call @d(%x2, %w2, %w2) : ({x2}, {w2}, {w2}) -> {o}
  util.return %a, %b, %c, %d : {y[16]}, {y[32]}, {o}, {o}
}}
}}
"""
        hal = ic.compile_str(text, extra_args=device_flags(arch) + ds[0].flags + ["--compile-to=hal"]).decode()
        assert re.findall(r"hal\.executable private @(\w+)", hal) == ["a_mm", "b_mm", "c_mm", "d_mm"], arch
