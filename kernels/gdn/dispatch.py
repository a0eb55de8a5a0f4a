"""MLIR for the Gated DeltaNet step dispatch: one GDN layer's token-by-token rule, its state slots written in place.

`gdn_dispatch(S, T, Hk, Hv, dk, dv, slot_shape, dtype, arch)` returns the text of a
`hal.executable.source` bound to the committed object (gdn_gpu.cu built for `arch`) and

    util.func private @{name}(%mixed: tensor<S x T x conv_dim x dt>, %b: tensor<S x T x Hv x dt>,
                              %a: tensor<S x T x Hv x dt>, %A_log: tensor<Hv x dt>, %dt_bias: tensor<Hv x dt>,
                              %rows: tensor<S x 2 x i32>, %slots: tensor<slot_shape x f32>, %layer: i32)
        -> (tensor<S x T x Hv x dv x dt>, tensor<slot_shape x f32>)

with conv_dim = 2 Hk dk + Hv dv and slot_shape = [streams, slots, n_gdn, Hv, dk, dv] (export/recurrent_state.py
gdn_slots). The function's second result is %slots itself, written in place by the dispatch (a tied
operand, as the attention ties its counter global): the state after row t of stream s lands in flat
slot row rows[s, 1] + t of layer %layer; the state before row 0 is read from flat row rows[s, 0]
(-1: zeros). Built with every_row=False, only the state after the last row is written, to flat row
rows[s, 1] (a prefill's blocks of up to 16 rows, each resuming from the one before). The first result is o in the model's layout [S, T, Hv, dv] (export/gdn.py
`GatedDeltaNet.forward`'s `o.transpose(1, 2).to(x.dtype)`). The rule, its fused inputs (key-head
repeat, l2norm, q scale, beta, g) and its numerics contract are in gdn_body.h. GPU archs only; the
host keeps IREE's lowering. No IREE import here: this module only writes text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from dflash_iree.arch import kernel_archs
from dflash_iree.errors import DFlashError

from ..hal import OBJECTS_DIR, executable_source, f32_bits, gpu_object, pipeline_layout, search_flags  # noqa: F401

CUDA_ARCHS = kernel_archs("gdn", "cuda")
HIP_ARCHS = kernel_archs("gdn", "hip")
ARCHS = CUDA_ARCHS + HIP_ARCHS
THREADS = 128  # gdn_body.h GD_T
COLUMNS = 8  # GD_COLS: state columns per workgroup
MAX_T = 16  # GD_TMAX
MAX_DK = 128  # GD_DMAX
EPS = 1e-6  # export/gdn.py l2norm
DTYPES = {"f32": 0, "bf16": 1}


@dataclass(frozen=True)
class GdnDispatch:
    """The spliceable GDN step for one shape and arch.

    mlir:    module-body text: the executable `@{name}_exe` and the function `@{name}` (module docstring).
    flags:   what `iree-compile` needs besides the device target (the object search path).
    objects: the object files the text refers to.
    """

    S: int
    T: int
    Hk: int
    Hv: int
    dk: int
    dv: int
    slot_shape: tuple
    dtype: str
    arch: str
    name: str
    mlir: str
    flags: list[str] = field(default_factory=list)
    objects: list[Path] = field(default_factory=list)

    @property
    def func(self) -> str:
        return self.name

    @property
    def conv_dim(self) -> int:
        return 2 * self.Hk * self.dk + self.Hv * self.dv

    @property
    def grid(self) -> tuple[int, int, int]:
        return math.ceil(self.dv / COLUMNS), self.Hv, self.S


def object_file(arch: str) -> Path:
    """Committed object for ARCH: PTX for sm_*, a code object for gfx*. Raises DFlashError for another arch."""
    return gpu_object("gdn", arch, ARCHS, "Gated DeltaNet step")


def why_unsupported(S: int, T: int, Hk: int, Hv: int, dk: int, dv: int, slot_shape, dtype: str, arch: str,
                    every_row: bool = True) -> str | None:
    """None when the kernel takes this shape on ARCH (every_row: a slot written per row), else the reason it does not."""
    if arch not in ARCHS:
        return f"arch {arch} has no Gated DeltaNet step kernel"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not f32 or bf16"
    if not 1 <= T <= MAX_T:
        return f"T={T} rows is outside 1..{MAX_T}"
    if dk % 4 or not 4 <= dk <= MAX_DK:
        return f"dk={dk} is not a multiple of 4 up to {MAX_DK}"
    if Hk < 1 or Hv % Hk:
        return f"Hv={Hv} value heads are not a multiple of Hk={Hk} key heads"
    if len(slot_shape) != 6 or tuple(slot_shape[3:]) != (Hv, dk, dv):
        return f"slots {tuple(slot_shape)} are not [streams, slots, n_gdn, {Hv}, {dk}, {dv}]"
    if every_row and T > slot_shape[1]:
        return f"T={T} rows are more than the {slot_shape[1]} slots"
    if math.prod(slot_shape) >= 2 ** 40:
        return "slots too large"
    return None


def gdn_dispatch(S: int, T: int, Hk: int, Hv: int, dk: int, dv: int, slot_shape, dtype: str, arch: str, *,
                 name: str = "dflash_gdn", every_row: bool = True) -> GdnDispatch:
    """Builds the spliceable GDN step for S streams of T rows, Hk key heads, Hv value heads, head dims
    dk, dv, state slots of SLOT_SHAPE (f32), inputs and o in DTYPE ("f32" or "bf16"), on ARCH
    (sm_80/86/89, gfx1030/1100/1151/1201), writing the state after every row (every_row) or after the
    last only (module docstring). name: symbol prefix (every symbol starts with it).
    Raises DFlashError for a shape or arch the kernel does not take, or a missing object."""
    slot_shape = tuple(int(v) for v in slot_shape)
    why = why_unsupported(S, T, Hk, Hv, dk, dv, slot_shape, dtype, arch, every_row)
    if why:
        raise DFlashError(f"GDN step S={S} T={T} Hk={Hk} Hv={Hv} dk={dk} dv={dv} {dtype} on {arch}: {why}")
    obj = object_file(arch)
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: run `make kernels` to build the kernel objects")
    dt = dtype
    conv = 2 * Hk * dk + Hv * dv
    m_t, g_t, h_t = f"tensor<{S}x{T}x{conv}x{dt}>", f"tensor<{S}x{T}x{Hv}x{dt}>", f"tensor<{Hv}x{dt}>"
    r_t, o_t = f"tensor<{S}x2xi32>", f"tensor<{S}x{T}x{Hv}x{dv}x{dt}>"
    s_t = f"tensor<{'x'.join(map(str, slot_shape))}xf32>"
    text = executable_source(f"{name}_exe", "dflash_gdn", arch, obj.name, pipeline_layout(11, 6, 8), THREADS, 3)
    consts = {"T": T, "Hk": Hk, "Hv": Hv, "dk": dk, "dv": dv, "n": slot_shape[2], "dt": DTYPES[dtype],
              "eps": f32_bits(EPS, signed=True), "scale": f32_bits(dk ** -0.5, signed=True), "every": int(every_row)}
    gx, gy, gz = math.ceil(dv / COLUMNS), Hv, S
    text += (f"util.func private @{name}(%mixed: {m_t}, %b: {g_t}, %a: {g_t}, %alog: {h_t}, %dtb: {h_t}, "
             f"%rows: {r_t}, %slots: {s_t}, %layer: i32) -> ({o_t}, {s_t}) {{\n"
             + "".join(f"    %c{k} = arith.constant {v} : i32\n" for k, v in consts.items())
             + f"    %gx = arith.constant {gx} : index\n    %gy = arith.constant {gy} : index\n"
             f"    %gz = arith.constant {gz} : index\n"
             f"    %r:2 = flow.dispatch @{name}_exe::@dflash_gdn[%gx, %gy, %gz]"
             f"(%cT, %cHk, %cHv, %cdk, %cdv, %layer, %cn, %cdt, %ceps, %cscale, %cevery, %mixed, %b, %a, %alog, %dtb, %rows, %slots)"
             f" : (i32, i32, i32, i32, i32, i32, i32, i32, i32, i32, i32, {m_t}, {g_t}, {g_t}, {h_t}, {h_t}, {r_t}, {s_t})"
             f" -> (%slots, {o_t})\n"
             f"    util.return %r#1, %r#0 : {o_t}, {s_t}\n}}\n")
    return GdnDispatch(S=S, T=T, Hk=Hk, Hv=Hv, dk=dk, dv=dv, slot_shape=slot_shape, dtype=dtype, arch=arch, name=name,
                       mlir=text, flags=search_flags(), objects=[obj])


def standalone_module(d: GdnDispatch) -> str:
    """A whole module around D with a public `gdn(mixed, b, a, A_log, dt_bias, rows, layer) -> o` that runs
    the step on a module global of slots (zeros at load) and `get_slots() -> slots`, `set_slots(slots)` to
    read and write that global (`get_slots`) (benchmarks, checks)."""
    dt = d.dtype
    m_t, g_t, h_t = f"tensor<{d.S}x{d.T}x{d.conv_dim}x{dt}>", f"tensor<{d.S}x{d.T}x{d.Hv}x{dt}>", f"tensor<{d.Hv}x{dt}>"
    r_t, o_t = f"tensor<{d.S}x2xi32>", f"tensor<{d.S}x{d.T}x{d.Hv}x{d.dv}x{dt}>"
    s_t = f"tensor<{'x'.join(map(str, d.slot_shape))}xf32>"
    return (f"module @gdn_check {{\n{d.mlir}"
            f"util.global private mutable @state = dense<0.0> : {s_t}\n"
            f"util.func public @gdn(%mixed: {m_t}, %b: {g_t}, %a: {g_t}, %alog: {h_t}, %dtb: {h_t}, %rows: {r_t},"
            f" %layer: i32) -> {o_t} {{\n"
            f"    %s0 = util.global.load @state : {s_t}\n"
            f"    %o, %s1 = util.call @{d.func}(%mixed, %b, %a, %alog, %dtb, %rows, %s0, %layer)"
            f" : ({m_t}, {g_t}, {g_t}, {h_t}, {h_t}, {r_t}, {s_t}, i32) -> ({o_t}, {s_t})\n"
            f"    util.global.store %s1, @state : {s_t}\n"
            f"    util.return %o : {o_t}\n}}\n"
            f"util.func public @get_slots() -> {s_t} {{\n"
            f"    %s = util.global.load @state : {s_t}\n    util.return %s : {s_t}\n}}\n"
            f"util.func public @set_slots(%s: {s_t}) {{\n"
            f"    util.global.store %s, @state : {s_t}\n    util.return\n}}\n}}\n")
