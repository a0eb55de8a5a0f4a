"""Lowering of `dflash::topk_logprobs` (export/ops.py) onto the draft top-K dispatch of kernels/topk/.

Each (n, V, k) gets one `dflash_topk_{n}x{V}x{k}`; every arch has the kernel (the host a CPU object).
"""

from __future__ import annotations

from dflash_iree.errors import DFlashError

from .mlir import add_functions, builtin_type, constant_int, find_ops, replace_with_call, static_shape
from .lowered import Lowered, has_kernel
from .ops import TOPK_OP


def lower_topk(module, arch: str):
    """Replace every `torch.dflash.topk_logprobs` op with the draft top-K dispatch for ARCH.

    Each (n, V, k) gets one `util.func private @dflash_topk_{n}x{V}x{k}_op(tensor<nxVxf32>,
    tensor<f32>) -> (tensor<nxkxi32>, tensor<nxkxf32>)` that reads the temperature scalar and calls
    the dispatch's function (kernels/topk/ `topk_dispatch(..., name="dflash_topk_{n}x{V}x{k}")`).
    Returns None when there was no such op, else a `Lowered` (export/splice.py) whose entries are
    (n, V, K, count) per shape, and whose flags the dispatch needs (the object search path).

    Raises:
        DFlashError: a non-f32 or dynamic logits shape, k not a constant, or what `topk_dispatch`
            refuses (k outside 1..64, an arch without an object).
    """
    from dflash_iree.kernels.topk import topk_dispatch

    ops = find_ops(module, "torch.operator", TOPK_OP)
    if not ops:
        return None
    out = Lowered(rule={"kernel": has_kernel(arch, "topk")})
    counts: dict[tuple[int, int, int], int] = {}
    for op in ops:
        logits, temperature, k = op.operands
        n, V = static_shape(logits.type)
        if builtin_type(logits.type) != f"tensor<{n}x{V}xf32>" or builtin_type(temperature.type) != "tensor<f32>":
            raise DFlashError(f"splice: {TOPK_OP} takes f32 logits [n, V] and an f32 scalar temperature, "
                              f"got {logits.type} and {temperature.type}")
        K = constant_int(k)
        name = f"dflash_topk_{n}x{V}x{K}"
        d = topk_dispatch(n, V, K, arch, name=name)
        ids_t, lp_t = f"tensor<{n}x{K}xi32>", f"tensor<{n}x{K}xf32>"
        wrapper = f"""util.func private @{name}_op(%logits: tensor<{n}x{V}xf32>, %t: tensor<f32>) -> ({ids_t}, {lp_t}) {{
    %s = tensor.extract %t[] : tensor<f32>
    %r:2 = util.call @{d.func}(%logits, %s) : (tensor<{n}x{V}xf32>, f32) -> ({ids_t}, {lp_t})
    util.return %r#0, %r#1 : {ids_t}, {lp_t}
}}
"""
        add_functions(module, d.mlir + wrapper)
        replace_with_call(op, f"{name}_op", [logits, temperature], [ids_t, lp_t])
        out.flags += [f for f in d.flags if f not in out.flags]
        counts[(n, V, K)] = counts.get((n, V, K), 0) + 1
    out.entries = [{"n": n, "V": V, "K": K, "ops": c} for (n, V, K), c in sorted(counts.items())]
    return out
