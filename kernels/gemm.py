"""MLIR for the skinny-GEMM custom dispatch y[M, N] = x[M, K] . W[N, K]^T (bf16 in, f32 sums, bf16 out).

`gemm_dispatch(M, N, K, arch)` returns the text of one or two `hal.executable.source` ops bound to
the committed objects (gemm_gpu.cu built for `arch`) and a `util.func private` that calls them:

    util.func private @{name}(%x: tensor<M x K x bf16>, %w: tensor<N x K x bf16>) -> tensor<M x N x bf16>

The plan (columns per workgroup, k splits) depends on (N, K, arch) only, never on M: every row of y
is computed by the same sequence of instructions whatever M is (see gemm_body.h, numerics contract).
GPU archs only (CUDA sm_80/86/89 and RDNA3/4 gfx1100/1151/1201); the host CPU keeps IREE's own
matmul. No IREE import here: this module only writes text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash_iree.errors import DFlashError

OBJECTS_DIR = Path(__file__).resolve().parent / "objects"
CUDA_ARCHS = ("sm_80", "sm_86", "sm_89")
HIP_ARCHS = ("gfx1100", "gfx1151", "gfx1201")
ARCHS = CUDA_ARCHS + HIP_ARCHS
MAX_M = 64

# Per backend, as compiled into the objects (gemm_gpu.cu): threads per workgroup, columns per
# workgroup (GM_WARPS * GM_CW * GM_TN) and k-values per chunk (GM_KC): a split's k range is a
# whole number of chunks (the kernel loads GM_U chunks at a time, then the rest one by one).
# per_unit: workgroups per multiprocessor we aim for (the fewest splits that reach it): on the H200
# the best split of the 8B shapes gave 2.9-3.9 workgroups of 128 threads per SM (bench/gemm_bench.py).
_CUDA = {"threads": 128, "bn": 32, "chunk": 32, "per_unit": 2.9}
_HIP = {"threads": 128, "bn": 128, "chunk": 16, "per_unit": 2}
_MIN_CHUNKS = 8
# Multiprocessors (sm_80 is what H100/H200 run here: 132 SMs; sm_86 84; sm_89 128; gfx1100 96 CUs,
# gfx1151 40, gfx1201 64).
_UNITS = {"sm_80": 132, "sm_86": 84, "sm_89": 128, "gfx1100": 96, "gfx1151": 40, "gfx1201": 64}


@dataclass(frozen=True)
class GemmPlan:
    """How (N, K) is cut on one arch: grid (col_blocks, splits); KR = K / splits k-values per split."""

    N: int
    K: int
    arch: str
    block_n: int
    splits: int
    threads: int

    @property
    def col_blocks(self) -> int:
        return math.ceil(self.N / self.block_n)

    @property
    def kr(self) -> int:
        return self.K // self.splits


@dataclass(frozen=True)
class GemmDispatch:
    """The spliceable skinny GEMM for one (M, N, K, arch).

    mlir:    module-body text: the executable `@{name}_mm`, the global `@{name}_cnt` (split-K arrival
             counters, zero between calls) and
             `util.func private @{name}(tensor<MxKxbf16>, tensor<NxKxbf16>) -> tensor<MxNxbf16>`.
    flags:   what `iree-compile` needs besides the device target (the object search path).
    objects: the object files the text refers to.
    """

    M: int
    N: int
    K: int
    arch: str
    name: str
    plan: GemmPlan
    mlir: str
    flags: list[str] = field(default_factory=list)
    objects: list[Path] = field(default_factory=list)

    @property
    def func(self) -> str:
        return self.name

    @property
    def m_tiles(self) -> int:
        return math.ceil(self.M / 16)


def _backend(arch: str) -> dict:
    if arch in CUDA_ARCHS:
        return _CUDA
    if arch in HIP_ARCHS:
        return _HIP
    raise DFlashError(f"no skinny-GEMM kernel for arch '{arch}'; GPU archs only: {', '.join(ARCHS)}"
                      + (" (gfx1030 has no WMMA)" if arch == "gfx1030" else ""))


def object_file(arch: str) -> Path:
    """Committed object for ARCH: PTX for sm_*, a code object for gfx*."""
    _backend(arch)
    return OBJECTS_DIR / (f"gemm_{arch}.ptx" if arch in CUDA_ARCHS else f"gemm_{arch}.co")


def why_unsupported(M: int, N: int, K: int, arch: str) -> str | None:
    """None when the kernel takes this shape on ARCH, else the reason it does not."""
    if arch not in ARCHS:
        return f"arch {arch} has no skinny-GEMM kernel"
    b = _backend(arch)
    if not 1 <= M <= MAX_M:
        return f"M={M} is outside 1..{MAX_M}"
    if N < 16 or N % 16:
        return f"N={N} is not a positive multiple of 16"
    if K < b["chunk"] or K % b["chunk"]:
        return f"K={K} is not a positive multiple of {b['chunk']}"
    if 16 * math.ceil(M / 16) * K >= 2**31 or N * K >= 2**31:  # x is padded to whole 16-row tiles
        return "operands too large for 32-bit element offsets"
    return None


def gemm_plan(N: int, K: int, arch: str, splits: int | None = None) -> GemmPlan:
    """The plan for (N, K) on ARCH: the fewest k splits (dividing K into whole chunks) that give at least
    `per_unit` workgroups per multiprocessor, with at least 8 chunks per split (else the most splits
    that keep 8 chunks). SPLITS overrides (benchmarks only)."""
    b = _backend(arch)
    rounds = K // b["chunk"]
    col_blocks = math.ceil(N / b["bn"])
    if splits is None:
        target = b["per_unit"] * _UNITS[arch]
        most = max(1, rounds // _MIN_CHUNKS)  # a split keeps at least _MIN_CHUNKS chunks
        cands = [s for s in range(1, most + 1) if rounds % s == 0]
        splits = next((s for s in cands if col_blocks * s >= target), cands[-1])
    if splits < 1 or rounds % splits:
        raise DFlashError(f"{splits} splits do not cut K={K} into whole chunks of {b['chunk']}")
    return GemmPlan(N=N, K=K, arch=arch, block_n=b["bn"], splits=splits, threads=b["threads"])


def executable_target(arch: str) -> str:
    """The generic executable target of ARCH's backend that the objects are keyed by."""
    if arch in CUDA_ARCHS:
        return '#hal.executable.target<"cuda", "cuda-nvptx-fb">'
    return '#hal.executable.target<"rocm", "rocm-hsaco-fb">'


def pipeline_layout(constants: int, read_only: int, bindings: int) -> str:
    """A `#hal.pipeline.layout`: CONSTANTS push constants, BINDINGS buffers of which the first READ_ONLY are read-only."""
    b = (["#hal.pipeline.binding<storage_buffer, ReadOnly>"] * read_only
         + ["#hal.pipeline.binding<storage_buffer>"] * (bindings - read_only))
    return f"#hal.pipeline.layout<constants = {constants}, bindings = [{', '.join(b)}]>"


def executable_source(sym: str, entry: str, arch: str, obj: str, layout: str, threads: int, workload: int) -> str:
    """A `hal.executable.source` @SYM exporting ENTRY of object OBJ, THREADS threads a workgroup, whose
    workgroup count is its first WORKLOAD workload values (the rest 1)."""
    wl = "".join(f", %w{i}: index" for i in range(workload))
    count = ", ".join([f"%w{i}" for i in range(workload)] + ["%c1"] * (3 - workload))
    return (f"hal.executable.source private @{sym} <objects = <{{{executable_target(arch)} = "
            f"[#hal.executable.object<{{path = \"{obj}\"}}>]}}>> {{\n"
            f"  hal.executable.export public @{entry} ordinal(0) layout({layout})"
            f" count(%device: !hal.device{wl}) -> (index, index, index) {{\n"
            f"    %c1 = arith.constant 1 : index\n    hal.return {count} : index, index, index\n  }}"
            f" <workgroup_size = [{threads} : index, 1 : index, 1 : index]>\n}}\n")


def gemm_dispatch(M: int, N: int, K: int, arch: str, *, name: str = "dflash_gemm",
                  splits: int | None = None) -> GemmDispatch:
    """Builds the spliceable skinny GEMM y[M, N] = x[M, K] . W[N, K]^T on ARCH.

    M (1..64), N (multiple of 16), K (multiple of 32 on CUDA, 16 on gfx): static shapes; x, W and y
    are bf16, the sums f32 (one rounding to bf16 at the end). arch: sm_80/86/89 or
    gfx1100/1151/1201. name: symbol prefix (every symbol starts with it). splits: override the plan's
    k splits (benchmarks; the numerics then differ from the default plan's). Raises DFlashError for
    a shape or arch the kernel does not take, or a missing object.
    """
    why = why_unsupported(M, N, K, arch)
    if why:
        raise DFlashError(f"skinny GEMM [{M}x{K}] x [{N}x{K}]^T on {arch}: {why}")
    obj = object_file(arch)
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: run `make kernels` to build the kernel objects")
    plan = gemm_plan(N, K, arch, splits)
    mt = math.ceil(M / 16)  # 16-row m-tiles: the entry point of the object
    S, KR, cb = plan.splits, plan.kr, plan.col_blocks
    x_t, w_t, y_t = f"tensor<{M}x{K}xbf16>", f"tensor<{N}x{K}xbf16>", f"tensor<{M}x{N}xbf16>"
    c_t = f"tensor<{cb}xi32>"
    p_t = f"tensor<{S}x{M}x{N}xf32>" if S > 1 else "tensor<1xf32>"  # split partials (scratch)
    text = executable_source(f"{name}_mm", f"dflash_gemm_mt{mt}", arch, obj.name, pipeline_layout(5, 2, 5), plan.threads, 2)
    # The split-K arrival counters: zero, and left zero by every call (the last workgroup of a column
    # block resets its counter), so one module global serves every call of this function.
    text += f"util.global private mutable @{name}_cnt = dense<0> : {c_t}\n"
    text += (f"util.func private @{name}(%x: {x_t}, %w: {w_t}) -> {y_t} {{\n"
             f"    %cM = arith.constant {M} : i32\n    %cN = arith.constant {N} : i32\n"
             f"    %cK = arith.constant {K} : i32\n    %cKR = arith.constant {KR} : i32\n"
             f"    %cS = arith.constant {S} : i32\n"
             f"    %gx = arith.constant {cb} : index\n    %gy = arith.constant {S} : index\n"
             f"    %c = util.global.load @{name}_cnt : {c_t}\n"
             f"    %r:3 = flow.dispatch @{name}_mm::@dflash_gemm_mt{mt}[%gx, %gy](%cM, %cN, %cK, %cKR, %cS, %x, %w, %c)"
             f" : (i32, i32, i32, i32, i32, {x_t}, {w_t}, {c_t}) -> (%c, {y_t}, {p_t})\n"
             f"    util.global.store %r#0, @{name}_cnt : {c_t}\n"
             f"    util.return %r#1 : {y_t}\n}}\n")
    return GemmDispatch(M=M, N=N, K=K, arch=arch, name=name, plan=plan, mlir=text,
                        flags=[f"--iree-hal-executable-object-search-path={OBJECTS_DIR}"], objects=[obj])


def standalone_module(d: GemmDispatch) -> str:
    """A whole module around D with a public `gemm(x, w) -> y`."""
    x_t, w_t, y_t = f"tensor<{d.M}x{d.K}xbf16>", f"tensor<{d.N}x{d.K}xbf16>", f"tensor<{d.M}x{d.N}xbf16>"
    return (f"module @gemm_check {{\n{d.mlir}util.func public @gemm(%x: {x_t}, %w: {w_t}) -> {y_t} {{\n"
            f"    %y = util.call @{d.func}(%x, %w) : ({x_t}, {w_t}) -> {y_t}\n    util.return %y : {y_t}\n}}\n}}\n")
