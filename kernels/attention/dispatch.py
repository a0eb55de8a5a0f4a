"""MLIR for the block-attention custom dispatch: a verify block's attention over the KV cache, read in place.

`attention_dispatch(S, Hkv, R, D, L, C, arch)` returns the text of a `hal.executable.source` bound to
the committed object (attention_gpu.cu built for `arch`), a module global of arrival counters, and

    util.func private @{name}(%q: tensor<S x Hkv x R x D x bf16>, %cache: tensor<S x L x 2 x C x (Hkv*D) x bf16>,
                              %mask: tensor<S x 1 x R x ? x i1>, [%gate: <the result's type>,] %layer: i32)
                              -> tensor<S x Hkv x R x D x bf16>

which is `scaled_dot_product_attention(q, k, v, mask)` with k, v the first N = dim(mask, 3) rows of
layer `layer` of the cache (keys at [:, layer, 0], values at [:, layer, 1], head h at columns
[h*D, (h+1)*D)) and the default scale D^-0.5 unless one is given. The algorithm and its numerics
contract (a row's result is independent of R, of its place in the block and of N past its last
visible key) are in attention_body.h. With `g` (query heads per KV head) q and the result are in the
model's own token-major layout instead, `tensor<S x T x (Hkv*g) x D>` in and `tensor<S x T x
(Hkv*g*D)>` out with R = T * g (row t * g + j: token t, query head h * g + j), which spares the
transposes around the attention (export/qwen3.py `attend` writes them). With `gated`, the function
takes one operand more, %gate (bf16, the result's type and layout), and returns
bf16(attention) * bf16(sigmoid(gate)) rounded to bf16 (the Qwen3.5 family's gated attention,
export/qwen35.py `gated_cache_attention`; attention_body.h "Output gate"); head_dim up to 256 then.
Entry points and objects (attention_body.h, "Variants"): `dflash_attention` (attention_{arch}: no
gate, head_dim <= 128), `dflash_attention_gated` (attention_gated_{arch}: head_dim <= 128) and
`dflash_attention_gated_d256` (attention_gated_d256_{arch}: 128 < head_dim <= 256). GPU archs only;
the host CPU keeps its matmul attention.
No IREE import here: this module only writes text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash_iree.arch import kernel_archs
from dflash_iree.errors import DFlashError

from ..hal import OBJECTS_DIR, executable_source, f32_bits, gpu_object, pipeline_layout, search_flags  # noqa: F401

CUDA_ARCHS = kernel_archs("attention", "cuda")
HIP_ARCHS = kernel_archs("attention", "hip")  # no matrix instructions needed: gfx1030 too
ARCHS = CUDA_ARCHS + HIP_ARCHS
THREADS = 256  # attention_body.h AT_T
ROWS_PER_WORKGROUP = 16  # attention_body.h AT_RW
KEYS_PER_CHUNK = 64  # AT_KC
MAX_ROWS = 128  # verify blocks of 16 tokens up to g = 8 query heads a KV head (the body takes any R)
MAX_HEAD_DIM = 128  # AT_DMAX of the ungated entry point
MAX_GATED_HEAD_DIM = 256  # AT_DMAX of dflash_attention_gated_d256


@dataclass(frozen=True)
class AttentionDispatch:
    """The spliceable block attention for one shape and arch.

    mlir:    module-body text: the executable `@{name}_exe`, the global `@{name}_cnt` (arrival
             counters, zero between calls) and the function `@{name}` (module docstring).
    flags:   what `iree-compile` needs besides the device target (the object search path).
    objects: the object files the text refers to.
    """

    S: int
    Hkv: int
    R: int
    D: int
    L: int
    C: int
    arch: str
    name: str
    scale: float
    mlir: str
    g: int = 0
    gated: bool = False
    flags: list[str] = field(default_factory=list)
    objects: list[Path] = field(default_factory=list)

    @property
    def func(self) -> str:
        """The function to `util.call`."""
        return self.name

    @property
    def entry(self) -> str:
        """The object's entry point this dispatch launches (`entry_point`)."""
        return entry_point(self.D, self.gated)[1]

    @property
    def row_groups(self) -> int:
        """Workgroups per KV head and stream along the query rows (16 rows each)."""
        return math.ceil(self.R / ROWS_PER_WORKGROUP)


def entry_point(D: int, gated: bool = False) -> tuple[str, str]:
    """(object file stem, entry point) of the variant for head_dim D (<= 128, or <= 256 gated) with or
    without the output gate. Does not check D (`why_unsupported` does)."""
    if not gated:
        return "attention", "dflash_attention"
    if D <= MAX_HEAD_DIM:
        return "attention_gated", "dflash_attention_gated"
    return "attention_gated_d256", "dflash_attention_gated_d256"


def object_file(arch: str, D: int = MAX_HEAD_DIM, gated: bool = False) -> Path:
    """Committed object for ARCH of the variant for head_dim D, gated or not (`entry_point`): PTX for
    sm_*, a code object for gfx*. Raises DFlashError for another arch."""
    return gpu_object(entry_point(D, gated)[0], arch, ARCHS, "block-attention")


def why_unsupported(S: int, Hkv: int, R: int, D: int, L: int, C: int, arch: str, gated: bool = False) -> str | None:
    """None when the kernel takes this shape on ARCH, else the reason it does not. gated: with the
    output gate, which takes head_dim up to 256 (without, 128)."""
    if arch not in ARCHS:
        return f"arch {arch} has no block-attention kernel"
    if not 1 <= R <= MAX_ROWS:
        return f"R={R} query rows is outside 1..{MAX_ROWS}"
    dmax = MAX_GATED_HEAD_DIM if gated else MAX_HEAD_DIM
    if D % 8 or not 8 <= D <= dmax:
        return f"head_dim {D} is not a multiple of 8 up to {dmax}{' (gated: 256)' if not gated and D <= 256 else ''}"
    return None


def attention_dispatch(S: int, Hkv: int, R: int, D: int, L: int, C: int, arch: str, *,
                       name: str = "dflash_attention", scale: float | None = None, g: int = 0,
                       gated: bool = False) -> AttentionDispatch:
    """Builds the spliceable block attention for S streams, Hkv KV heads, R (1..128) query rows of
    head_dim D (a multiple of 8 up to 128; up to 256 gated), over a cache of L layers and C rows (max
    context), on ARCH (sm_80/86/89, gfx1030/1100/1151/1201).

    scale: the softmax scale (default D ** -0.5). name: symbol prefix (every symbol starts with it).
    g: 0 for q and the result [S, Hkv, R, D]; else the query heads per KV head, for the model's layout
    (module docstring). gated: the function takes %gate, bf16 of the result's type, after the mask
    and returns the gated attention (module docstring). Raises DFlashError for a shape or arch the
    kernel does not take, a g that does not divide R, or a missing object.
    """
    why = why_unsupported(S, Hkv, R, D, L, C, arch, gated)
    if not why and (g < 0 or (g and R % g)):
        why = f"g={g} query heads per KV head do not divide R={R}"
    if why:
        raise DFlashError(f"block attention S={S} Hkv={Hkv} R={R} D={D} over L={L} x C={C} on {arch}: {why}")
    obj = object_file(arch, D, gated)
    entry = entry_point(D, gated)[1]
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: run `make kernels` to build the kernel objects")
    scale = D ** -0.5 if scale is None else scale
    scale_bits = f32_bits(scale * math.log2(math.e), signed=True)
    rg = math.ceil(R / ROWS_PER_WORKGROUP)
    q_t = f"tensor<{S}x{Hkv}x{R}x{D}xbf16>" if not g else f"tensor<{S}x{R // g}x{Hkv * g}x{D}xbf16>"
    o_t = q_t if not g else f"tensor<{S}x{R // g}x{Hkv * g * D}xbf16>"
    c_t = f"tensor<{S}x{L}x2x{C}x{Hkv * D}xbf16>"
    m1, m8 = f"tensor<{S}x1x{R}x?xi1>", f"tensor<{S}x1x{R}x?xi8>"
    n_t = f"tensor<{S * Hkv * rg}xi32>"
    record = S * Hkv * rg * ROWS_PER_WORKGROUP * (D + 2)  # f32 scratch per key chunk
    # The gate is a read-only binding after the mask (attention_gpu.cu): 4 of 7 then.
    layout = pipeline_layout(10, 4, 7) if gated else pipeline_layout(10, 3, 6)
    text = executable_source(f"{name}_exe", entry, arch, obj.name, layout, THREADS, 3)
    gate_arg, gate_op, gate_t = (f"%gate: {o_t}, ", ", %gate", f", {o_t}") if gated else ("", "", "")
    # Arrival counters: zero, and left zero by every call (the last workgroup of a row group resets
    # its own), so one global serves every layer; its load/store orders the calls.
    text += f"util.global private mutable @{name}_cnt = dense<0> : {n_t}\n"
    consts = {"R": R, "D": D, "H": Hkv, "L": L, "C": C, "scale": scale_bits, "G": g}
    text += (f"util.func private @{name}(%q: {q_t}, %cache: {c_t}, %mask: {m1}, {gate_arg}%layer: i32) -> {o_t} {{\n"
             + "".join(f"    %c{k} = arith.constant {v} : i32\n" for k, v in consts.items())
             + f"    %i3 = arith.constant 3 : index\n    %kc = arith.constant {KEYS_PER_CHUNK} : index\n"
             f"    %rec = arith.constant {record} : index\n"
             f"    %gy = arith.constant {Hkv * rg} : index\n    %gz = arith.constant {S} : index\n"
             f"    %n = tensor.dim %mask, %i3 : {m1}\n"
             f"    %chunks = arith.ceildivui %n, %kc : index\n    %psize = arith.muli %chunks, %rec : index\n"
             f"    %n32 = arith.index_cast %n : index to i32\n    %ch32 = arith.index_cast %chunks : index to i32\n"
             f"    %m8 = arith.extui %mask : {m1} to {m8}\n"
             f"    %cnt = util.global.load @{name}_cnt : {n_t}\n"
             f"    %r:3 = flow.dispatch @{name}_exe::@{entry}[%chunks, %gy, %gz]"
             f"(%cR, %n32, %cD, %cH, %layer, %cL, %cC, %ch32, %cscale, %cG, %q, %cache, %m8{gate_op}, %cnt)"
             f" : (i32, i32, i32, i32, i32, i32, i32, i32, i32, i32, {q_t}, {c_t}, {m8}{{%n}}{gate_t}, {n_t})"
             f" -> (%cnt, {o_t}, tensor<?xf32>{{%psize}})\n"
             f"    util.global.store %r#0, @{name}_cnt : {n_t}\n"
             f"    util.return %r#1 : {o_t}\n}}\n")
    return AttentionDispatch(S=S, Hkv=Hkv, R=R, D=D, L=L, C=C, arch=arch, name=name, scale=scale, mlir=text, g=g,
                             gated=gated, flags=search_flags(), objects=[obj])


def standalone_module(d: AttentionDispatch) -> str:
    """A whole module around D with a public `attention(q, cache, mask, layer) -> out`, or for a gated D
    `attention(q, cache, mask, gate, layer) -> out` (gate of out's type), for benchmarks and checks.
    Raises DFlashError for a D in the model's layout (g > 0)."""
    if d.g:
        raise DFlashError("standalone_module takes the head-major layout (g = 0)")
    q_t = f"tensor<{d.S}x{d.Hkv}x{d.R}x{d.D}xbf16>"
    c_t = f"tensor<{d.S}x{d.L}x2x{d.C}x{d.Hkv * d.D}xbf16>"
    m1 = f"tensor<{d.S}x1x{d.R}x?xi1>"
    ga, gv, gt = (f"%gate: {q_t}, ", "%gate, ", f"{q_t}, ") if d.gated else ("", "", "")
    return (f"module @attention_check {{\n{d.mlir}"
            f"util.func public @attention(%q: {q_t}, %cache: {c_t}, %mask: {m1}, {ga}%layer: i32) -> {q_t} {{\n"
            f"    %y = util.call @{d.func}(%q, %cache, %mask, {gv}%layer) : ({q_t}, {c_t}, {m1}, {gt}i32) -> {q_t}\n"
            f"    util.return %y : {q_t}\n}}\n}}\n")
