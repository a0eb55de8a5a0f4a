"""MLIR for the skinny-GEMM custom dispatch y[M, N] = x[M, K] . W[N, K]^T (bf16 in, f32 sums, bf16 out).

`gemm_dispatch(M, N, K, arch)` returns the text of a `hal.executable.source` op bound to the
committed objects (gemm_gpu.cu built for `arch`), the split-K counter global and a `util.func
private` that calls it:

    util.func private @{name}(%x: tensor<M x K x bf16>, %w: tensor<N x K x bf16>) -> tensor<M x N x bf16>

With N a tuple of 2 or 3 row counts it multiplies one x by that many weights in one dispatch
(`@{name}(%x, %w0, %w1[, %w2]) -> (y0, y1[, y2])`: a layer's q, k and v projections, gate and up).
With an epilogue it also does the op the model applies next, which then costs no dispatch of its own:
`epilogue="residual"`, `@{name}(%x, %w, %r) -> r + x . W^T` (the add after o_proj and down_proj);
`epilogue="swiglu"`, `@{name}(%x, %w0, %w1) -> silu(x . W0^T) * (x . W1^T)` (gate, up: the MLP's
input to down_proj); each op rounded to bf16 as the eager model rounds it.
With `quant=Q4(fmt, group)` each weight is packed 4-bit as its checkpoint stores it (gemm_body.h,
"Packed 4-bit weights"), and the function takes per weight `%q{g}` int32 [N, K / 8], `%s{g}` bf16
[N, K / group] and by format `%o{g}`: MLX's biases bf16 [N, K / group] ("mlx"), compressed-tensors'
zero points int32 [ceil(N / 8), K / group] ("zp"), or nothing (compressed-tensors symmetric, "sym");
the dequantized weight lives in registers only (issue #28).
With `norm=eps` the dispatch also applies the RMSNorm before the GEMM to x (`@{name}(%x, %nw, %w..)`, nw the
norm's bf16 weight [K]): at M = 1, for q + k + v and for gate + up with swiglu, in the GEMM's prologue
(`norm_fused`; gemm_body.h gm_normed_x), so that decode's norm costs no dispatch of its own (issue
#24); `gemm_dispatch(norm=)` refuses other shapes, which export/lower_linear.py gives `norm_dispatch`,
the norm's own dispatch, then the plain GEMM: both compute a
row's norm in one fixed order (gemm_body.h gm_rms_rinv), so the rows have the same bits either way.
The plan (columns per workgroup, k splits, workgroups along the columns) depends on (the N's, K,
arch) only, never on M: every row of y is computed by the same sequence of instructions whatever M
is (see gemm_body.h, numerics contract). GPU archs only (CUDA sm_80/86/89 and RDNA3/4
gfx1100/1151/1201); the host CPU keeps IREE's own matmul. No IREE import here: this module only
writes text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash_iree.arch import kernel_archs
from dflash_iree.errors import DFlashError

from ..hal import (OBJECTS_DIR, entry_attribute, executable_head, executable_source, executable_target,  # noqa: F401
                   f32_bits, gpu_object, pipeline_layout, search_flags)

CUDA_ARCHS = kernel_archs("gemm", "cuda")
HIP_ARCHS = kernel_archs("gemm", "hip")
ARCHS = CUDA_ARCHS + HIP_ARCHS
MAX_M = 64
MAX_WEIGHTS = 3  # weights of one x in one dispatch (q, k, v)
EPILOGUES = ("residual", "swiglu")
# Packed 4-bit formats (gemm_body.h GM_Q_*: the codes are the kernel's `fmt` push constant) and the
# groups the kernel takes: a chunk of k-values must lie in one group.
Q4_FORMATS = {"mlx": 0, "sym": 1, "zp": 2}
Q4_GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class Q4:
    """A packed 4-bit weight format of the kernel: fmt "mlx" (w = s*q + b), "sym" (w = s*(q - 8)) or
    "zp" (w = s*(q - z)); group: k-values per scale (32, 64 or 128)."""

    fmt: str
    group: int

    def operand_types(self, N: int, K: int) -> list[str]:
        """The MLIR types of one weight's operands: q, s and (mlx, zp) o."""
        g = K // self.group
        ts = [f"tensor<{N}x{K // 8}xi32>", f"tensor<{N}x{g}xbf16>"]
        if self.fmt == "mlx":
            ts.append(f"tensor<{N}x{g}xbf16>")
        elif self.fmt == "zp":
            ts.append(f"tensor<{-(-N // 8)}x{g}xi32>")
        return ts

    def bindings(self, N: int, K: int) -> list[str]:
        """`operand_types` as the kernel binds them: always three a weight (q, s, o); "sym" has no o
        and binds s again."""
        ts = self.operand_types(N, K)
        return ts + ts[1:2] * (3 - len(ts))


def weight_types(Ns, K: int, quant: Q4 | None) -> list[str]:
    """The MLIR types of the weight operands of weights of Ns rows and K columns: one bf16 [N, K] each,
    or QUANT's packed operands (`Q4.operand_types`) each."""
    return [t for n in Ns for t in ([f"tensor<{n}x{K}xbf16>"] if quant is None else quant.operand_types(n, K))]

# Per backend, as compiled into the objects (gemm_gpu.cu): threads per workgroup, columns per
# workgroup (GM_WARPS * GM_CW * GM_TN) and k-values per chunk (GM_KC): a split's k range is a
# whole number of chunks (the kernel loads GM_U chunks at a time, then the rest one by one).
# per_unit: workgroups per multiprocessor we aim for (the fewest splits that reach it): on the H200
# the best split of the 8B shapes gave 2.9-3.9 workgroups of 128 threads per SM (bench/gemm_bench.py).
# block_loop: whether the objects let a workgroup take several column blocks in turn (gemm_gpu.cu
# GM_BLOCK_LOOP; gfx builds one block a workgroup). resident: workgroups a multiprocessor holds at
# once (CUDA: the 1- and 2-m-tile entry points are built for 4 of 128 threads per SM, GM_MINB). When
# an unsplit pass over the column blocks would take 2 to _MAX_PASSES waves of resident workgroups,
# fewer workgroups take the blocks in turn: on the H200 the fused gate+up (768 blocks, M = 16) ran
# 69.0 us in 768 workgroups and 63.0 us in 384 that take two blocks each. With k splits, halving the
# splits is the better way to fewer workgroups (4096x4096: 2 splits 18.3 us against 4 splits taking
# 2 blocks each 24.5), so the loop is only planned for one split (experiments/2026-11-30-grouped-gemm/).
# q4_fetch, q4_pairs: the 4-bit entry points' chunks a fetch and the order of a lane's k-values in a
# fetch's chunk (gemm_gpu.cu GM_QSC, `gm_mma_q`; reference.py `q4_k_order`).
_CUDA = {"threads": 128, "bn": 32, "chunk": 32, "per_unit": 2.9, "block_loop": True, "resident": 4, "q4_fetch": 4,
         "q4_pairs": 1}
_HIP = {"threads": 128, "bn": 128, "chunk": 16, "per_unit": 2, "block_loop": False, "q4_fetch": 1, "q4_pairs": 0}
_MAX_PASSES = 4
_MIN_CHUNKS = 8
# Multiprocessors (sm_80 is what H100/H200 run here: 132 SMs; sm_86 84; sm_89 128; gfx1100 96 CUs,
# gfx1151 40, gfx1201 64).
_UNITS = {"sm_80": 132, "sm_86": 84, "sm_89": 128, "gfx1100": 96, "gfx1151": 40, "gfx1201": 64}


@dataclass(frozen=True)
class GemmPlan:
    """How the weights [N_g, K] of one dispatch are cut on one arch: col_blocks column blocks (each
    weight ceil(N_g / block_n) of them, after the previous weight's; `paired`, the swiglu epilogue's
    two weights: ceil(N_0 / (block_n / 2)) blocks of block_n / 2 columns of both) x `splits` k splits
    of KR = K / splits k-values, on a grid of (grid_x, splits) workgroups, each taking blocks grid_x
    apart."""

    Ns: tuple[int, ...]
    K: int
    arch: str
    block_n: int
    splits: int
    threads: int
    grid_x: int  # workgroups along the column blocks: col_blocks, or fewer that take them in turn
    paired: bool = False

    @property
    def N(self) -> int:
        return sum(self.Ns)

    @property
    def col_blocks(self) -> int:
        return _col_blocks(self.Ns, self.block_n, self.paired)

    @property
    def passes(self) -> int:
        """Column blocks a workgroup takes in turn (at most)."""
        return math.ceil(self.col_blocks / self.grid_x)

    @property
    def kr(self) -> int:
        return self.K // self.splits


@dataclass(frozen=True)
class GemmDispatch:
    """The spliceable skinny GEMM for one (M, Ns, K, arch): y_g = x . W_g^T for 1..3 weights W_g
    [N_g, K] of one x, in one dispatch.

    mlir:    module-body text: the executable `@{name}_mm`, the global `@{name}_cnt` (split-K arrival
             counters, zero between calls) and the function: with one weight
             `util.func private @{name}(tensor<MxKxbf16>, tensor<NxKxbf16>) -> tensor<MxNxbf16>`, with
             G weights `@{name}(x, w0, .., w{G-1}) -> (y0, .., y{G-1})`; with an epilogue,
             `@{name}(x, w, r) -> y` (residual) or `@{name}(x, w0 = gate, w1 = up) -> y` (swiglu).
    flags:   what `iree-compile` needs besides the device target (the object search path).
    objects: the object files the text refers to.
    epilogue: None, "residual" or "swiglu" (gemm_dispatch).
    quant:   None (bf16 weights) or the packed 4-bit format (`Q4`); then each weight is its operands.
    norm:    None, or the eps of the RMSNorm the dispatch applies to x first (`norm_fused`); then the
             function takes the norm's weight after x.
    """

    M: int
    Ns: tuple[int, ...]
    K: int
    arch: str
    name: str
    plan: GemmPlan
    mlir: str
    flags: list[str] = field(default_factory=list)
    objects: list[Path] = field(default_factory=list)
    epilogue: str | None = None
    quant: Q4 | None = None
    norm: float | None = None

    @property
    def N(self) -> int:
        return sum(self.Ns)

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


def chunk_k(arch: str) -> int:
    """k-values per chunk on ARCH (GM_KC of its objects): a k split is a whole number of chunks.
    Raises DFlashError for an arch without the kernel."""
    return _backend(arch)["chunk"]


def q4_fetch_chunks(arch: str) -> int:
    """Chunks a fetch of the 4-bit entry points on ARCH (gemm_body.h GM_QSC: 4 on CUDA, 1 on gfx): what
    reference.py `q4_k_order` needs. Raises DFlashError for an arch without the kernel."""
    return _backend(arch)["q4_fetch"]


def q4_pair_order(arch: str) -> int:
    """The order of a lane's k-values in a 4-bit fetch's chunk on ARCH (gemm_gpu.cu `gm_mma_q`: 1 on
    CUDA, 0 on gfx): reference.py `q4_k_order`'s `pair_order`. Raises DFlashError for an arch without
    the kernel."""
    return _backend(arch)["q4_pairs"]


def object_file(arch: str, quant: "Q4 | None" = None) -> Path:
    """Committed object for ARCH: PTX for sm_*, a code object for gfx*; QUANT: the 4-bit entry points'
    (gemm_q4_*)."""
    _backend(arch)
    stem = "gemm_q4" if quant is not None else "gemm"
    return OBJECTS_DIR / (f"{stem}_{arch}.ptx" if arch in CUDA_ARCHS else f"{stem}_{arch}.co")


def why_unsupported(M: int, N: int, K: int, arch: str, quant: Q4 | None = None) -> str | None:
    """None when the kernel takes this shape (QUANT: packed 4-bit in that format) on ARCH, else the
    reason it does not."""
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
    if quant is not None:
        if quant.fmt not in Q4_FORMATS:
            return f"4-bit format {quant.fmt!r} is not one of {', '.join(Q4_FORMATS)}"
        if quant.group not in Q4_GROUPS or K % quant.group:
            return (f"4-bit group {quant.group} does not cut K={K} into whole groups of "
                    f"{' or '.join(map(str, Q4_GROUPS))}")
    return None


def norm_fused(M: int, G: int, epilogue: str | None, quant: Q4 | None) -> bool:
    """Whether the objects have an entry point that applies the RMSNorm before the GEMM in its prologue
    for M rows of G weights: decode's one row (M = 1), bf16 weights, for a layer's q + k + v (three
    weights) and for gate + up with swiglu (gemm_gpu.cu `dflash_gemm3_norm_mt1`, `dflash_swiglu_norm_mt1`)."""
    return M == 1 and quant is None and ((G == 3 and epilogue is None) or epilogue == "swiglu")


NORM_MAX_K = 8192  # gemm_body.h GM_NORM_KMAX: the prologue's shared copy of the row
NORM_THREADS = 128  # gemm_body.h GM_NT


def norm_why_unsupported(K: int, arch: str) -> str | None:
    """None when the norm's dispatch and prologue take rows of K values on ARCH, else why not."""
    if arch not in ARCHS:
        return f"arch {arch} has no skinny-GEMM kernel"
    if K % 8 or not 8 <= K <= NORM_MAX_K:
        return f"norm over K={K}: the kernel takes multiples of 8 up to {NORM_MAX_K}"
    return None


def norm_dispatch(M: int, K: int, eps: float, arch: str, *, name: str = "dflash_rms_norm") -> str:
    """The RMSNorm's own dispatch (the GEMM object's `dflash_rms_norm`: one workgroup a row) as module-body
    text: an executable and `util.func private @{name}(%x: tensor<MxKxbf16>, %g: tensor<Kxbf16>) ->
    tensor<MxKxbf16>`, y = bf16(g * bf16(x * rinv)), rinv = 1 / sqrt(mean(x^2) + eps) in f32, ss in the
    order of gemm_body.h gm_rms_rinv (the GEMM prologue's).

    Raises:
        DFlashError: an arch without the kernel, a K it does not take, or a missing object.
    """
    why = norm_why_unsupported(K, arch)
    if why:
        raise DFlashError(f"RMSNorm dispatch [{M}x{K}] on {arch}: {why}")
    obj = object_file(arch)
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: run `make kernels` to build the kernel objects")
    x_t, g_t = f"tensor<{M}x{K}xbf16>", f"tensor<{K}xbf16>"
    text = executable_source(f"{name}_mm", "dflash_rms_norm", arch, obj.name, pipeline_layout(2, 2, 3),
                             NORM_THREADS, 1)
    text += (f"util.func private @{name}(%x: {x_t}, %g: {g_t}) -> {x_t} {{\n"
             f"    %k = arith.constant {K} : i32\n    %e = arith.constant {f32_bits(eps, signed=True)} : i32\n"
             f"    %gx = arith.constant {M} : index\n"
             f"    %y = flow.dispatch @{name}_mm::@dflash_rms_norm[%gx](%k, %e, %x, %g) : (i32, i32, {x_t}, {g_t}) -> {x_t}\n"
             f"    util.return %y : {x_t}\n}}\n")
    return text


def _col_blocks(Ns: tuple[int, ...], block_n: int, paired: bool = False) -> int:
    """Column blocks of the weights of Ns rows, each weight's own after the previous weight's;
    PAIRED (two equal weights side by side, swiglu): blocks of block_n / 2 columns of both."""
    return math.ceil(Ns[0] / (block_n // 2)) if paired else sum(math.ceil(n / block_n) for n in Ns)


def _weights(N) -> tuple[int, ...]:
    """N as a tuple of 1..MAX_WEIGHTS int row counts (an int is one weight); DFlashError otherwise."""
    Ns = (N,) if isinstance(N, int) else tuple(N) if isinstance(N, (tuple, list)) else None
    if Ns is None or not all(isinstance(n, int) and not isinstance(n, bool) for n in Ns):
        raise DFlashError(f"skinny GEMM: the weights' row counts must be an int or a tuple of ints, got {N!r}")
    if not 1 <= len(Ns) <= MAX_WEIGHTS:
        raise DFlashError(f"a skinny-GEMM dispatch takes 1..{MAX_WEIGHTS} weights, got {len(Ns)}")
    return Ns


def gemm_plan(N, K: int, arch: str, splits: int | None = None, paired: bool = False) -> GemmPlan:
    """The plan for weights of N rows (an int, or a tuple of 1..3 for one grouped dispatch) and K
    columns on ARCH: the fewest k splits (dividing K into whole chunks) that give at least `per_unit`
    workgroups per multiprocessor over all the weights' column blocks, with at least 8 chunks per
    split (else the most splits that keep 8 chunks); then, on CUDA with one split, where the blocks
    would take 2 to _MAX_PASSES waves of resident workgroups, that many passes of fewer workgroups.
    SPLITS overrides (benchmarks only). PAIRED: two equal weights side by side in each block (the
    swiglu epilogue), with the splits the plain pair would get, so that each weight's sums are the
    plain dispatch's bit for bit. The plan is the same for every M (the numerics contract).

    Raises:
        DFlashError: an arch without the kernel, more than 3 weights, a row count that is not an
            int, or SPLITS that do not cut K into whole chunks.
    """
    b = _backend(arch)
    Ns = _weights(N)
    rounds = K // b["chunk"]
    if paired and (len(Ns) != 2 or Ns[0] != Ns[1]):
        raise DFlashError(f"a paired (swiglu) plan takes two weights of equal rows, got {Ns}")
    col_blocks = _col_blocks(Ns, b["bn"])
    if splits is None:
        target = b["per_unit"] * _UNITS[arch]
        most = max(1, rounds // _MIN_CHUNKS)  # a split keeps at least _MIN_CHUNKS chunks
        cands = [s for s in range(1, most + 1) if rounds % s == 0]
        splits = next((s for s in cands if col_blocks * s >= target), cands[-1])
    col_blocks = _col_blocks(Ns, b["bn"], paired)  # the splits above are the plain pair's either way
    if splits < 1 or rounds % splits:
        raise DFlashError(f"{splits} splits do not cut K={K} into whole chunks of {b['chunk']}")
    grid_x = col_blocks
    if b["block_loop"] and splits == 1:
        passes = math.ceil(col_blocks / (b["resident"] * _UNITS[arch]))
        if 1 < passes <= _MAX_PASSES:
            grid_x = math.ceil(col_blocks / passes)
    return GemmPlan(Ns=Ns, K=K, arch=arch, block_n=b["bn"], splits=splits, threads=b["threads"], grid_x=grid_x,
                    paired=paired)


def gemm_dispatch(M: int, N, K: int, arch: str, *, name: str = "dflash_gemm",
                  splits: int | None = None, epilogue: str | None = None,
                  out_shape: tuple[int, ...] | None = None, quant: Q4 | None = None,
                  norm: float | None = None) -> GemmDispatch:
    """Builds the spliceable skinny GEMM y[M, N] = x[M, K] . W[N, K]^T on ARCH, or with N a tuple of
    1..3 row counts, y_g = x . W_g^T for several weights of one x in one dispatch (the q, k and v
    projections of a layer; gate and up).

    M (1..64), each N (multiple of 16), K (multiple of 32 on CUDA, 16 on gfx): static shapes; x, W
    and y are bf16, the sums f32 (one rounding to bf16 at the end). arch: sm_80/86/89 or
    gfx1100/1151/1201. name: symbol prefix (every symbol starts with it). splits: override the plan's
    k splits (benchmarks; the numerics then differ from the default plan's).
    epilogue: None; "residual" (one weight: `@{name}(%x, %w, %r) -> bf16(r + bf16(x . W^T))`, r and
    the result [M, N]); "swiglu" (N = (n, n), gate then up: `@{name}(%x, %w0, %w1) ->
    bf16(bf16(silu(g)) * u)` with g, u the two products rounded to bf16, [M, n]). out_shape: the
    epilogue's r and result shape (default (M, N); any shape of M * N elements, e.g. the model's
    [1, M, N]). kernels/gemm/gemm_body.h, "Epilogues", has the roundings. quant: packed 4-bit
    weights in that format (module docstring): each `%w{g}` becomes its operands `Q4.operand_types`.
    norm: the eps of an RMSNorm applied to x first, in the GEMM's prologue (`norm_fused` shapes only;
    the function takes `%nw`, the norm's bf16 weight [K], after x).

    Raises:
        DFlashError: a shape or arch the kernel does not take, an unknown epilogue or one whose
            weights do not fit it, an out_shape of another size, a norm off `norm_fused`'s shapes,
            or a missing object.
    """
    Ns = _weights(N)
    for n in Ns:
        why = why_unsupported(M, n, K, arch, quant)
        if why:
            raise DFlashError(f"skinny GEMM [{M}x{K}] x [{n}x{K}]^T on {arch}: {why}")
    if epilogue not in (None, *EPILOGUES):
        raise DFlashError(f"skinny GEMM epilogue {epilogue!r}: use one of {EPILOGUES} or None")
    if epilogue == "residual" and len(Ns) != 1:
        raise DFlashError(f"the residual epilogue takes one weight, got {len(Ns)}")
    if norm is not None and not (norm_fused(M, len(Ns), epilogue, quant) and norm_why_unsupported(K, arch) is None):
        raise DFlashError(f"skinny GEMM with its norm in the prologue: M={M}, {len(Ns)} weights, epilogue {epilogue}, "
                          f"K={K}: only decode's one row of q + k + v or gate + up (swiglu), bf16, K <= {NORM_MAX_K}")
    obj = object_file(arch, quant)
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: run `make kernels` to build the kernel objects")
    plan = gemm_plan(Ns, K, arch, splits, paired=epilogue == "swiglu")
    G, mt = len(Ns), math.ceil(M / 16)  # 16-row m-tiles: with G, the entry point of the object
    S, KR, cb = plan.splits, plan.kr, plan.col_blocks
    x_t, c_t = f"tensor<{M}x{K}xbf16>", f"tensor<{cb}xi32>"
    w_t = weight_types(Ns, K, quant)
    if quant is None:
        w, pre = ["%w"] if G == 1 else [f"%w{g}" for g in range(G)], ""
    else:  # each weight's operands; the kernel binds three a weight (`Q4.bindings`)
        w, pre = [f"%{r}{g}" for g in range(G) for r in "qso"[:len(quant.operand_types(Ns[g], K))]], "q4"
    # Split partials (scratch): each weight's [S, M, N_g] after the previous weight's; only the size counts.
    p_t = f"tensor<{S}x{M}x{plan.N}xf32>" if S > 1 else "tensor<1xf32>"
    if epilogue is None:
        entry = f"dflash_{pre}gemm{G if G > 1 else ''}{'_norm' if norm is not None else ''}_mt{mt}"
        ins, in_t = w, w_t
        y_t = [f"tensor<{M}x{n}xbf16>" for n in Ns]
    else:
        n = Ns[0]
        shape = tuple(out_shape) if out_shape is not None else (M, n)
        if math.prod(shape) != M * n:
            raise DFlashError(f"skinny GEMM epilogue: out_shape {shape} does not hold [{M}, {n}]")
        o_t = f"tensor<{'x'.join(map(str, shape))}xbf16>"
        y_t = [o_t]
        if epilogue == "residual":
            entry, ins, in_t = f"dflash_{pre}gemm_res_mt{mt}", w + ["%res"], w_t + [o_t]
        else:
            entry, ins, in_t = f"dflash_{pre}swiglu{'_norm' if norm is not None else ''}_mt{mt}", w, w_t
    # one N per weight; an epilogue's kernel takes one (the columns of each of its weights)
    const_ns = Ns if epilogue is None else Ns[:1]
    consts = [("M", M), ("K", K), ("KR", KR), ("S", S), ("GX", plan.grid_x)] + [(f"N{g}", n) for g, n in enumerate(const_ns)]
    w_ops, w_ops_t = ins, in_t  # what the dispatch binds
    if quant is not None:
        consts += [("F", Q4_FORMATS[quant.fmt]), ("G", quant.group)]
        w_ops = [f"%{r}{g}" for g in range(G) for r in ("q", "s", "o" if quant.fmt != "sym" else "s")]
        w_ops_t = [t for n in Ns for t in quant.bindings(n, K)]
        if epilogue == "residual":
            w_ops, w_ops_t = w_ops + ["%res"], w_ops_t + in_t[-1:]
    if norm is not None:  # the norm's weight after x, its eps after the other constants
        consts.append(("E", f32_bits(norm, signed=True)))
        w_ops, w_ops_t, ins, in_t = ["%nw"] + w_ops, [f"tensor<{K}xbf16>"] + w_ops_t, ["%nw"] + ins, [f"tensor<{K}xbf16>"] + in_t
    layout = pipeline_layout(len(consts), 1 + len(w_ops), len(w_ops) + len(y_t) + 3)
    text = executable_source(f"{name}_mm", entry, arch, obj.name, layout, plan.threads, 2)
    # The split-K arrival counters: zero, and left zero by every call (the last workgroup of a column
    # block resets its counter), so one module global serves every call of this function.
    text += f"util.global private mutable @{name}_cnt = dense<0> : {c_t}\n"
    args = ", ".join(f"{v}: {t}" for v, t in zip(ins, in_t))
    results = y_t[0] if len(y_t) == 1 else f"({', '.join(y_t)})"
    text += f"util.func private @{name}(%x: {x_t}, {args}) -> {results} {{\n"
    text += "".join(f"    %c{c} = arith.constant {v} : i32\n" for c, v in consts)
    text += (f"    %gx = arith.constant {plan.grid_x} : index\n    %gy = arith.constant {S} : index\n"
             f"    %c = util.global.load @{name}_cnt : {c_t}\n"
             f"    %r:{len(y_t) + 2} = flow.dispatch @{name}_mm::@{entry}[%gx, %gy]"
             f"({', '.join(f'%c{c}' for c, _ in consts)}, %x, {', '.join(w_ops)}, %c)"
             f" : ({', '.join(['i32'] * len(consts))}, {x_t}, {', '.join(w_ops_t)}, {c_t})"
             f" -> (%c, {', '.join(y_t)}, {p_t})\n"
             f"    util.global.store %r#0, @{name}_cnt : {c_t}\n"
             f"    util.return {', '.join(f'%r#{g + 1}' for g in range(len(y_t)))} : {', '.join(y_t)}\n}}\n")
    return GemmDispatch(M=M, Ns=Ns, K=K, arch=arch, name=name, plan=plan, mlir=text,
                        flags=search_flags(), objects=[obj], epilogue=epilogue, quant=quant, norm=norm)


def standalone_module(d: GemmDispatch) -> str:
    """A whole module around D with a public `gemm(x[, nw], w0, ..[, r]) -> (y0, ..)` (D's function's
    arguments and results, out_shape left at its default; nw, the norm's weight, when D has one)."""
    x_t = f"tensor<{d.M}x{d.K}xbf16>"
    in_t = ([f"tensor<{d.K}xbf16>"] if d.norm is not None else []) + weight_types(d.Ns, d.K, d.quant)
    y_t = [f"tensor<{d.M}x{n}xbf16>" for n in d.Ns]
    if d.epilogue is not None:
        y_t = y_t[:1]
        in_t += y_t if d.epilogue == "residual" else []
    args = ", ".join(f"%a{i}: {t}" for i, t in enumerate(in_t))
    return (f"module @gemm_check {{\n{d.mlir}util.func public @gemm(%x: {x_t}, {args}) -> ({', '.join(y_t)}) {{\n"
            f"    %y:{len(y_t)} = util.call @{d.func}(%x, {', '.join(f'%a{i}' for i in range(len(in_t)))})"
            f" : ({x_t}, {', '.join(in_t)}) -> ({', '.join(y_t)})\n"
            f"    util.return {', '.join(f'%y#{g}' for g in range(len(y_t)))} : {', '.join(y_t)}\n}}\n}}\n")
