"""MLIR for the head norm + rope custom dispatch: Qwen3's per-head q_norm / k_norm and RoPE in one dispatch.

`norm_rope_dispatch(S, T, H, D, dtype, eps, arch)` returns the text of a `hal.executable.source`
bound to the committed object (norm_rope_gpu.cu built for `arch`) and

    util.func private @{name}(%x: tensor<S x T x H x D x dt>, %w: tensor<D x dt>,
                              %cos: tensor<S x T x D x dt>, %sin: tensor<S x T x D x dt>) -> tensor<S x T x H x D x dt>

which is `apply_rope(rms_norm(x, w, eps), cos, sin)` of export/qwen3.py, the eager op's roundings
included (norm_rope_body.h). T may be None: a dynamic token count (prefill, absorb). Under IREE's
own lowering the same ops take five dispatches (a cast, the sum of squares, the scaling, the
weight, the rope), each one launch on the host's critical path in decode. GPU archs only; the host
CPU keeps IREE's lowering. No IREE import here: this module only writes text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_iree.errors import DFlashError

from .attention import HIP_ARCHS, f32_bits
from .gemm import CUDA_ARCHS, OBJECTS_DIR, executable_source, gpu_object, pipeline_layout

ARCHS = CUDA_ARCHS + HIP_ARCHS  # scalar math: every GPU arch, gfx1030 included
THREADS = 64  # norm_rope_body.h NR_T
DTYPES = {"f32": 0, "bf16": 1, "f16": 2}  # norm_rope_body.h NR_F32, NR_BF16, NR_F16


@dataclass(frozen=True)
class NormRopeDispatch:
    """The spliceable head norm + rope for one shape, dtype and arch.

    mlir:    module-body text: the executable `@{name}_exe` and the function `@{name}` (module docstring).
    flags:   what `iree-compile` needs besides the device target (the object search path).
    objects: the object files the text refers to.
    """

    S: int
    T: int | None
    H: int
    D: int
    dtype: str
    eps: float
    arch: str
    name: str
    mlir: str
    flags: list[str] = field(default_factory=list)
    objects: list[Path] = field(default_factory=list)

    @property
    def func(self) -> str:
        """The function to `util.call`."""
        return self.name

    @property
    def types(self) -> tuple[str, str, str]:
        """The builtin types of x (and the result), of the weight, and of cos / sin."""
        return _types(self.S, self.T, self.H, self.D, self.dtype)


def _types(S: int, T: int | None, H: int, D: int, dtype: str) -> tuple[str, str, str]:
    t = "?" if T is None else T
    return f"tensor<{S}x{t}x{H}x{D}x{dtype}>", f"tensor<{D}x{dtype}>", f"tensor<{S}x{t}x{D}x{dtype}>"


def object_file(arch: str) -> Path:
    """Committed object for ARCH: PTX for sm_*, a code object for gfx*. Raises DFlashError for another arch."""
    return gpu_object("norm_rope", arch, ARCHS, "head norm + rope")


def norm_rope_dispatch(S: int, T: int | None, H: int, D: int, dtype: str, eps: float, arch: str, *,
                       name: str = "dflash_norm_rope") -> NormRopeDispatch:
    """Builds the spliceable head norm + rope of x [S, T, H, D] on ARCH (sm_80/86/89, gfx1030/1100/1151/1201).

    T: the token count, or None when it is dynamic. dtype: 'f32', 'bf16' or 'f16' (x, the weight,
    cos, sin and the result alike). eps: the RMSNorm epsilon. name: symbol prefix.
    Raises DFlashError for an arch without the kernel, an odd head_dim, another dtype, or a missing object.
    """
    obj = object_file(arch)
    if D % 2 or D < 2:
        raise DFlashError(f"head norm + rope: head_dim {D} must be even (the rope rotates halves)")
    if dtype not in DTYPES:
        raise DFlashError(f"head norm + rope: dtype {dtype} is not one of {', '.join(DTYPES)}")
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: run `make kernels` to build the kernel objects")
    x_t, w_t, c_t = _types(S, T, H, D, dtype)
    dyn = "{%t}" if T is None else ""
    consts = {"H": H, "D": D, "dt": DTYPES[dtype], "eps": f32_bits(eps, signed=True)}
    rows = (f"    %c1 = arith.constant 1 : index\n    %t = tensor.dim %x, %c1 : {x_t}\n"
            f"    %sh = arith.constant {S * H} : index\n    %n = arith.muli %t, %sh : index\n"
            if T is None else f"    %n = arith.constant {S * T * H} : index\n")
    text = executable_source(f"{name}_exe", "dflash_norm_rope", arch, obj.name, pipeline_layout(4, 4, 5), THREADS, 1)
    text += (f"util.func private @{name}(%x: {x_t}, %w: {w_t}, %cos: {c_t}, %sin: {c_t}) -> {x_t} {{\n"
             + "".join(f"    %c{k} = arith.constant {v} : i32\n" for k, v in consts.items())
             + rows
             + f"    %y = flow.dispatch @{name}_exe::@dflash_norm_rope[%n](%cH, %cD, %cdt, %ceps, %x, %w, %cos, %sin)"
             f" : (i32, i32, i32, i32, {x_t}{dyn}, {w_t}, {c_t}{dyn}, {c_t}{dyn}) -> {x_t}{dyn}\n"
             f"    util.return %y : {x_t}\n}}\n")
    return NormRopeDispatch(S=S, T=T, H=H, D=D, dtype=dtype, eps=eps, arch=arch, name=name, mlir=text,
                            flags=[f"--iree-hal-executable-object-search-path={OBJECTS_DIR}"], objects=[obj])


def standalone_module(d: NormRopeDispatch) -> str:
    """A whole module around D with a public `norm_rope(x, w, cos, sin) -> out` (checks)."""
    x_t, w_t, c_t = d.types
    return (f"module @norm_rope_check {{\n{d.mlir}"
            f"util.func public @norm_rope(%x: {x_t}, %w: {w_t}, %cos: {c_t}, %sin: {c_t}) -> {x_t} {{\n"
            f"    %y = util.call @{d.func}(%x, %w, %cos, %sin) : ({x_t}, {w_t}, {c_t}, {c_t}) -> {x_t}\n"
            f"    util.return %y : {x_t}\n}}\n}}\n")
