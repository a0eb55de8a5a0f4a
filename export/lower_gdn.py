"""Lowering of `dflash::gated_delta_rule` (export/ops.py) onto the Gated DeltaNet step of kernels/gdn/,
or onto IREE's lowering of the eager rule (the op's reference operands).

The export threads the recurrent-state slots through a call's GDN layers as a value (export/qwen35.py
`Qwen35.step`): op l takes the slots op l - 1 returned. The kernel writes layer l's rows into them
in place (a tied operand), so no stack, transpose or scatter of the states remains, and the slots
are stored into their global once. The references do not follow the same chain: every op's
`ref_slots` is its slots input except the last GDN layer's, which carries every layer's states (the
eager write). So the ops of one function go to the kernel all together or to IREE all together, and
so do the module's functions: decode, verify and draft must run one rule (the kernel's and IREE's
sum in other orders and with other exp and log), or decode's rows would not equal verify's and
drafted != plain. (A prefill's ops, blocks of up to 16 rows keeping their last state only, follow
the same rule; its rows are not compared with decode's.) When the arch has no kernel or one op's shape is refused (a verify of more than
16 rows: a drafter trained for a larger block), every op of the module becomes its references,
which is exactly the module the export would be without the op.

An op takes the kernel when the arch has it (dflash_iree/arch.py), its tensors have static shapes,
the model dtype is f32 or bf16, the layer and key-head count are constants and the kernel takes the
shape (`why_unsupported`: T <= 16, dk a multiple of 4 up to 128). The kernel's function is named
`dflash_gdn_{S}x{T}x{Hk}x{Hv}x{dk}x{dv}_{dtype}_{slots shape}`, with `_last` for a prefill block's
op (every_row False: the last row's state only).
"""

from __future__ import annotations

import re

from .lowered import Lowered, has_kernel
from .mlir import (add_functions, builtin_type, constant_bool, constant_int, emit_call, find_ops, i32_constant,
                   is_constant_bool, is_constant_int, replace_with_values)
from .ops import GDN_OP

_DTYPES = {"f32": "f32", "bf16": "bf16"}


def _dims(value) -> list[int] | None:
    m = re.fullmatch(r"tensor<((?:\d+x)+)(\w+)>", builtin_type(value.type))
    return [int(v) for v in m[1].split("x")[:-1]] if m else None


def _why_not(op, arch: str):
    """(None, shape) when OP takes the kernel on ARCH, else (the reason it does not, None)."""
    from dflash_iree.kernels.gdn import why_unsupported

    mixed, b, a, alog, dtb, rows, slots, layer, heads, every_row, ref_o, ref_slots = op.operands
    if not has_kernel(arch, "gdn"):
        return f"arch {arch} has no Gated DeltaNet step kernel", None
    if not is_constant_int(layer) or not is_constant_int(heads) or not is_constant_bool(every_row):
        return "a runtime layer, key-head count or every_row", None
    dm, ds, do = _dims(mixed), _dims(slots), _dims(ref_o)
    if dm is None or ds is None or do is None or _dims(b) is None:
        return f"mixed {mixed.type}, slots {slots.type} or o {ref_o.type} has a dynamic shape", None
    dtype = builtin_type(mixed.type).rsplit("x", 1)[1][:-1]
    if dtype not in _DTYPES or not builtin_type(slots.type).endswith("xf32>"):
        return f"dtype {dtype} (or slots {slots.type}) has no kernel", None
    S, T, conv = dm
    Hk = constant_int(heads)
    _, _, n, Hv, dk, dv = ds
    if conv != 2 * Hk * dk + Hv * dv or do != [S, T, Hv, dv]:
        return f"mixed {mixed.type} does not fit slots {slots.type}", None
    li = constant_int(layer)
    if not 0 <= li < n:
        return f"layer {li} outside {n} GDN layers", None
    every = constant_bool(every_row)
    why = why_unsupported(S, T, Hk, Hv, dk, dv, tuple(ds), dtype, arch, every)
    if why:
        return why, None
    return None, (S, T, Hk, Hv, dk, dv, tuple(ds), dtype, li, every)


def lower_gdn(module, arch: str):
    """Lower every `dflash::gated_delta_rule` of MODULE for ARCH (module docstring).

    Returns None when MODULE has no such op, else a `Lowered` (export/splice.py) whose entries are,
    per kernel shape, S, T, Hk, Hv, dk, dv, dtype and `ops` (calls); and per op left to IREE, the
    reason (the first refused op's, for every op of the module).
    Raises DFlashError from `gdn_dispatch` (a missing object).
    """
    from dflash_iree.kernels.gdn import gdn_dispatch

    ops = find_ops(module, "torch.operator", GDN_OP)
    if not ops:
        return None
    out = Lowered(rule={"kernel": has_kernel(arch, "gdn")})
    counts: dict[tuple, int] = {}
    checked = [_why_not(op, arch) for op in ops]
    why = next((w for w, _ in checked if w), None)
    for op, (_, shape) in zip(ops, checked):
        ref_o, ref_slots = op.operands[10], op.operands[11]
        if why:
            out.iree[why] = out.iree.get(why, 0) + 1
            replace_with_values(op, [ref_o, ref_slots])
            continue
        S, T, Hk, Hv, dk, dv, ds, dtype, li, every = shape
        name = f"dflash_gdn_{S}x{T}x{Hk}x{Hv}x{dk}x{dv}_{dtype}_{'x'.join(map(str, ds))}{'' if every else '_last'}"
        d = gdn_dispatch(S, T, Hk, Hv, dk, dv, ds, dtype, arch, name=name, every_row=every)
        add_functions(module, d.mlir)  # once per name: a symbol the module has is kept
        operands = list(op.operands[:7]) + [i32_constant(op, li)]
        got = emit_call(op, name, operands, [builtin_type(ref_o.type), builtin_type(ref_slots.type)],
                        [ref_o.type, ref_slots.type])
        replace_with_values(op, got)
        key = (S, T, Hk, Hv, dk, dv, dtype, every)
        counts[key] = counts.get(key, 0) + 1
        out.flags += [f for f in d.flags if f not in out.flags]
    out.entries = [{"S": S, "T": T, "Hk": Hk, "Hv": Hv, "dk": dk, "dv": dv, "dtype": dt, "every_row": e, "ops": c}
                   for (S, T, Hk, Hv, dk, dv, dt, e), c in sorted(counts.items())]
    return out
