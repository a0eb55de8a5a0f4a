"""MLIR for the head norm + rope custom dispatch: Qwen3's per-head q_norm / k_norm and RoPE in one dispatch.

`norm_rope_dispatch(S, T, H, D, dtype, eps, arch)` returns the text of a `hal.executable.source`
bound to the committed object (norm_rope_gpu.cu built for `arch`) and

    util.func private @{name}(%x: tensor<S x T x H x D x dt>, %w: tensor<D x dt>,
                              %cos: tensor<S x T x D x dt>, %sin: tensor<S x T x D x dt>) -> tensor<S x T x H x D x dt>

which is `apply_rope(rms_norm(x, w, eps), cos, sin)` of export/qwen3.py, the eager op's roundings
included (norm_rope_body.h). T may be None: a dynamic token count (prefill, absorb). Under IREE's
own lowering the same ops take five dispatches (a cast, the sum of squares, the scaling, the
weight, the rope), each one launch on the host's critical path in decode. With `Hk`, one dispatch
does a layer's q and k (`dflash_norm_rope2`, the same arithmetic per head):

    util.func private @{name}(%q: tensor<S x T x H x D>, %wq, %k: tensor<S x T x Hk x D>, %wk, %cos, %sin)
        -> (tensor<S x T x H x D>, tensor<S x T x Hk x D>)

`norm_rope_kv_dispatch` adds the KV cache write to the pair (`dflash_norm_rope2_kv`): k's result and v
go straight into their rows of the cache, which the function returns written in place (a tied
operand), where IREE took a copy of v and a scatter dispatch besides (two launches a layer and step):

    util.func private @{name}(%q, %wq, %k, %wk, %cos, %sin, %v: tensor<S x T x Hk x D>, %rows: tensor<S*2T x i64>,
                              %cache: tensor<cache shape>) -> (tensor<S x T x H x D>, tensor<cache shape>)

with rows the flat cache rows of export/qwen3.py `cache_rows` (a stream's T key rows, then its T
value rows) and the cache [..., Hk * D].

The variants of Qwen3.5's gated attention (export/qwen35.py `zc_rms_norm` then `partial_rope`) take
the entry points `dflash_norm_rope_v` / `dflash_norm_rope2_v`: `zero_centered` scales by (1 + w) in
float32, `rotary_dim` R rotates the first R dims of a head (cos and sin [S, T, R]), and `x_stride`
(`k_stride`) reads each head as the first hd of that many values, so that q is read in place from
q_proj's [query, gate] heads (x [S, T, H, 2 hd]). Without them the text is Qwen3's, as before.

GPU archs only; the host CPU keeps IREE's lowering. No IREE import here: this module only writes text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from dflash_iree.arch import kernel_archs
from dflash_iree.errors import DFlashError

from ..hal import OBJECTS_DIR, executable_source, f32_bits, gpu_object, pipeline_layout, search_flags  # noqa: F401

ARCHS = kernel_archs("norm_rope")  # scalar math: every GPU arch, gfx1030 included
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
    Hk: int | None = None  # k's heads when the dispatch does q and k together
    zero_centered: bool = False  # the norm scales by (1 + w), in float32 (Qwen3.5)
    rotary_dim: int | None = None  # the rotated dims of a head; None: all D
    x_stride: int | None = None  # values per head of x (its last dim); None: D
    k_stride: int | None = None  # the same of k, with Hk
    cache_shape: tuple | None = None  # the KV cache the dispatch writes k and v into (norm_rope_kv_dispatch)

    @property
    def R(self) -> int:
        """The rotated dims of a head."""
        return self.D if self.rotary_dim is None else self.rotary_dim

    @property
    def variant(self) -> bool:
        """Whether the dispatch takes the variants' entry point (`dflash_norm_rope_v` / `2_v`)."""
        return (self.zero_centered or self.R != self.D or (self.x_stride or self.D) != self.D
                or (self.k_stride or self.D) != self.D)

    @property
    def func(self) -> str:
        """The function to `util.call`."""
        return self.name

    @property
    def types(self) -> tuple[str, str, str]:
        """The builtin types of the result (x's too unless x_stride), of the weight, and of cos / sin."""
        return _types(self.S, self.T, self.H, self.D, self.dtype, self.R)

    @property
    def cache_type(self) -> str | None:
        """The KV cache's builtin type (`norm_rope_kv_dispatch`), else None."""
        return None if self.cache_shape is None else f"tensor<{'x'.join(map(str, self.cache_shape))}x{self.dtype}>"

    @property
    def operand_types(self) -> list[str]:
        """The function's operand types in order: x, w (q then k with Hk), cos, sin; with the KV cache
        write, then v, rows and the cache."""
        _, w_t, c_t = self.types
        x_t = _types(self.S, self.T, self.H, self.x_stride or self.D, self.dtype)[0]
        k = [] if self.Hk is None else [_types(self.S, self.T, self.Hk, self.k_stride or self.D, self.dtype)[0], w_t]
        if self.cache_shape is None:
            return [x_t, w_t, *k, c_t, c_t]
        rows_t = f"tensor<{'?' if self.T is None else self.S * 2 * self.T}xi64>"
        return [x_t, w_t, *k, c_t, c_t, k[0], rows_t, self.cache_type]

    @property
    def result_types(self) -> list[str]:
        """The function's result types: x's, then k's with Hk, or the cache with its write."""
        if self.cache_shape is not None:
            return [self.types[0], self.cache_type]
        return [self.types[0]] + ([] if self.Hk is None else [_types(self.S, self.T, self.Hk, self.D, self.dtype)[0]])


def _types(S: int, T: int | None, H: int, D: int, dtype: str, R: int | None = None) -> tuple[str, str, str]:
    t = "?" if T is None else T
    return (f"tensor<{S}x{t}x{H}x{D}x{dtype}>", f"tensor<{D}x{dtype}>",
            f"tensor<{S}x{t}x{D if R is None else R}x{dtype}>")


def object_file(arch: str) -> Path:
    """Committed object for ARCH: PTX for sm_*, a code object for gfx*. Raises DFlashError for another arch."""
    return gpu_object("norm_rope", arch, ARCHS, "head norm + rope")


def _checked(S, T, H, D, dtype, eps, arch, name, Hk=None, zero_centered=False, rotary_dim=None, x_stride=None,
             k_stride=None) -> NormRopeDispatch:
    """The dispatch's fields, without its text, after `norm_rope_dispatch`'s checks (it raises what that does)."""
    obj = object_file(arch)
    if D % 2 or D < 2:
        raise DFlashError(f"head norm + rope: head_dim {D} must be even (the rope rotates halves)")
    if rotary_dim is not None and (rotary_dim % 2 or not 2 <= rotary_dim <= D):
        raise DFlashError(f"head norm + rope: rotary_dim {rotary_dim} must be even and in 2..{D} (head_dim)")
    for what, stride in (("x", x_stride), ("k", k_stride)):
        if stride is not None and stride < D:
            raise DFlashError(f"head norm + rope: {what}'s {stride} values a head are fewer than head_dim {D}")
    if dtype not in DTYPES:
        raise DFlashError(f"head norm + rope: dtype {dtype} is not one of {', '.join(DTYPES)}")
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: run `make kernels` to build the kernel objects")
    return NormRopeDispatch(S=S, T=T, H=H, D=D, dtype=dtype, eps=eps, arch=arch, name=name, mlir="",
                            flags=search_flags(), objects=[obj], Hk=Hk, zero_centered=zero_centered,
                            rotary_dim=None if rotary_dim == D else rotary_dim, x_stride=x_stride,
                            k_stride=None if Hk is None else k_stride)


def norm_rope_dispatch(S: int, T: int | None, H: int, D: int, dtype: str, eps: float, arch: str, *,
                       name: str = "dflash_norm_rope", Hk: int | None = None, zero_centered: bool = False,
                       rotary_dim: int | None = None, x_stride: int | None = None,
                       k_stride: int | None = None) -> NormRopeDispatch:
    """Builds the spliceable head norm + rope of x [S, T, H, hd] on ARCH (sm_80/86/89, gfx1030/1100/1151/1201).

    T: the token count, or None when it is dynamic. dtype: 'f32', 'bf16' or 'f16' (x, the weight,
    cos, sin and the result alike). eps: the RMSNorm epsilon. name: symbol prefix. Hk: with it, the
    function also takes k [S, T, Hk, hd] and its weight after x's, and returns both (module
    docstring): q and k of a layer share eps, head_dim and the position tables, and one dispatch is
    one launch less in every layer of every step.
    The variants (module docstring; any of them selects the `_v` entry points): zero_centered: the
    norm scales by (1 + w) in float32 and rounds once (export/qwen35.py `zc_rms_norm`). rotary_dim:
    the rotated dims R of a head (even, 2..hd), cos and sin [S, T, R]; None or hd: all of them.
    x_stride, k_stride: x is [S, T, H, x_stride] (k [S, T, Hk, k_stride]), each head the first hd
    of its values; None: hd.
    Raises DFlashError for an arch without the kernel, an odd head_dim, an odd or out-of-range
    rotary_dim, a stride below head_dim, another dtype, or a missing object.
    """
    d = _checked(S, T, H, D, dtype, eps, arch, name, Hk, zero_centered, rotary_dim, x_stride, k_stride)
    obj = d.objects[0]
    heads = H + (Hk or 0)
    dyn = "{%t}" if T is None else ""
    if d.variant:  # norm_rope_gpu.cu's push constants of the `_v` entry points, in order
        consts = {"H": H, **({} if Hk is None else {"Hk": Hk}), "D": D, "R": d.R, "XS": x_stride or D,
                  **({} if Hk is None else {"XSk": k_stride or D}), "zc": int(zero_centered)}
    else:
        consts = {"H": H, **({} if Hk is None else {"Hk": Hk}), "D": D}
    consts.update({"dt": DTYPES[dtype], "eps": f32_bits(eps, signed=True)})
    if T is None:
        rows = (f"    %c1 = arith.constant 1 : index\n    %t = tensor.dim %x, %c1 : {d.operand_types[0]}\n"
                f"    %sh = arith.constant {S * heads} : index\n    %n = arith.muli %t, %sh : index\n")
        if Hk is not None:  # the workgroups that take q's heads: rows * H
            rows += (f"    %sq = arith.constant {S * H} : index\n    %nq = arith.muli %t, %sq : index\n"
                     "    %cnq = arith.index_cast %nq : index to i32\n")
    else:
        rows = f"    %n = arith.constant {S * T * heads} : index\n"
        if Hk is not None:
            rows += f"    %cnq = arith.constant {S * T * H} : i32\n"
    pair = Hk is not None
    entry = ("dflash_norm_rope2" if pair else "dflash_norm_rope") + ("_v" if d.variant else "")
    args = ["x", "w", *(["k", "wk"] if pair else []), "cos", "sin"]
    dynamic = ["x", *(["k"] if pair else []), "cos", "sin"]  # operands with the token dimension
    pushed = (["%cnq"] if pair else []) + [f"%c{k}" for k in consts]
    ins, outs = d.operand_types, d.result_types
    text = executable_source(f"{name}_exe", entry, arch, obj.name,
                             pipeline_layout(len(pushed), len(ins), len(ins) + len(outs)), THREADS, 1)
    operand_types = ", ".join(["i32"] * len(pushed) + [t + (dyn if a in dynamic else "") for a, t in zip(args, ins)])
    result_types = ", ".join(t + dyn for t in outs)
    text += (f"util.func private @{name}({', '.join(f'%{a}: {t}' for a, t in zip(args, ins))})"
             f" -> ({', '.join(outs)}) {{\n"
             + "".join(f"    %c{k} = arith.constant {v} : i32\n" for k, v in consts.items())
             + rows
             + f"    %y:{len(outs)} = flow.dispatch @{name}_exe::@{entry}[%n]({', '.join(pushed + ['%' + a for a in args])})"
             f" : ({operand_types}) -> ({result_types})\n"
             f"    util.return {', '.join(f'%y#{i}' for i in range(len(outs)))} : {', '.join(outs)}\n}}\n")
    return replace(d, mlir=text)


def norm_rope_kv_dispatch(S: int, T: int | None, H: int, Hk: int, D: int, dtype: str, eps: float, cache_shape,
                          arch: str, *, name: str = "dflash_norm_rope_kv") -> NormRopeDispatch:
    """Builds the spliceable head norm + rope of a layer's q [S, T, H, D] and k [S, T, Hk, D] that also
    writes k's result and v [S, T, Hk, D] into the KV cache (module docstring, `dflash_norm_rope2_kv`).

    T: the token count, or None when it is dynamic. dtype: 'f32', 'bf16' or 'f16' (q, k, v, the
    weights, cos, sin and the cache alike). cache_shape: the cache's static shape, its last dim Hk * D
    and fewer than 2**31 rows. Returns a NormRopeDispatch with Hk and cache_shape set (its
    `operand_types` and `result_types` are the function's, as in the module docstring).
    Raises DFlashError as `norm_rope_dispatch` does, and for a cache of another row width.
    """
    cache_shape = tuple(int(c) for c in cache_shape)
    if len(cache_shape) < 2 or cache_shape[-1] != Hk * D:
        raise DFlashError(f"head norm + rope + KV cache: cache {cache_shape} does not have rows of Hk * D = {Hk * D} values")
    if math.prod(cache_shape[:-1]) >= 2 ** 31:
        raise DFlashError(f"head norm + rope + KV cache: cache {cache_shape} has too many rows")
    d = replace(_checked(S, T, H, D, dtype, eps, arch, name, Hk), cache_shape=cache_shape)
    dyn = "{%t}" if T is None else ""
    ins = d.operand_types
    q_t, cache_t = ins[0], d.cache_type
    consts = {"H": H, "Hk": Hk, "D": D}
    if T is None:
        rows = (f"    %c1 = arith.constant 1 : index\n    %t = tensor.dim %x, %c1 : {q_t}\n"
                f"    %sh = arith.constant {S * (H + 2 * Hk)} : index\n    %n = arith.muli %t, %sh : index\n"
                f"    %sq = arith.constant {S * H} : index\n    %nq = arith.muli %t, %sq : index\n"
                "    %cnq = arith.index_cast %nq : index to i32\n    %cT = arith.index_cast %t : index to i32\n"
                f"    %s2 = arith.constant {2 * S} : index\n    %nr = arith.muli %t, %s2 : index\n")
    else:
        rows = (f"    %n = arith.constant {S * T * (H + 2 * Hk)} : index\n    %cnq = arith.constant {S * T * H} : i32\n"
                f"    %cT = arith.constant {T} : i32\n")
    args = ["x", "w", "k", "wk", "cos", "sin", "v", "rows", "cache"]
    dims = {"x": dyn, "k": dyn, "cos": dyn, "sin": dyn, "v": dyn, "rows": "{%nr}" if T is None else ""}
    pushed = ["%cnq", "%cH", "%cHk", "%cD", "%cT", "%cdt", "%ceps"]
    text = executable_source(f"{name}_exe", "dflash_norm_rope2_kv", arch, d.objects[0].name,
                             pipeline_layout(len(pushed), len(ins) - 1, len(ins) + 1), THREADS, 1)
    operand_types = ", ".join(["i32"] * len(pushed) + [ty + dims.get(a, "") for a, ty in zip(args, ins)])
    text += (f"util.func private @{name}({', '.join(f'%{a}: {ty}' for a, ty in zip(args, ins))})"
             f" -> ({q_t}, {cache_t}) {{\n"
             + "".join(f"    %c{k} = arith.constant {v} : i32\n" for k, v in consts.items())
             + f"    %cdt = arith.constant {DTYPES[dtype]} : i32\n"
             f"    %ceps = arith.constant {f32_bits(eps, signed=True)} : i32\n"
             + rows
             + f"    %y:2 = flow.dispatch @{name}_exe::@dflash_norm_rope2_kv[%n]({', '.join(pushed + ['%' + a for a in args])})"
             f" : ({operand_types}) -> ({q_t}{dyn}, %cache)\n"
             f"    util.return %y#0, %y#1 : {q_t}, {cache_t}\n}}\n")
    return replace(d, mlir=text)


def standalone_module(d: NormRopeDispatch) -> str:
    """A whole module around D with a public `norm_rope(x, w, cos, sin) -> out` (with Hk:
    `norm_rope(q, wq, k, wk, cos, sin) -> (q out, k out)`; with the KV cache write:
    `norm_rope(q, wq, k, wk, cos, sin, v, rows, cache) -> (q out, the cache written)`, the cache
    argument itself left as it was), for the checks (bench/norm_rope_check.py)."""
    ins, outs = d.operand_types, d.result_types
    params = ", ".join(f"%a{i}: {t}" for i, t in enumerate(ins))
    return (f"module @norm_rope_check {{\n{d.mlir}"
            f"util.func public @norm_rope({params}) -> ({', '.join(outs)}) {{\n"
            f"    %y:{len(outs)} = util.call @{d.func}({', '.join(f'%a{i}' for i in range(len(ins)))})"
            f" : ({', '.join(ins)}) -> ({', '.join(outs)})\n"
            f"    util.return {', '.join(f'%y#{i}' for i in range(len(outs)))} : {', '.join(outs)}\n}}\n}}\n")
