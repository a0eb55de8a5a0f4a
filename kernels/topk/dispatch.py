"""MLIR for the draft top-K custom dispatch, ready to splice into a module that `iree-compile` builds.

`topk_dispatch(n, V, K, arch)` returns the text of two `hal.executable.source` ops (the kernel's
two stages, bound to the committed objects for `arch`) and two `util.func private` functions that
call them. The compile pipeline pastes `.mlir` into the drafter's module, calls `.func` (or
`.func_into`) on the drafter's logits, and adds `.flags` to its `iree-compile` flags. See
kernels/README.md for the interface and the dispatch ABI; topk_body.h for the algorithm.

No IREE import here: this module only writes text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash_iree.arch import kernel_archs
from dflash_iree.errors import DFlashError

from ..hal import (OBJECTS_DIR, device_flags, executable_head, executable_target, host_object_arch,  # noqa: F401
                   pipeline_layout, search_flags)

MAX_K = 64

CUDA_ARCHS = kernel_archs("topk", "cuda")
HIP_ARCHS = kernel_archs("topk", "hip")
ARCHS = ("host",) + CUDA_ARCHS + HIP_ARCHS

# Threads x elements per round of one workgroup, as compiled into the objects (DK_T * DK_U in
# topk_gpu.cu and topk_cpu.c), and the rounds per chunk we aim for: few on GPUs so that a
# [15, 151936] block spreads over every multiprocessor, more on CPUs where a workgroup is a call.
_GPU_ROUND, _GPU_ROUNDS_PER_CHUNK, _GPU_WORKGROUP = 256 * 8, 2, 256
_CPU_ROUND, _CPU_ROUNDS_PER_CHUNK = 64 * 16, 16
# The merge gathers the C*K candidates of a row into the shared candidate buffer (DK_T*DK_U: 1024 on
# CPUs, 2048 on GPUs) and ranks them, quadratic in their number: bound it.
_MAX_MERGE = 1024


@dataclass(frozen=True)
class TopKDispatch:
    """The spliceable top-K for one (n, V, K, arch).

    mlir:      module-body text: the executables `@{name}_partial`, `@{name}_merge` and the
               functions below. Symbols all start with `name`.
    func:      `util.func private @{name}(tensor<n x V x f32>, f32 T) -> (tensor<n x K x i32> ids,
               tensor<n x K x f32> log-probs)`.
    func_into: the same with two more arguments, tensors of the result shapes whose storage the
               results take (results tied to them; their contents are overwritten).
    flags:     what `iree-compile` needs besides the device target (the object search path).
    objects:   the object files the text refers to.
    chunks:    C, the workgroups per row of the first stage (chunk_len logits each).
    dtype:     the logits' element type, 'f32' or 'bf16'.
    """

    n: int
    V: int
    K: int
    arch: str
    name: str
    chunks: int
    chunk_len: int
    dtype: str
    mlir: str
    flags: list[str] = field(default_factory=list)
    objects: list[Path] = field(default_factory=list)

    @property
    def func(self) -> str:
        return self.name

    @property
    def func_into(self) -> str:
        return f"{self.name}_into"


def object_file(arch: str) -> Path:
    """Committed object for ARCH: PTX for sm_*, a code object for gfx*, an ELF .o for host."""
    if arch in CUDA_ARCHS:
        return OBJECTS_DIR / f"topk_{arch}.ptx"
    if arch in HIP_ARCHS:
        return OBJECTS_DIR / f"topk_{arch}.co"
    if arch == "host":
        return OBJECTS_DIR / f"topk_{host_object_arch()}.o"
    raise DFlashError(f"unknown arch '{arch}' for the top-K kernel; known: {', '.join(ARCHS)}")


def check_shape(n: int, V: int, K: int) -> None:
    """Refuses what the kernel does not do, with the reason. Raises DFlashError."""
    if not 1 <= K <= MAX_K:
        raise DFlashError(f"--top-k {K} is outside the top-K kernel: it supports 1 <= K <= {MAX_K}")
    if n < 1:
        raise DFlashError(f"top-K needs at least one row of logits, got n={n}")
    if V < K:
        raise DFlashError(f"top-K with K={K} needs a vocabulary of at least K logits, got V={V}")
    if n * V >= 2**31:
        raise DFlashError(f"top-K indexes logits with 32-bit offsets: n*V={n * V} is too large")


def plan_chunks(V: int, K: int, arch: str) -> tuple[int, int]:
    """(C, chunk_len): how the first stage splits a row of V logits into C chunks."""
    rnd, per = (_CPU_ROUND, _CPU_ROUNDS_PER_CHUNK) if arch == "host" else (_GPU_ROUND, _GPU_ROUNDS_PER_CHUNK)
    c = max(1, min(math.ceil(V / (rnd * per)), _MAX_MERGE // K))
    length = math.ceil(math.ceil(V / c) / 64) * 64  # whole cache lines per chunk
    return math.ceil(V / length), length


def _cpu_shim(entry: str, layout: str, bindings: list[str], constants: int, wg_dims: int) -> str:
    """A workgroup function that passes raw buffer addresses, constants and workgroup ids to C."""
    lines = ["  builtin.module {",
             f"    func.func private @{entry}_cpu({', '.join(['index'] * len(bindings) + ['i32'] * (constants + wg_dims))})"
             " attributes {hal.import.static}",
             f"    func.func @{entry}() {{",
             "      %c0 = arith.constant 0 : index"]
    args = []
    for i, ty in enumerate(bindings):
        lines.append(f"      %b{i} = hal.interface.binding.subspan layout({layout}) binding({i}) alignment(64)"
                     f" offset(%c0) : memref<{ty}>")
        lines.append(f"      %p{i} = memref.extract_aligned_pointer_as_index %b{i} : memref<{ty}> -> index")
        args.append(f"%p{i}")
    for i in range(constants):
        lines.append(f"      %k{i} = hal.interface.constant.load layout({layout}) ordinal({i}) : i32")
        args.append(f"%k{i}")
    for d in range(wg_dims):
        lines.append(f"      %w{d} = hal.interface.workgroup.id[{d}] : index")
        lines.append(f"      %wi{d} = arith.index_castui %w{d} : index to i32")
        args.append(f"%wi{d}")
    types = ["index"] * len(bindings) + ["i32"] * (constants + wg_dims)
    lines += [f"      func.call @{entry}_cpu({', '.join(args)}) : ({', '.join(types)}) -> ()",
              "      return", "    }", "  }"]
    return "\n".join(lines)


def _executable(sym: str, entry: str, arch: str, obj: str, layout: str, workload: int,
                bindings: list[str], constants: int) -> str:
    head = executable_head(sym, entry, executable_target(arch), obj, layout, workload)
    if arch == "host":
        return head + "\n" + _cpu_shim(entry, layout, bindings, constants, workload) + "\n}\n"
    return head + f" <workgroup_size = [{_GPU_WORKGROUP} : index, 1 : index, 1 : index]>\n}}\n"


def topk_dispatch(n: int, V: int, K: int, arch: str, *, name: str = "dflash_topk",
                  dtype: str = "f32") -> TopKDispatch:
    """Builds the spliceable top-K for logits [n, V] and K on ARCH.

    n, V, K: static shapes (1 <= K <= 64, K <= V); arch: 'host', sm_80/86/89 or
    gfx1030/1100/1151/1201; name: symbol prefix; dtype: 'f32', or 'bf16' (widened to f32 by an
    extra elementwise dispatch before the kernel). Raises DFlashError for what it cannot build.
    """
    check_shape(n, V, K)
    if dtype not in ("f32", "bf16"):
        raise DFlashError(f"top-K logits must be f32 or bf16, got {dtype}")
    obj = object_file(arch)
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: run `make kernels` to build the top-K objects")
    C, L = plan_chunks(V, K, arch)
    R = 2 * K + 2
    lp, lm = pipeline_layout(5, 1, 2), pipeline_layout(3, 1, 3)
    ex_p = _executable(f"{name}_partial", "dflash_topk_partial", arch, obj.name, lp, 2,
                       [f"{n * V}xf32", f"{n * C * R}xi32"], 5)
    ex_m = _executable(f"{name}_merge", "dflash_topk_merge", arch, obj.name, lm, 1,
                       [f"{n * C * R}xi32", f"{n * K}xi32", f"{n * K}xf32"], 3)
    x_t, ids_t, lp_t, part_t = f"tensor<{n}x{V}xf32>", f"tensor<{n}x{K}xi32>", f"tensor<{n}x{K}xf32>", f"tensor<{n}x{C}x{R}xi32>"
    in_t = f"tensor<{n}x{V}x{dtype}>"
    widen = f"    %x = arith.extf %logits : {in_t} to {x_t}\n" if dtype == "bf16" else ""
    xv = "%x" if dtype == "bf16" else "%logits"
    funcs = f"""util.func private @{name}_into(%logits: {in_t}, %t: f32, %ids0: {ids_t}, %lp0: {lp_t}) -> ({ids_t}, {lp_t}) {{
{widen}    %one = arith.constant 1.0 : f32
    %inv = arith.divf %one, %t : f32
    %invb = arith.bitcast %inv : f32 to i32
    %V = arith.constant {V} : i32
    %K = arith.constant {K} : i32
    %C = arith.constant {C} : i32
    %L = arith.constant {L} : i32
    %cC = arith.constant {C} : index
    %cn = arith.constant {n} : index
    %part = flow.dispatch @{name}_partial::@dflash_topk_partial[%cC, %cn](%V, %K, %C, %L, %invb, {xv}) : (i32, i32, i32, i32, i32, {x_t}) -> {part_t}
    %r:2 = flow.dispatch @{name}_merge::@dflash_topk_merge[%cn](%K, %C, %invb, %part, %ids0, %lp0) : (i32, i32, i32, {part_t}, {ids_t}, {lp_t}) -> (%ids0, %lp0)
    util.return %r#0, %r#1 : {ids_t}, {lp_t}
}}
util.func private @{name}(%logits: {in_t}, %t: f32) -> ({ids_t}, {lp_t}) {{
    %ids0 = tensor.empty() : {ids_t}
    %lp0 = tensor.empty() : {lp_t}
    %r:2 = util.call @{name}_into(%logits, %t, %ids0, %lp0) : ({in_t}, f32, {ids_t}, {lp_t}) -> ({ids_t}, {lp_t})
    util.return %r#0, %r#1 : {ids_t}, {lp_t}
}}
"""
    return TopKDispatch(n=n, V=V, K=K, arch=arch, name=name, chunks=C, chunk_len=L, dtype=dtype, mlir=ex_p + ex_m + funcs,
                        flags=search_flags(), objects=[obj])


def standalone_module(d: TopKDispatch) -> str:
    """A whole module around D with public `topk(logits, T)` and `topk_into(logits, T, ids0, lp0)`."""
    in_t = f"tensor<{d.n}x{d.V}x{d.dtype}>"
    ids_t, lp_t = f"tensor<{d.n}x{d.K}xi32>", f"tensor<{d.n}x{d.K}xf32>"
    return f"""module @topk_check {{
{d.mlir}
util.func public @topk(%x: {in_t}, %t: f32) -> ({ids_t}, {lp_t}) {{
    %r:2 = util.call @{d.func}(%x, %t) : ({in_t}, f32) -> ({ids_t}, {lp_t})
    util.return %r#0, %r#1 : {ids_t}, {lp_t}
}}
util.func public @topk_into(%x: {in_t}, %t: f32, %ids0: {ids_t}, %lp0: {lp_t}) -> ({ids_t}, {lp_t}) {{
    %r:2 = util.call @{d.func_into}(%x, %t, %ids0, %lp0) : ({in_t}, f32, {ids_t}, {lp_t}) -> ({ids_t}, {lp_t})
    util.return %r#0, %r#1 : {ids_t}, {lp_t}
}}
}}
"""
