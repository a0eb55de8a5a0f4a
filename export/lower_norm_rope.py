"""Lowering of `dflash::head_norm_rope` (export/ops.py) onto the head norm + rope dispatch of kernels/norm_rope/.

Every op becomes one dispatch, named `dflash_norm_rope_{S}x{T}x{H}x{hd}_{dtype}_{eps bits}` (T "D"
when dynamic); a layer's q and k ops (the same cos and sin) become one, `..._{S}x{T}x{Hq}_{Hk}x{hd}_...`.
Qwen3.5's variants (export/qwen35.py `GatedAttention`) take the kernel on every GPU arch as Qwen3's
ops do, through its `_v` entry points: a zero-centred norm (name suffix `_zc`), a partial rotary of
R dims (`_r{R}`), and an x wider than the head, whose first hd values a head are read in place
(`_s{X}`, `_s{Xq}_{Xk}` for a pair: q inside q_proj's [query, gate] heads, X = 2 hd).
The op has no reference operand: only the GPU form exports it and every GPU arch has the kernel, so
an arch without it (the host) is refused.

`dflash::norm_rope_kv_write` (a Qwen3 layer's q and k with the KV cache write, export/qwen3.py
`Attention.qkv_written`) becomes one dispatch too, `dflash_norm_rope_kv_{S}x{T}x{Hq}_{Hk}x{hd}_{dtype}_{eps
bits}_c{cache dims}`, that writes k's result and v into the cache in place; its references are dropped. Every GPU
arch has it, as the pair's; the host is refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_iree.errors import DFlashError

from .mlir import (add_functions, builtin_type, constant_bool, constant_float, constant_int, emit_call, find_ops,
                   replace_with_call, replace_with_values)
from .lowered import Lowered, has_kernel
from .ops import NORM_ROPE_KV_OP, NORM_ROPE_OP


def _dims(x) -> list[str]:
    return builtin_type(x.type)[len("tensor<"):-1].split("x")


@dataclass(frozen=True)
class _Op:
    """One head norm + rope op: x [S, T, H, X] (T None when dynamic), each head the first hd of its X
    values; a zero-centred norm or not; R rotated dims (hd: all)."""

    S: int
    T: int | None
    H: int
    X: int
    hd: int
    dtype: str
    eps: float
    zc: bool
    R: int

    @property
    def shared(self) -> tuple:
        """What the two ops of a pair must share (all but H and X)."""
        return self.S, self.T, self.hd, self.dtype, self.eps, self.zc, self.R


def _parse_norm_rope(op) -> _Op:
    """The shape and parameters of a head norm + rope op. Raises DFlashError for an x that is not
    [S, T, H, X] with static S, H, X, a weight that is not [hd] with hd <= X, or parameters that are
    not constants."""
    x, weight, cos, sin, eps, zero_centered, rotary_dim = op.operands
    dims, wdims = _dims(x), _dims(weight)
    if len(dims) != 5 or "?" in (dims[0], dims[2], dims[3]):
        raise DFlashError(f"splice: {NORM_ROPE_OP} takes x [S, T, H, hd] with static S, H, hd, got {x.type}")
    if len(wdims) != 2 or not wdims[0].isdigit() or int(wdims[0]) > int(dims[3]):
        raise DFlashError(f"splice: {NORM_ROPE_OP} takes a weight [hd] with hd at most x's last dim "
                          f"{dims[3]}, got {weight.type}")
    hd, R = int(wdims[0]), constant_int(rotary_dim)
    return _Op(int(dims[0]), None if dims[1] == "?" else int(dims[1]), int(dims[2]), int(dims[3]), hd, dims[4],
               constant_float(eps), constant_bool(zero_centered), hd if R == 0 else R)


def _norm_rope_pairs(ops) -> list[list]:
    """The ops in runs of one or two: two when they stand in one block, take the same cos and sin
    (a layer's q and k: the same positions) and the same S, T, hd, dtype and eps, with nothing between
    them that uses the first one's result but its shape annotations, so that one call where the
    second stood can take both. Moves those annotations after the second op, in the module.
    The positions are read once per block: only annotations of a paired op move, and none is read again.

    Raises:
        DFlashError: what `_parse_norm_rope` refuses.
    """
    order: dict = {}
    runs, left = [], list(ops)
    while left:
        a = left.pop(0)
        block = a.operation.block
        if block not in order:
            order[block] = {o.operation: i for i, o in enumerate(block.operations)}
        pos = order[block]
        b = next((o for o in left if o.operation.block == block and o.operands[2] == a.operands[2]
                  and o.operands[3] == a.operands[3]), None)
        if b is not None:
            fits = _parse_norm_rope(a).shared == _parse_norm_rope(b).shared
            at = pos[b.operation]
            early = [getattr(u.owner, "operation", u.owner) for r in a.results for u in r.uses]
            early = [o for o in early if pos.get(o, -1) <= at]  # b itself taking a's result: no pair
            if fits and all(o.name == "torch.bind_symbolic_shape" for o in early):
                for o in early:  # a shape annotation of q's result (dynamic T) follows the call
                    o.move_after(b.operation)
                left.remove(b)
                runs.append([a, b])
                continue
        runs.append([a])
    return runs


def lower_norm_rope(module, arch: str, pairs: bool = True):
    """Replace every `torch.dflash.head_norm_rope` op (x [S, T, H, X], weight [hd] with hd <= X, cos,
    sin [S, T, R], eps, zero_centered, rotary_dim R; export/ops.py) with the head norm + rope dispatch
    for ARCH (kernels/norm_rope/), one function per shape, dtype and parameters, named
    `dflash_norm_rope_{S}x{T}x{H}x{hd}_{dtype}_{eps bits}` (T: "D" when dynamic) plus the variants'
    suffixes (module docstring). With PAIRS (the default), a layer's q and k ops (`_norm_rope_pairs`:
    the same position tables) become one dispatch, `dflash_norm_rope_{S}x{T}x{H}_{Hk}x{hd}_...`, one
    launch less a layer and step. Every `dflash::norm_rope_kv_write` op becomes its own dispatch
    (`_lower_kv_write`; module docstring).

    Returns None when there was neither op, else a `Lowered` (export/splice.py) whose entries are
    (S, T, H, head_dim, dtype, count) per shape (H a list [H, Hk] for a pair), and for the variants
    also zero_centered, rotary_dim and head_stride (X; a list [Xq, Xk] for a pair); the KV-writing
    ops' entries have H [Hq, Hk] and kv_cache True.

    Raises:
        DFlashError: operands of another rank or of mixed dtypes, parameters not constants, or what
            `norm_rope_dispatch` refuses (an arch without the kernel, such as host, an odd head_dim
            or rotary_dim).
    """
    from dflash_iree.kernels.attention import f32_bits
    from dflash_iree.kernels.norm_rope import norm_rope_dispatch

    ops = find_ops(module, "torch.operator", NORM_ROPE_OP)
    kv_ops = find_ops(module, "torch.operator", NORM_ROPE_KV_OP)
    if not ops and not kv_ops:
        return None
    out = Lowered(rule={"kernel": has_kernel(arch, "norm_rope"), "pairs": pairs})
    counts: dict[tuple, int] = {}
    for op in kv_ops:
        _lower_kv_write(module, op, arch, out, counts)
    for run in _norm_rope_pairs(ops) if pairs else [[op] for op in ops]:
        q = _parse_norm_rope(run[0])
        k = _parse_norm_rope(run[1]) if len(run) == 2 else None
        S, T, H, D, dtype, e = q.S, q.T, q.H, q.hd, q.dtype, q.eps
        Hk = None if k is None else k.H
        strides = (q.X,) if k is None else (q.X, k.X)
        variant = q.zc or q.R != D or any(x != D for x in strides)
        heads = f"{H}" if Hk is None else f"{H}_{Hk}"
        name = f"dflash_norm_rope_{S}x{'D' if T is None else T}x{heads}x{D}_{dtype}_{f32_bits(e):08x}"
        if variant:
            name += ("_zc" if q.zc else "") + (f"_r{q.R}" if q.R != D else "")
            name += "" if all(x == D for x in strides) else "_s" + "_".join(map(str, strides))
        d = norm_rope_dispatch(S, T, H, D, dtype, e, arch, name=name, Hk=Hk, zero_centered=q.zc, rotary_dim=q.R,
                               x_stride=q.X, k_stride=None if k is None else k.X)
        operands = [v for op in run for v in op.operands[:2]] + list(run[0].operands[2:4])
        got = [builtin_type(v.type) for v in operands]
        if got != d.operand_types:
            raise DFlashError(f"splice: {NORM_ROPE_OP} operands {', '.join(got)} are not x [S, T, H, X], "
                              f"weight [hd], cos and sin [S, T, rotary_dim] of one dtype")
        add_functions(module, d.mlir)
        replace_with_call(run, d.func, operands, d.result_types, at_last=True)
        out.flags += [f for f in d.flags if f not in out.flags]
        key = (S, T, H if Hk is None else (H, Hk), D, dtype, (q.zc, q.R, strides) if variant else None)
        counts[key] = counts.get(key, 0) + 1
    out.entries = [{"S": S, "T": T, "H": H if isinstance(H, int) else list(H), "head_dim": D, "dtype": dt, "ops": c,
                    **({} if v is None else {"kv_cache": True} if v == "kv" else
                       {"zero_centered": v[0], "rotary_dim": v[1],
                        "head_stride": v[2][0] if len(v[2]) == 1 else list(v[2])})}
                   for (S, T, H, D, dt, v), c in sorted(counts.items(), key=lambda kv: str(kv[0]))]
    return out


def _lower_kv_write(module, op, arch: str, out: Lowered, counts: dict) -> None:
    """Replace one `dflash::norm_rope_kv_write` with its dispatch (module docstring), named by its shapes
    and the cache's (`_c{dims}`). Raises DFlashError for operands of other ranks, dtypes or shapes than
    q's (k and v [S, T, Hk, hd], the cache in q's dtype, rows int64 [S * 2T]), a cache of another row
    width, or what `norm_rope_kv_dispatch` refuses (an arch without the kernel)."""
    from dflash_iree.kernels.attention import f32_bits
    from dflash_iree.kernels.norm_rope import norm_rope_kv_dispatch

    q, wq, k, wk, cos, sin, eps, v, cache, rows, ref_q, ref_cache = op.operands
    qd, kd, vd, cd, rd = _dims(q), _dims(k), _dims(v), _dims(cache), _dims(rows)
    if (len(qd) != 5 or len(kd) != 5 or "?" in qd[:1] + qd[2:4] + kd[2:4] or "?" in cd or kd != vd
            or kd[:2] + kd[3:] != qd[:2] + qd[3:] or cd[-1] != qd[-1] or rd[-1] != "i64" or len(rd) != 2):
        raise DFlashError(f"splice: {NORM_ROPE_KV_OP} takes q [S, T, Hq, hd], k and v [S, T, Hkv, hd] with static S, "
                          f"heads and hd, a static cache of their dtype and int64 rows, got {q.type}, {k.type}, "
                          f"{v.type}, {cache.type}, {rows.type}")
    S, T, H, D, dtype = int(qd[0]), None if qd[1] == "?" else int(qd[1]), int(qd[2]), int(qd[3]), qd[4]
    Hk, e = int(kd[2]), constant_float(eps)
    name = (f"dflash_norm_rope_kv_{S}x{'D' if T is None else T}x{H}_{Hk}x{D}_{dtype}_{f32_bits(e):08x}"
            f"_c{'x'.join(cd[:-1])}")
    d = norm_rope_kv_dispatch(S, T, H, Hk, D, dtype, e, [int(c) for c in cd[:-1]], arch, name=name)
    operands = [q, wq, k, wk, cos, sin, v, rows, cache]
    add_functions(module, d.mlir)
    got = emit_call(op, d.func, operands, [builtin_type(ref_q.type), builtin_type(ref_cache.type)],
                    [ref_q.type, ref_cache.type])
    replace_with_values(op, got)
    out.flags += [f for f in d.flags if f not in out.flags]
    key = (S, T, (H, Hk), D, dtype, "kv")
    counts[key] = counts.get(key, 0) + 1
