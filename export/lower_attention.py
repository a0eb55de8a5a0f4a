"""Lowering of `dflash::block_attention` (export/ops.py) onto the block attention of kernels/attention/,
or onto IREE's attention (the op's reference operand: `attend`'s fused attention op, or the host's
`attend_matmul`).

An op takes the kernel when the arch has it (dflash_iree/arch.py), q [S, T, Hq, hd] and the
cache [S, L, 2, C, Hkv * hd] are bf16 with static shapes, the mask is [S, 1, R, N] with R = T * Hq / Hkv
query rows and a dynamic key count N, min_rows <= R <= 128, the gate (if any: the Qwen3.5 family's
gated attention, export/qwen35.py) is bf16 [S, T, Hq * hd], and the kernel takes the shape
(`why_unsupported`: head_dim up to 128, or up to 256 gated). A gated op's gate becomes the kernel's
extra operand and the kernel applies it in its output step with eager bf16's roundings
(kernels/attention/attention_body.h, "Output gate"); its function is named with `_gated`. The layer is a constant, or a runtime `!torch.int` (a one-stream call of
export/stream_entry_points.py: slot * L + l over the cache viewed as one stream of S * L layers).
The kernel reads the whole cache in place with the layer as an argument, takes q and gives the result in
the model's token-major layout (`g` = Hq / Hkv), and is named
`dflash_attention_{S}x{Hkv}x{R}x{hd}_{L}x{C}[_s{scale bits}]_g{g}[_gated]`.
Decode (R = g rows) takes it too on an arch that has the skinny GEMM, so that decode and verify
attend in one reduction order (the kernel's numerics contract: a row does not depend on R or on the
keys read) and the whole step is row-invariant with export/lower_linear.py's rules. An arch without
the GEMM cannot be row-invariant (IREE's matmuls are not), so its decode keeps IREE's attention op,
faster at so few rows (ATTENTION_MIN_ROWS). The same holds for gated ops: a hybrid target's decode
(R = g) and verify (R = B * g) both take the kernel on an arch with the GEMM. Prefill (a dynamic T) and the drafter's attention (over
[context, block], not the cache: no named op) stay IREE's.
"""

from __future__ import annotations

import re

from dflash_iree.errors import DFlashError

from .mlir import (add_functions, builtin_type, constant_float, constant_int, emit_call, find_ops, i32_constant,
                   i32_of_int, is_constant_int, is_none, replace_with_values)
from .lowered import Lowered, has_kernel
from .ops import ATTENTION_OP

# On an arch without the skinny GEMM, query rows below this (decode: R = the g query heads of a KV
# group) keep IREE's fused attention op:
# at the 8B shapes on the H200 it costs 10 µs a layer at 4 rows, where the kernel costs 14 µs, and
# 138 µs at 64 rows, where the kernel costs 26 (bench/attention_bench.py, experiments/2026-11-30-block-attention/).
ATTENTION_MIN_ROWS = 8


def _why_not(op, arch: str, min_rows: int):
    """(None, shape) when OP takes the kernel on ARCH, else (the reason it does not, None)."""
    from dflash_iree.kernels.attention import why_unsupported

    q, cache, layer, mask, ref, gate, scale = op.operands
    if not has_kernel(arch, "attention"):
        return f"arch {arch} has no block-attention kernel", None
    qm = re.fullmatch(r"tensor<(\d+)x(\d+)x(\d+)x(\d+)xbf16>", builtin_type(q.type))
    cm = re.fullmatch(r"tensor<(\d+)x(\d+)x2x(\d+)x(\d+)xbf16>", builtin_type(cache.type))
    if not qm or not cm:
        return f"q {q.type} or cache {cache.type} is not bf16 with static shapes", None
    S, T, Hq, D = (int(v) for v in qm.groups())
    L, C, width = int(cm[2]), int(cm[3]), int(cm[4])
    if int(cm[1]) != S or width % D or Hq % (width // D):
        return f"q {q.type} does not fit cache {cache.type}", None
    Hkv = width // D
    R = T * (Hq // Hkv)
    if R < min_rows:
        return f"R={R} query rows under {min_rows}", None
    if builtin_type(mask.type) != f"tensor<{S}x1x{R}x?xi1>":
        return f"mask {mask.type} is not [S, 1, R, N] with a dynamic N", None
    gated = not is_none(gate)
    if gated and builtin_type(gate.type) != f"tensor<{S}x{T}x{Hq * D}xbf16>":
        return f"gate {gate.type} is not bf16 [S, T, Hq * hd] of q {q.type}", None
    li = None  # a runtime layer (a one-stream call's slot * L + l, bounded by the export's dim range)
    if is_constant_int(layer):
        li = constant_int(layer)
        if not 0 <= li < L:
            raise DFlashError(f"splice: {ATTENTION_OP} reads layer {li} of a cache of {L} layers")
    why = why_unsupported(S, Hkv, R, D, L, C, arch, gated)
    if why:
        return why, None
    sc = None if is_none(scale) else constant_float(scale)
    return None, (S, Hkv, R, D, L, C, Hq // Hkv, li, sc, gated)


def lower_attention(module, arch: str, min_rows: int | None = None):
    """Lower every `dflash::block_attention` of MODULE for ARCH (module docstring).

    min_rows: the query-row floor; None: 1 on an arch with the skinny GEMM (row invariance), else
    ATTENTION_MIN_ROWS (benches pass ATTENTION_MIN_ROWS for the rules before).
    Returns None when MODULE has no such op, else a `Lowered` (export/splice.py) whose entries are,
    per kernel shape, S, Hkv, R, head_dim, g and `ops` (calls), and `gated: True` for gated ops; and
    per op left to IREE, the reason.

    Raises:
        DFlashError: a constant layer outside the cache, a non-constant scale, or what
            `attention_dispatch` refuses (a missing object).
    """
    from dflash_iree.kernels.attention import attention_dispatch, f32_bits

    ops = find_ops(module, "torch.operator", ATTENTION_OP)
    if not ops:
        return None
    if min_rows is None:
        min_rows = 1 if has_kernel(arch, "gemm") else ATTENTION_MIN_ROWS
    out = Lowered(rule={"kernel": has_kernel(arch, "attention"), "min_rows": min_rows})
    counts: dict[tuple, int] = {}
    for op in ops:
        why, shape = _why_not(op, arch, min_rows)
        ref = op.operands[4]
        if why:
            out.iree[why] = out.iree.get(why, 0) + 1
            replace_with_values(op, [ref])
            continue
        S, Hkv, R, D, L, C, g, layer, sc, gated = shape
        bits = "" if sc is None else f"_s{f32_bits(sc):08x}"  # one function per f32 scale
        name = f"dflash_attention_{S}x{Hkv}x{R}x{D}_{L}x{C}{bits}_g{g}{'_gated' if gated else ''}"
        d = attention_dispatch(S, Hkv, R, D, L, C, arch, name=name, scale=sc, g=g, gated=gated)
        add_functions(module, d.mlir)
        q, cache, mask, gate = op.operands[0], op.operands[1], op.operands[3], op.operands[5]
        li = i32_of_int(op, op.operands[2]) if layer is None else i32_constant(op, layer)
        got = emit_call(op, name, [q, cache, mask, *([gate] if gated else []), li], [builtin_type(ref.type)],
                        [ref.type])
        replace_with_values(op, got)
        counts[(S, Hkv, R, D, g, gated)] = counts.get((S, Hkv, R, D, g, gated), 0) + 1
        out.flags += [f for f in d.flags if f not in out.flags]
    out.entries = [{"S": S, "Hkv": Hkv, "R": R, "head_dim": D, "ops": c, "g": g, **({"gated": True} if gated else {})}
                   for (S, Hkv, R, D, g, gated), c in sorted(counts.items())]
    return out
