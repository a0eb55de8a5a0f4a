"""Lowering of `dflash::head_norm_rope` (export/ops.py) onto the head norm + rope dispatch of kernels/norm_rope/.

Every op becomes one dispatch, named `dflash_norm_rope_{S}x{T}x{H}x{hd}_{dtype}_{eps bits}` (T "D"
when dynamic); a layer's q and k ops (the same cos and sin) become one, `..._{S}x{T}x{Hq}_{Hk}x{hd}_...`.
The op has no reference operand: only the GPU form exports it and every GPU arch has the kernel, so
an arch without it (the host) is refused, as is a zero-centred norm or a partial rotary (no kernel yet).
"""

from __future__ import annotations

from dflash_iree.errors import DFlashError

from .mlir import add_functions, builtin_type, constant_bool, constant_float, constant_int, find_ops, replace_with_call
from .lowered import Lowered, has_kernel
from .ops import NORM_ROPE_OP


def _dims(x) -> list[str]:
    return builtin_type(x.type)[len("tensor<"):-1].split("x")


def _parse_norm_rope(op):
    """(S, T, H, hd, dtype, eps) of a head norm + rope op; T None when dynamic. Raises DFlashError."""
    x, weight, cos, sin, eps, zero_centered, rotary_dim = op.operands
    dims = _dims(x)
    if len(dims) != 5 or "?" in (dims[0], dims[2], dims[3]):
        raise DFlashError(f"splice: {NORM_ROPE_OP} takes x [S, T, H, hd] with static S, H, hd, got {x.type}")
    if constant_bool(zero_centered) or constant_int(rotary_dim) not in (0, int(dims[3])):
        raise DFlashError(f"splice: {NORM_ROPE_OP} with a zero-centred norm or a partial rotary has no kernel "
                          "yet, and the op no reference to fall back on: export it op by op (export/qwen3.py)")
    return int(dims[0]), None if dims[1] == "?" else int(dims[1]), int(dims[2]), int(dims[3]), dims[4], constant_float(eps)


def _norm_rope_pairs(ops) -> list[list]:
    """The ops in runs of one or two: two when they stand in one block, take the same cos and sin
    (a layer's q and k: the same positions) and the same S, T, hd, dtype and eps, with nothing between
    them that uses the first one's result but its shape annotations, so that one call where the
    second stood can take both. Moves those annotations after the second op, in the module.
    The positions are read once per block: only annotations of a paired op move, and none is read again.

    Raises:
        DFlashError: an op whose x is not [S, T, H, hd] with static S, H, hd, or whose eps is not a constant.
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
            sa, sb = _parse_norm_rope(a), _parse_norm_rope(b)
            fits = (sa[:2] + sa[3:]) == (sb[:2] + sb[3:])
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
    """Replace every `torch.dflash.head_norm_rope` op (x [S, T, H, hd], weight [hd], cos, sin [S, T, hd],
    eps) with the head norm + rope dispatch for ARCH (kernels/norm_rope/), one function per shape,
    dtype and eps, named `dflash_norm_rope_{S}x{T}x{H}x{hd}_{dtype}_{eps bits}` (T: "D" when dynamic).
    With PAIRS (the default), a layer's q and k ops (`_norm_rope_pairs`: the same position tables)
    become one dispatch, `dflash_norm_rope_{S}x{T}x{H}_{Hk}x{hd}_{dtype}_{eps bits}`, one launch
    less a layer and step.

    Returns None when there was no such op, else a `Lowered` (export/splice.py) whose entries are
    (S, T, H, head_dim, dtype, count) per shape (H a list [H, Hk] for a pair).

    Raises:
        DFlashError: operands of another rank or of mixed dtypes, eps not a constant, or what
            `norm_rope_dispatch` refuses (an arch without the kernel, such as host, an odd head_dim).
    """
    from dflash_iree.kernels.attention import f32_bits
    from dflash_iree.kernels.norm_rope import norm_rope_dispatch

    ops = find_ops(module, "torch.operator", NORM_ROPE_OP)
    if not ops:
        return None
    out = Lowered(rule={"kernel": has_kernel(arch, "norm_rope"), "pairs": pairs})
    counts: dict[tuple, int] = {}
    for run in _norm_rope_pairs(ops) if pairs else [[op] for op in ops]:
        S, T, H, D, dtype, e = _parse_norm_rope(run[0])
        Hk = _parse_norm_rope(run[1])[2] if len(run) == 2 else None
        heads = f"{H}" if Hk is None else f"{H}_{Hk}"
        name = f"dflash_norm_rope_{S}x{'D' if T is None else T}x{heads}x{D}_{dtype}_{f32_bits(e):08x}"
        d = norm_rope_dispatch(S, T, H, D, dtype, e, arch, name=name, Hk=Hk)
        operands = [v for op in run for v in op.operands[:2]] + list(run[0].operands[2:4])
        got = [builtin_type(v.type) for v in operands]
        if got != d.operand_types:
            raise DFlashError(f"splice: {NORM_ROPE_OP} operands {', '.join(got)} are not x [S, T, H, hd], "
                              f"weight [hd], cos and sin [S, T, hd] of one dtype")
        add_functions(module, d.mlir)
        replace_with_call(run, d.func, operands, d.result_types, at_last=True)
        out.flags += [f for f in d.flags if f not in out.flags]
        key = (S, T, H if Hk is None else (H, Hk), D, dtype)
        counts[key] = counts.get(key, 0) + 1
    out.entries = [{"S": S, "T": T, "H": H if isinstance(H, int) else list(H), "head_dim": D, "dtype": dt, "ops": c}
                   for (S, T, H, D, dt), c in sorted(counts.items(), key=lambda kv: str(kv[0]))]
    return out
