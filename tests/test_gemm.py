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
            # the last-arrival flag; swiglu: and up's rounded sums, 2 KiB an m-tile; the norm's four
            # warps' sums of squares and the prologue's row (16 KiB), aligned
            lds = (4 + (2048 * int(k[-1]) if k.startswith("dflash_swiglu") else 0)
                   + (16384 + 32 if "_norm_" in k else 16 if k == "dflash_rms_norm" else 0))
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


def _export_linears(tmp_path, M: int, body: str, Ns=(128,), K: int = 512, I: int = 512):
    """Export a module through export/qwen3.py's linear helpers (the named ops) on x [1, M, K] bf16:
    BODY "project" (one op over weights of Ns), "mlp" (MLP.add_to: swiglu, then down + residual);
    "normed": "project" and "mlp" with an RMSNorm before each (the decoder layer's form: the norm in
    the op, `project(.., norm)`, `MLP.add_normed`)."""
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")
    from types import SimpleNamespace

    from dflash_iree.export import qwen3

    class Linears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ws = torch.nn.ModuleList(torch.nn.Linear(K, n, bias=False, dtype=torch.bfloat16) for n in Ns)
            self.mlp = qwen3.MLP(SimpleNamespace(hidden_size=K, intermediate_size=I), torch.bfloat16)
            self.n1, self.n2 = (qwen3.RMSNorm(K, 1e-6, torch.bfloat16) for _ in range(2))

        def forward(self, x):
            if body == "mlp":
                return self.mlp.add_to(x, x * 2)
            if body == "normed":
                return (*qwen3.project(x, list(self.ws), self.n1), self.mlp.add_normed(x, self.n2))
            return tuple(qwen3.project(x, list(self.ws)))

    path = tmp_path / f"{body}-{M}.mlir"
    module = Linears()
    aot.externalize_module_parameters(module)  # weights as globals, as in the real export
    aot.export(module, args=(torch.zeros(1, M, K, dtype=torch.bfloat16),)).save_mlir(path)
    return path


def _lower(src, tmp_path, arch, **options):
    from dflash_iree.export import splice

    gemm = functools.partial(splice.lower_linear, **{"min_weight_bytes": 0, **options})  # small weights compile fast
    return splice.splice_file(src, tmp_path / "s.mlirbc", arch, {"gemm": gemm})


@pytest.mark.parametrize("arch,M,taken", [("sm_80", 16, True), ("gfx1151", 8, True), ("host", 16, False),
                                          ("gfx1030", 16, False), ("sm_80", 1, True), ("sm_80", 65, False)])
def test_splice_replaces_linear(tmp_path, arch, M, taken):
    """A lone weight takes the dispatch at every M the kernel has, decode's M = 1 too (row invariance)."""
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    out, flags, report = _lower(_export_linears(tmp_path, M, "project"), tmp_path, arch)
    text = str(splice.load(out))
    assert "torch.operator" not in text
    if not taken:  # the op's reference: IREE's own matmul
        assert flags == [] and "gemm" not in report and sum(report["iree"]["gemm"].values()) == 1
        assert "torch.aten.linear" in text  # aten.linear: this test exports without aot.py's 2-D decomposition
        return
    assert f"util.call @dflash_gemm_{M}x128x512" in text
    assert report["gemm"] == [{"M": M, "N": 128, "K": 512, "ops": 1, "mms": 1, "splits": gemm_plan(128, 512, arch).splits}]
    from dflash_iree.kernels.topk import device_flags

    assert len(ic.compile_file(str(out), extra_args=device_flags(arch) + flags)) > 10000


def test_splice_names_dynamic_rows(tmp_path):
    """x with a dynamic row count (a dense target's prefill, T rows) stays IREE's, and the report
    says why: its rows are dynamic (x is bf16), not a dtype."""
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")
    from types import SimpleNamespace

    from dflash_iree.export import lower_linear, qwen3

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(512, 128, bias=False, dtype=torch.bfloat16)

        def forward(self, x):
            return tuple(qwen3.project(x, [self.w]))

    module = Linear()
    aot.externalize_module_parameters(module)
    x = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    src = tmp_path / "dynamic.mlir"
    aot.export(module, args=(x,), dynamic_shapes={"x": {1: torch.export.Dim("T", max=64)}}).save_mlir(src)
    _, flags, report = _lower(src, tmp_path, "sm_80")
    assert flags == [] and "gemm" not in report
    assert report["iree"]["gemm"] == {"x tensor<1x?x512xbf16> has dynamic rows": 1}
    f32 = SimpleNamespace(type="!torch.vtensor<[1,16,512],f32>")
    assert lower_linear._rows(f32)[3] == "x tensor<1x16x512xf32> is not bf16"


@pytest.mark.parametrize("N,taken", [(128, False), (4096, True)])
def test_splice_leaves_small_weights_to_iree_in_the_rules_before(tmp_path, N, taken):
    """With row_invariant=False only weights of at least GEMM_MIN_WEIGHT_BYTES (4 MiB) take the
    dispatch; by default every weight does (no floor: row invariance)."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    src = _export_linears(tmp_path, 16, "project", Ns=(N,))
    _, _, report = _lower(src, tmp_path, "sm_80", min_weight_bytes=splice.GEMM_MIN_WEIGHT_BYTES, row_invariant=False)
    assert ("gemm" in report) == taken and (2 * N * 512 >= splice.GEMM_MIN_WEIGHT_BYTES) == taken
    _, _, report = _lower(src, tmp_path, "sm_80", min_weight_bytes=splice.GEMM_MIN_WEIGHT_BYTES)
    assert "gemm" in report and "iree" not in report


@pytest.mark.parametrize("M", [16, 1])
def test_splice_groups_the_weights_of_one_op(tmp_path, M):
    """q, k and v (one op) become one grouped dispatch, also at M = 1 (decode); a lone weight too; in
    the rules before (row_invariant=False) a lone weight at M = 1 stays IREE's matvec."""
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    N, Nkv, Nv, K = 128, 64, 96, 384
    out, flags, report = _lower(_export_linears(tmp_path, M, "project", Ns=(N, Nkv, Nv), K=K), tmp_path, "sm_80")
    assert report["gemm"] == [{"M": M, "N": [N, Nkv, Nv], "K": K, "ops": 1, "mms": 3,
                               "splits": gemm_plan((N, Nkv, Nv), K, "sm_80").splits}]
    text = str(splice.load(out))  # the module verified: each result went to its own weight's uses (the types differ)
    assert f"util.call @dflash_gemm_{M}x{N}_{Nkv}_{Nv}x{K}" in text
    from dflash_iree.kernels.topk import device_flags

    assert len(ic.compile_file(str(out), extra_args=device_flags("sm_80") + flags)) > 10000
    _, _, lone = _lower(_export_linears(tmp_path, M, "project", Ns=(N,), K=K), tmp_path, "sm_80")
    assert "gemm" in lone
    _, _, lone = _lower(_export_linears(tmp_path, M, "project", Ns=(N,), K=K), tmp_path, "sm_80", row_invariant=False)
    assert ("gemm" in lone) == (M > 1)


@pytest.mark.parametrize("M", [16, 1])
def test_splice_runs_of_three(tmp_path, M):
    """Five weights of one op (the drafter's context k and v of its layers) become a run of 3 and a run
    of 2, in the op's order, at any M; in the rules before (row_invariant=False), at M = 1 only an op
    of exactly three (a layer's q, k and v) is taken."""
    pytest.importorskip("iree.compiler")

    ns = (64, 80, 96, 112, 128)
    src = _export_linears(tmp_path, M, "project", Ns=ns, K=384)
    _, _, report = _lower(src, tmp_path, "sm_80")
    assert [g["N"] for g in report["gemm"]] == [[64, 80, 96], [112, 128]]
    if M == 1:
        _, _, report = _lower(src, tmp_path, "sm_80", row_invariant=False)
        assert "gemm" not in report and report["iree"]["gemm"] == {"M=1: only a group of exactly 3 weights takes "
                                                                   "the kernel": 5}


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151"])
def test_splice_epilogues(tmp_path, arch):
    """gate + up + silu * mul become one swiglu dispatch, down + the residual add one residual
    dispatch; with epilogues off, both go to IREE (the ops' references)."""
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    M, K, I = 16, 256, 512
    src = _export_linears(tmp_path, M, "mlp", K=K, I=I)
    out, flags, report = _lower(src, tmp_path, arch)
    assert [(g["N"], g["K"], g.get("epilogue")) for g in report["gemm"]] == [(K, I, "residual"), ([I, I], K, "swiglu")]
    text = str(splice.load(out))
    assert f"util.call @dflash_gemm_{M}x{I}_{I}x{K}_swiglu_1x{M}x{I}" in text
    assert f"util.call @dflash_gemm_{M}x{K}x{I}_residual_1x{M}x{K}" in text
    from dflash_iree.kernels.topk import device_flags

    assert len(ic.compile_file(str(out), extra_args=device_flags(arch) + flags)) > 10000
    _, _, report = _lower(src, tmp_path, arch, epilogues=False)
    assert "gemm" not in report and report["iree"]["gemm"] == {"epilogues off": 3}


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


def test_to_iree_gives_every_linear_its_reference(tmp_path):
    """splice.to_iree (the benches' build without a kernel): the named ops become their references."""
    pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice

    src = _export_linears(tmp_path, 16, "project", Ns=(128, 64))
    lower = splice.to_iree(splice.LINEAR_OP, splice.LINEAR_RESIDUAL_OP, splice.LINEAR_SWIGLU_OP)
    out, flags, report = splice.splice_file(src, tmp_path / "s.mlirbc", "sm_80", {"gemm": lower})
    text = str(splice.load(out))
    assert flags == [] and report["iree"] == {"gemm": {"to_iree": 1}}
    assert "torch.operator" not in text and text.count("torch.aten.linear") == 2


# ---- the packed 4-bit form (issue #28): objects, MLIR, compiles, and its NumPy dequantization


@pytest.mark.parametrize("arch", ARCHS)
def test_q4_object_is_sound(arch):
    """The 4-bit entry points are an object of their own (gemm_q4_*), each sound (no spills or scratch
    on gfx, no local memory in the PTX) and with the bf16 kernel's matrix instructions; on CUDA a fetch
    is one 16-byte load of W a lane and the values are dequantized in bf16x2 fmas (gemm_gpu.cu)."""
    from dflash_iree.kernels.gemm import Q4
    from dflash_iree.kernels.isa import GEMM_Q4_KERNELS

    path = object_file(arch, Q4("mlx", 64))
    assert path.name.startswith("gemm_q4_") and path.is_file(), f"{path} missing: make kernels"
    assert inspect_object(path, arch, GEMM_Q4_KERNELS) == []
    if arch in CUDA_ARCHS:
        ptx = path.read_text()
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
        assert "ld.global.nc.L1::no_allocate.v4.u32" in ptx and "prmt.b32" in ptx
        # the nibbles become bf16s by an exponent trick, not a conversion (one a fetch: the zero point,
        # against 2 fmas a pair of values, 32 a fetch)
        assert ptx.count("cvt.rn.f32.u32") <= ptx.count("fma.rn.bf16x2") / 16
        assert "dflash_gemm_mt1" not in ptx  # the bf16 object keeps its own
    else:
        assert wmma_count(path) >= 3 * 4 * (1 + 2 + 3 + 4)


@pytest.mark.parametrize("fmt", ["mlx", "sym", "zp"])
def test_q4_mlir_text(fmt):
    from dflash_iree.kernels.gemm import Q4

    q = Q4(fmt, 64)
    d = gemm_dispatch(16, (1024, 512), 4096, "sm_80", name="q", quant=q)
    assert "@dflash_q4gemm2_mt1" in d.mlir and "gemm_q4_sm_80.ptx" in d.mlir
    head = d.mlir[d.mlir.index("util.func private @q("):].split("\n")[0]
    # x, two scales (and two biases), two results; two packed weights (and two zero-point tensors)
    assert head.count("xi32>") == (2 if fmt != "zp" else 4) and head.count("bf16>") == 5 + 2 * (fmt == "mlx")
    assert "tensor<1024x512xi32>" in head and "tensor<512x64xbf16>" in head
    if fmt == "zp":
        assert "tensor<64x64xi32>" in head  # 512 rows' zero points, eight a word
    # every weight is three bindings (q, s, o): x, 2 x 3, then cnt, y0, y1, part
    assert d.mlir.count("storage_buffer, ReadOnly") == 7 and "constants = 9" in d.mlir
    assert d.plan == gemm_dispatch(16, (1024, 512), 4096, "sm_80").plan  # the plan is the bf16 weights'


@pytest.mark.parametrize("args,match", [((16, 64, 96, "sm_80"), "whole groups"), ((16, 64, 128, "gfx1151"), "whole groups")])
def test_q4_refusals(args, match):
    from dflash_iree.kernels.gemm import Q4

    with pytest.raises(DFlashError, match=match):
        gemm_dispatch(*args, quant=Q4("mlx", 256 if args[3] == "gfx1151" else 64))


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151"])
def test_q4_compiles_for_gpu_targets(arch):
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.kernels.gemm import Q4
    from dflash_iree.kernels.topk import device_flags

    for M, N, K, epi, q in [(1, 1024, 4096, None, Q4("mlx", 64)), (16, (128, 64, 64), 384, None, Q4("zp", 128)),
                            (33, 4096, 12288, "residual", Q4("sym", 128)), (16, (256, 256), 384, "swiglu", Q4("mlx", 32))]:
        d = gemm_dispatch(M, N, K, arch, epilogue=epi, quant=q)
        assert len(ic.compile_str(standalone_module(d), extra_args=device_flags(arch) + d.flags)) > 10000


def test_q4_k_order():
    """reference.py `q4_k_order`, which the device check (bench/gemm_q4_bench.py) applies to the bf16
    kernel to get the 4-bit kernel's bits: a permutation of each split, the super-chunk layout
    (lane group t of chunk h takes kb + 32t + 8h ..) and, on CUDA (`q4_pair_order` 1), a lane's
    k-values 0, 1, 4, 5, 2, 3, 6, 7 in each whole super-chunk; the split's tail in the bf16 order."""
    from dflash_iree.kernels.gemm.dispatch import q4_fetch_chunks, q4_pair_order
    from dflash_iree.kernels.gemm.reference import q4_k_order

    assert (q4_fetch_chunks("sm_80"), q4_pair_order("sm_80")) == (4, 1)
    assert (q4_fetch_chunks("gfx1151"), q4_pair_order("gfx1151")) == (1, 0)
    KR, splits = 320, 2  # a split: two whole super-chunks (128 k-values each) and a tail of 64
    K = KR * splits
    for pairs in (0, 1):
        order = q4_k_order(K, splits, 4, pairs)
        for s in range(splits):
            assert sorted(order[s * KR:(s + 1) * KR]) == list(range(s * KR, (s + 1) * KR))
            assert (order[s * KR + 256:(s + 1) * KR] == np.arange(s * KR + 256, (s + 1) * KR)).all()
    within = [0, 1, 4, 5, 2, 3, 6, 7]
    order = q4_k_order(K, splits, 4, 1)
    assert list(order[:8]) == within and list(order[8:16]) == [32 + j for j in within]  # chunk 0, t = 0, 1
    assert list(order[32:40]) == [8 + j for j in within]  # chunk 1, t = 0
    assert list(q4_k_order(K, splits, 4, 0)[32:40]) == list(range(8, 16))
    assert (q4_k_order(K, splits, 1, 0) == np.arange(K)).all()


@pytest.mark.parametrize("fmt", ["mlx", "sym", "zp"])
def test_q4_reference_is_the_eager_dequantization(fmt):
    """kernels/gemm/reference.py `dequantize_q4` (what the device check compares the kernel with)
    gives the bits of export/quantized.py `dequantize` (the eager reference) in bf16."""
    import torch

    from dflash_iree.export.quantized import QuantLinear
    from dflash_iree.kernels.gemm.reference import bf16_bits, dequantize_q4
    from dflash_iree.quant import CT, MLX, QuantFormat, QuantLayer

    N, K, g = 40, 256, 64
    rng = np.random.default_rng(1)
    q = rng.integers(0, 2**32, size=(N, K // 8), dtype=np.uint64).astype(np.uint32).view(np.int32)
    s = bf16_bits(rng.standard_normal((N, K // g), dtype=np.float32) / 50)
    o = (bf16_bits(rng.standard_normal((N, K // g), dtype=np.float32) / 5) if fmt == "mlx" else
         rng.integers(0, 2**32, size=(N // 8, K // g), dtype=np.uint64).astype(np.uint32).view(np.int32)
         if fmt == "zp" else None)
    method = MLX if fmt == "mlx" else CT
    keys = {"packed": "x.weight", "scales": "x.scales"} | ({"biases": "x.biases"} if fmt == "mlx" else {})
    if fmt == "zp":
        keys["zeros"] = "x.weight_zero_point"
    if method == CT:
        keys = {"packed": "x.weight_packed", "scales": "x.weight_scale", "shape": "x.weight_shape",
                **({"zeros": "x.weight_zero_point"} if fmt == "zp" else {})}
    layer = QuantLayer("x", N, K, QuantFormat(method, 4, g, symmetric=fmt != "zp"), keys)
    lin = QuantLinear(layer, {k: torch.bfloat16 for k in keys.values()}, torch.bfloat16)
    bf = lambda a: torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)  # noqa: E731
    lin.packed().data = torch.from_numpy(q.copy())
    lin.scale_tensor().data = bf(s)
    if fmt == "mlx":
        lin.offset_tensor().data = bf(o)
    elif fmt == "zp":
        lin.offset_tensor().data = torch.from_numpy(o.copy())
    eager = lin.dequantized().view(torch.int16).numpy().view(np.uint16)
    assert (dequantize_q4(q, s, o, fmt, g, N, K) == eager).all()


def _quant_linears(K: int, Ns, fmt: str, group: int):
    """Packed 4-bit linears [n, K] of random contents in FMT (export/quantized.py's modules, as a
    checkpoint of that format binds them): what the lowering sees is their types."""
    import torch

    from dflash_iree.export.quantized import QuantLinear
    from dflash_iree.quant import CT, MLX, QuantFormat, QuantLayer

    out = []
    for i, n in enumerate(Ns):
        p = f"w{i}"
        if fmt == "mlx":
            keys = {"packed": f"{p}.weight", "scales": f"{p}.scales", "biases": f"{p}.biases"}
        else:
            keys = {"packed": f"{p}.weight_packed", "scales": f"{p}.weight_scale", "shape": f"{p}.weight_shape",
                    **({"zeros": f"{p}.weight_zero_point"} if fmt == "zp" else {})}
        layer = QuantLayer(p, n, K, QuantFormat(MLX if fmt == "mlx" else CT, 4, group, symmetric=fmt != "zp"), keys)
        dtypes = {k: torch.bfloat16 for k in keys.values()} | {keys.get("shape", "-"): torch.int64}
        lin = QuantLinear(layer, dtypes, torch.bfloat16)
        for t in lin.parameters():
            t.data = (torch.randint(0, 2**31 - 1, t.shape, dtype=torch.int32) if not t.dtype.is_floating_point
                      else torch.rand(t.shape).to(t.dtype) / 64)
        out.append(lin)
    return out


@pytest.mark.parametrize("fmt,group", [("mlx", 64), ("sym", 128), ("zp", 32)])
def test_splice_takes_packed_weights(tmp_path, fmt, group):
    """A 4-bit layer's q, k, v (one op) and its MLP (swiglu, down + residual) take the packed kernel at
    M = 1 and M = 16 on sm_80, every weight of them, and the compiled module has no dispatch that
    writes a dequantized weight (the reference's dequantize + matmul is left dead). With the decoder
    layer's norms (`normed`) the ops carry none: a packed weight's norm stays IREE's (export/qwen3.py
    `_op_input`)."""
    torch = pytest.importorskip("torch")
    aot = pytest.importorskip("iree.turbine.aot")
    ic = pytest.importorskip("iree.compiler")
    from types import SimpleNamespace

    from dflash_iree.export import qwen3

    K, I = 256, 512
    for M, normed in ((1, False), (16, False), (1, True)):
        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ws = torch.nn.ModuleList(_quant_linears(K, (256, 128, 128), fmt, group))
                self.mlp = qwen3.MLP(SimpleNamespace(hidden_size=K, intermediate_size=I), torch.bfloat16, device="meta")
                self.mlp.gate_proj, self.mlp.up_proj = _quant_linears(K, (I, I), fmt, group)
                self.mlp.down_proj, = _quant_linears(I, (K,), fmt, group)
                self.n1, self.n2 = (qwen3.RMSNorm(K, 1e-6, torch.bfloat16) for _ in range(2))

            def forward(self, x):
                if normed:
                    return (*qwen3.project(x, list(self.ws), self.n1), self.mlp.add_normed(x, self.n2))
                return (*qwen3.project(x, list(self.ws)), self.mlp.add_to(x, x * 2))

        module = Layer()
        aot.externalize_module_parameters(module)
        src = tmp_path / f"q4-{M}{'-normed' if normed else ''}.mlir"
        aot.export(module, args=(torch.zeros(1, M, K, dtype=torch.bfloat16),)).save_mlir(src)
        out, flags, report = _lower(src, tmp_path, "sm_80")
        assert "iree" not in report or "gemm" not in report["iree"], report.get("iree")
        assert sorted((g.get("epilogue") or "", g["mms"], g["q4"]) for g in report["gemm"]) == [
            ("", 3, f"{fmt}/{group}"), ("residual", 1, f"{fmt}/{group}"), ("swiglu", 2, f"{fmt}/{group}")]
        assert not _writes_weights(ic, out, flags, K, I)
    # the planted control: the same layer on IREE's ops (the references) writes its dequantized weights
    from dflash_iree.export import splice

    src = tmp_path / "q4-16.mlir"

    lower = splice.to_iree(splice.LINEAR_OP, splice.LINEAR_RESIDUAL_OP, splice.LINEAR_SWIGLU_OP)
    out, flags, _ = splice.splice_file(src, tmp_path / "iree.mlirbc", "sm_80", {"gemm": lower})
    assert _writes_weights(ic, out, flags, K, I)


def _writes_weights(ic, path, flags, K: int, I: int) -> bool:
    """Whether a dispatch of the compiled module (flow IR, sm_80) writes a bf16 tensor of a weight's shape."""
    from dflash_iree.kernels.topk import device_flags

    flow = ic.compile_file(str(path), extra_args=device_flags("sm_80") + flags + ["--compile-to=flow"]).decode()
    written = re.findall(r"flow\.dispatch[^\n]*-> \(?([^\n]*)", flow)
    return any(f"tensor<{n}x{k}xbf16>" in line for line in written for n, k in ((256, K), (I, K), (K, I)))


def test_norm_mlir_text():
    """The RMSNorm before the GEMM: decode's one row of q + k + v and of gate + up (swiglu) take the
    entry points that normalize x in their prologue, binding the norm's weight after x and its eps
    last; other rows take the norm's own dispatch, one workgroup a row."""
    from dflash_iree.kernels.gemm import norm_dispatch, norm_fused
    from dflash_iree.kernels.hal import f32_bits

    eps = f32_bits(1e-6, signed=True)
    d = gemm_dispatch(1, (4096, 1024, 1024), 4096, "sm_80", name="qkv", norm=1e-6)
    assert ("util.func private @qkv(%x: tensor<1x4096xbf16>, %nw: tensor<4096xbf16>, %w0: tensor<4096x4096xbf16>"
            in d.mlir and "@qkv_mm::@dflash_gemm3_norm_mt1[%gx, %gy]" in d.mlir and f"%cE = arith.constant {eps}" in d.mlir)
    assert d.plan == gemm_dispatch(1, (4096, 1024, 1024), 4096, "sm_80").plan  # the same sums as the plain GEMM
    s = gemm_dispatch(1, (12288, 12288), 4096, "gfx1151", name="mlp", epilogue="swiglu", norm=1e-6)
    assert "@mlp_mm::@dflash_swiglu_norm_mt1" in s.mlir and "%nw: tensor<4096xbf16>" in s.mlir
    n = norm_dispatch(16, 4096, 1e-6, "sm_80", name="nd")
    assert ("util.func private @nd(%x: tensor<16x4096xbf16>, %g: tensor<4096xbf16>) -> tensor<16x4096xbf16>" in n
            and "@nd_mm::@dflash_rms_norm[%gx](%k, %e, %x, %g)" in n and "%gx = arith.constant 16" in n)
    assert [norm_fused(*a) for a in ((1, 3, None, None), (1, 2, "swiglu", None), (2, 3, None, None),
                                     (1, 1, None, None), (1, 1, "residual", None))] == [True, True, False, False, False]
    for args, kw, match in [((2, (64, 64, 64), 128, "sm_80"), {}, "only decode's one row"),
                            ((1, 64, 128, "sm_80"), {}, "only decode's one row"),
                            ((1, (64, 64, 64), 16384, "sm_80"), {}, "K <= 8192")]:
        with pytest.raises(DFlashError, match=match):
            gemm_dispatch(*args, norm=1e-6, **kw)
    with pytest.raises(DFlashError, match="multiples of 8 up to 8192"):
        norm_dispatch(1, 8200, 1e-6, "sm_80")
    with pytest.raises(DFlashError, match="no skinny-GEMM"):
        norm_dispatch(1, 4096, 1e-6, "host")


def test_norm_entry_points_match_the_pipeline_layout():
    """The norm's entry points take the layout's bindings as pointers, then its push constants."""
    from dflash_iree.kernels.gemm import norm_dispatch, pipeline_layout

    ptx = object_file("sm_80").read_text()
    # bindings: x, g and the weights read-only, then cnt, the results and part; constants last, eps among them
    for entry, N, epi, read_only, u64, u32 in (("dflash_gemm3_norm_mt1", (64, 64, 64), None, 5, 10, 9),
                                               ("dflash_swiglu_norm_mt1", (64, 64), "swiglu", 4, 7, 7)):
        params = re.search(rf"\.entry {entry}\((.*?)\)", ptx, re.S)[1]
        assert params.count(".param .u64") == u64 and params.count(".param .u32") == u32, entry
        d = gemm_dispatch(1, N, 128, "sm_80", epilogue=epi, norm=1e-6)
        assert pipeline_layout(u32, read_only, u64) in d.mlir and f"::@{entry}[" in d.mlir
    params = re.search(r"\.entry dflash_rms_norm\((.*?)\)", ptx, re.S)[1]
    assert params.count(".param .u64") == 3 and params.count(".param .u32") == 2
    assert pipeline_layout(2, 2, 3) in norm_dispatch(1, 128, 1e-6, "sm_80")


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151"])
@pytest.mark.parametrize("M", [1, 16])
def test_splice_takes_the_norm_with_its_gemm(tmp_path, arch, M):
    """A norm before q + k + v and before gate + up (the decoder layer's form) goes with the GEMM: at
    M = 1 into the GEMM's prologue (no norm dispatch), at M = 16 as the norm's own dispatch before
    the plain GEMM; the host gives both ops to IREE with their norms. Both modules compile."""
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export import splice
    from dflash_iree.kernels.topk import device_flags

    K, I, Ns = 256, 512, (128, 64, 64)
    src = _export_linears(tmp_path, M, "normed", Ns=Ns, K=K, I=I)
    out, flags, report = _lower(src, tmp_path, arch)
    norm = "+norm" if M == 1 else "+norm dispatch"
    assert sorted((str(g["N"]), g.get("epilogue")) for g in report["gemm"]) == sorted(
        [(str(list(Ns)), norm), (str([I, I]), "swiglu" + norm), (str(K), "residual")])
    text = str(splice.load(out))
    assert ("dflash_gemm3_norm_mt1" in text) == (M == 1) and ("dflash_swiglu_norm_mt1" in text) == (M == 1)
    assert ("@dflash_rms_norm[" in text) == (M > 1) and "torch.operator" not in text
    assert len(ic.compile_file(str(out), extra_args=device_flags(arch) + flags)) > 10000
    _, _, host = _lower(src, tmp_path, "host")
    assert "gemm" not in host and sum(host["iree"]["gemm"].values()) == 3 + 2 + 1
