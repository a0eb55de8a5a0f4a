"""Lowering of the linear named ops (`dflash::linear`, `linear_residual`, `linear_swiglu`, export/ops.py)
onto the skinny GEMM of kernels/gemm/, or onto IREE's matmul (the op's reference operand).

A weight takes the kernel when the arch has it (dflash_iree/arch.py) and x [..., K], the weight
[N, K] and the result are bf16 with a static M = prod(x's leading dims), 1 <= M <= 64, and a shape
the kernel takes (`why_unsupported`): every such weight at every M, decode's (M = 1) too, so that a
row's sums do not depend on how many rows the call computes (the kernel's numerics contract,
kernels/gemm/gemm_body.h): decode's logits row equals verify's, bit for bit, and drafted decoding
equals plain decoding (issue #24; bench/row_invariance_check.py checks it on a GPU). The taken
weights of one `linear` op go in runs of up to three (MAX_WEIGHTS) a dispatch, in the op's order
(a layer's q, k and v; the drafter's context k and v of all its layers); `linear_residual` and
`linear_swiglu` take the dispatch's epilogue ("residual", "swiglu"). Everything else becomes the
op's reference: IREE's own matmul, as if there were no named op.

Packed 4-bit weights (the op's scales and zeros, export/qwen3.py `_operands`) take the same kernel
in its 4-bit form (kernels/gemm `Q4`: MLX's biases "mlx", compressed-tensors' zero points "zp", or
none, "sym"), which dequantizes in registers; their bf16 scales and biases are required (the
format is the op's: all its weights alike). Where the kernel does not take them they stay IREE's
(the host); a GPU compile refuses that beforehand (export/compile.py).

The RMSNorm a `linear` or `linear_swiglu` op carries (its `norm`, `eps`: the layer's input_layernorm
before q, k and v, post_attention_layernorm before gate and up) goes with the GEMM: decode's one row
takes the GEMM entry point that normalizes x in its prologue (kernels/gemm `norm_fused`), so the norm
costs no dispatch of its own; other shapes (more rows, other groups) take the norm's own dispatch (`norm_dispatch`) then
the GEMM. Both compute a row's norm in one order (kernels/gemm/gemm_body.h gm_rms_rinv): the rows have
the same bits either way. A norm the kernel does not take, or an op with a weight left to IREE,
gives the whole op to IREE (its reference, the norm included).

`row_invariant=False` gives the rules before (benches and the A/B of docs/benchmarks.md): M = 1
keeps IREE's matvecs but for a layer's q, k and v, epilogues from M = GEMM_MIN_M, and a weight floor.
"""

from __future__ import annotations

import re

from dflash_iree.errors import DFlashError

from .mlir import (add_functions, builtin_type, constant_float, constant_int, emit_call, find_ops, is_none,
                   list_operands, op_name, replace_with_values, reshape_text)
from .lowered import Lowered, has_kernel
from .ops import LINEAR_OP, LINEAR_RESIDUAL_OP, LINEAR_SWIGLU_OP

# Row invariance's price and gain on the H200 (experiments/2026-12-03-gpu-row-invariance/): plain decoding
# at the Qwen3-8B shape 6.93 against 6.00 ms a step (the M = 1 kernels reach 0.70-0.79 of the copy
# bandwidth where IREE's matvecs reach 0.96, and the block attention takes 0.56 against 0.37 ms);
# verify and the DFlash round within noise; the demo pair faster (plain 1.11x, DFlash 1.13x).
# The rules before row invariance (row_invariant=False), kept for the side-by-side benches:
# M = 1 (decode) keeps IREE's own matvec for a lone weight and for gate + up: in IREE on the H200 it
# ran the 8B layer at 0.63 of the copy bandwidth against 0.51 for the custom dispatch
# (experiments/2026-11-30-skinny-gemm/), and grouping gate + up at M = 1 cost 0.5 ms more kernel time a step
# (the grouped gate+up 60 us against IREE's 2 x 25, which also fuses the SiLU product into the up
# matvec; experiments/2026-11-30-grouped-gemm/, `dec`). A layer's q, k and v (a group of
# exactly three) do take the grouped dispatch at M = 1: its kernel time is about IREE's three
# matvecs' (0.655 against 0.621 ms a decode step, experiments/2026-12-01-decode-dispatches/) and it is
# two launches fewer a layer. The exact mode decodes plainly through the verify graph (M = block),
# which takes the dispatch, so drafted == plain holds.
GEMM_M1_RUN = 3
GEMM_MIN_M = 2
# Below this a weight's bytes take under a microsecond at the H200's bandwidth, less than the few µs
# a custom dispatch costs in IREE, and IREE's own matmul fuses with its neighbours: on the demo pair
# (384-wide layers) the drafted arm ran 1849 tok/s with the floor against 1633 without
# (experiments/2026-11-30-one-call-rounds/). Every Qwen3-8B weight is above it.
GEMM_MIN_WEIGHT_BYTES = 4 << 20
LINEAR_OPS = (LINEAR_OP, LINEAR_RESIDUAL_OP, LINEAR_SWIGLU_OP)
_BF16_2D = re.compile(r"tensor<(\d+)x(\d+)xbf16>")
_I32_2D = re.compile(r"tensor<(\d+)x(\d+)xi32>")


def _rows(x) -> tuple[int | None, int | None, str, str | None]:
    """(M, K, builtin type, None) of x [..., K], or (None, None, builtin type, why the kernel cannot
    take it): x not bf16, no rows dim, or a dynamic dim (prefill's T rows of a dense target)."""
    t = builtin_type(x.type)
    dims = t[len("tensor<"):-1].split("x")
    if dims[-1] != "bf16":
        return None, None, t, f"x {t} is not bf16"
    if len(dims) < 3:
        return None, None, t, f"x {t} has no rows dim"
    if "?" in dims[:-1]:
        return None, None, t, f"x {t} has dynamic rows"
    m = 1
    for d in dims[:-2]:
        m *= int(d)
    return m, int(dims[-2]), t, None


def _weight_ok(w, M: int | None, K: int | None, arch: str, min_weight_bytes: int, quant=None) -> tuple[int, str | None]:
    """(N, None) when weight W [N, K] (QUANT: packed int32 [N, K / 8]) takes the kernel at M rows, else
    (N or 0, the reason it does not)."""
    from dflash_iree.kernels.gemm import MAX_M, why_unsupported

    m = (_BF16_2D if quant is None else _I32_2D).fullmatch(builtin_type(w.type))
    if not m or M is None or int(m[2]) * (1 if quant is None else 8) != K:
        return 0, f"weight not {'bf16 [N, K]' if quant is None else 'packed i32 [N, K / 8]'} with x's K = {K}"
    N = int(m[1])
    if not 1 <= M <= MAX_M:
        return N, f"M={M} rows outside 1..{MAX_M}"
    if 2 * N * K < min_weight_bytes:
        return N, f"weight under {min_weight_bytes} bytes"
    return N, why_unsupported(M, N, K, arch, quant)


def _quant(rest) -> tuple[object, list, list, str | None]:
    """(the Q4 format or None, scales, zeros, a reason the kernel cannot take them or None) of a linear
    op's trailing operands (scales, zeros, group_size)."""
    from dflash_iree.kernels.gemm import Q4

    scales, zeros = list_operands(rest[0]), list_operands(rest[1])
    if not scales:
        return None, [], [], None
    kinds = {builtin_type(t.type).rsplit("x", 1)[-1][:-1] for t in scales}
    fmt = "sym" if not zeros else "mlx" if builtin_type(zeros[0].type).endswith("xbf16>") else "zp"
    why = None if kinds == {"bf16"} else f"4-bit scales in {'/'.join(sorted(kinds))}, not bf16"
    return Q4(fmt, constant_int(rest[2])), scales, zeros, why


def _gemm_function(M: int, Ns: tuple, K: int, arch: str, x_t: str, out_ts: list[str], epilogue: str | None,
                   module, quant=None, norm: float | None = None) -> tuple[str, object]:
    """Add the kernel for (M, Ns, K[, epilogue][, quant][, norm]) and a wrapper taking x_t (with NORM, an
    RMSNorm's eps: and the norm's weight [K] after it) and giving out_ts; returns (the wrapper's name,
    the GemmDispatch)."""
    from dflash_iree.kernels.gemm import gemm_dispatch, norm_dispatch, norm_fused, weight_types
    from dflash_iree.kernels.hal import f32_bits

    name = f"dflash_gemm_{M}x{'_'.join(map(str, Ns))}x{K}" + (f"_q4{quant.fmt}{quant.group}" if quant else "")
    fused = norm is not None and norm_fused(M, len(Ns), epilogue, quant)
    if fused:
        name += f"_norm{f32_bits(norm)}"
    if epilogue:
        shape = out_ts[0][len("tensor<"):-1].split("x")[:-1]
        name += f"_{epilogue}_{'x'.join(shape)}"
        d = gemm_dispatch(M, Ns, K, arch, name=name, epilogue=epilogue, out_shape=tuple(map(int, shape)), quant=quant,
                          norm=norm if fused else None)
    else:
        d = gemm_dispatch(M, Ns, K, arch, name=name, quant=quant, norm=norm if fused else None)
    flat = f"tensor<{M}x{K}xbf16>"
    if norm is None and x_t == flat and (epilogue or out_ts == [f"tensor<{M}x{n}xbf16>" for n in Ns]):
        add_functions(module, d.mlir)
        return name, d
    w_ts = weight_types(Ns, K, quant)
    nw_t = f"tensor<{K}xbf16>"
    ins = (([f"%nw: {nw_t}"] if norm is not None else []) + [f"%w{i}: {t}" for i, t in enumerate(w_ts)]
           + ([f"%r: {out_ts[0]}"] if epilogue == "residual" else []))
    line, xv = reshape_text("%x", x_t, flat)
    body = line
    d_mlir = d.mlir
    if norm is not None and not fused:  # the norm's own dispatch, then the GEMM on its rows
        nd = f"dflash_rms_norm_{M}x{K}_{f32_bits(norm)}"
        d_mlir = norm_dispatch(M, K, norm, arch, name=nd) + d_mlir
        body += f"    %xn = util.call @{nd}({xv}, %nw) : ({flat}, {nw_t}) -> {flat}\n"
        xv = "%xn"
    args = ([xv] + (["%nw"] if fused else []) + [f"%w{i}" for i in range(len(w_ts))]
            + (["%r"] if epilogue == "residual" else []))
    kernel_ts = out_ts if epilogue else [f"tensor<{M}x{n}xbf16>" for n in Ns]
    arg_ts = [flat] + ([nw_t] if fused else []) + w_ts + ([out_ts[0]] if epilogue == "residual" else [])
    body += (f"    %y:{len(kernel_ts)} = util.call @{name}({', '.join(args)}) : ({', '.join(arg_ts)}) -> "
             f"({', '.join(kernel_ts)})\n")
    outs = []
    for i, (kt, ot) in enumerate(zip(kernel_ts, out_ts)):
        line, v = reshape_text(f"%y#{i}", kt, ot)
        body += line.replace(f"%y#{i}_r", f"%o{i}")
        outs.append(f"%o{i}" if line else v)
    wrapper = f"{name}_{x_t[len('tensor<'):-len('xbf16>')]}" + (f"_n{f32_bits(norm)}" if norm is not None and not fused else "")
    add_functions(module, d_mlir + f"util.func private @{wrapper}(%x: {x_t}, {', '.join(ins)}) -> "
                          f"({', '.join(out_ts)}) {{\n{body}    util.return {', '.join(outs)} : {', '.join(out_ts)}\n}}\n")
    return wrapper, d


def lower_linear(module, arch: str, min_weight_bytes: int = GEMM_MIN_WEIGHT_BYTES, epilogues: bool = True,
                 decode_qkv: bool = True, row_invariant: bool = True):
    """Lower every linear named op of MODULE for ARCH (module docstring).

    row_invariant: every weight the kernel takes at every M, decode (M = 1) included, with no weight
    floor (module docstring). With row_invariant=False: min_weight_bytes, the weight floor (0 in tests
    and benches, for tiny weights); decode_qkv: False keeps M = 1 on IREE's matvecs entirely.
    epilogues: False gives `linear_residual` and `linear_swiglu` to IREE (an experiment).

    Returns None when MODULE has no such op, else a `Lowered` (export/splice.py) whose entries are,
    per kernel shape: M, N (a list for a group), K, `ops` (dispatches), `mms` (weights), the k splits
    and the epilogue if any; and per op left to IREE, the reason.

    Raises:
        DFlashError: an op whose operands are not as export/ops.py documents them, or what
            `gemm_dispatch` refuses (a missing object).
    """
    from dflash_iree.kernels.gemm import MAX_WEIGHTS, norm_why_unsupported

    ops = [op for name in LINEAR_OPS for op in find_ops(module, "torch.operator", name)]
    if not ops:
        return None
    min_m = 1 if row_invariant else GEMM_MIN_M
    min_weight_bytes = 0 if row_invariant else min_weight_bytes
    out = Lowered(rule={"kernel": has_kernel(arch, "gemm"), "min_m": min_m,
                        "m1_group": None if row_invariant or not decode_qkv else GEMM_M1_RUN,
                        "min_weight_bytes": min_weight_bytes, "epilogues": epilogues,
                        **({"row_invariant": True} if row_invariant else {})})
    counts: dict[tuple, list] = {}
    for op in ops:
        name = op_name(op)
        x, weights = op.operands[0], list_operands(op.operands[1])
        if name == LINEAR_OP:
            refs, residual, rest = list_operands(op.operands[2]), None, list(op.operands[3:])
        elif name == LINEAR_RESIDUAL_OP:
            refs, residual, rest = [op.operands[3]], op.operands[2], list(op.operands[4:])
        else:
            refs, residual, rest = [op.operands[2]], None, list(op.operands[3:])
        norm_w, eps = None, None  # the op's RMSNorm (linear, linear_swiglu: rest[3:5])
        if name != LINEAR_RESIDUAL_OP and len(rest) == 5:
            norm_w, eps = (None, None) if is_none(rest[3]) else (rest[3], constant_float(rest[4]))
            rest = rest[:3]
        if len(rest) != 3 or (name == LINEAR_SWIGLU_OP and len(weights) != 2) or (
                name == LINEAR_RESIDUAL_OP and len(weights) != 1) or (name == LINEAR_OP and len(weights) != len(refs)):
            raise DFlashError(f"splice: {name} has operands {len(op.operands)} / weights {len(weights)} other than "
                              "export/ops.py declares")
        M, K, x_t, xwhy = _rows(x)
        quant, scales, zeros, qwhy = _quant(rest)
        why = None if has_kernel(arch, "gemm") else f"arch {arch} has no skinny GEMM kernel"
        why = why or qwhy or xwhy
        if why is None and name != LINEAR_OP and not epilogues:
            why = "epilogues off"
        if why is None and norm_w is not None:
            why = norm_why_unsupported(K, arch) or (None if builtin_type(norm_w.type) == f"tensor<{K}xbf16>" else
                                                     f"norm weight {builtin_type(norm_w.type)} is not bf16 [{K}]")
        if why is None and name != LINEAR_OP and M < min_m:
            why = f"M={M}: an epilogue takes M >= {min_m}"
        checked = [_weight_ok(w, M, K, arch, min_weight_bytes, quant) for w in weights] if why is None else []
        taken = [i for i, (_, w_why) in enumerate(checked) if w_why is None]
        if why is None and (name != LINEAR_OP or norm_w is not None) and len(taken) != len(weights):
            why = next(w_why for _, w_why in checked if w_why)
        if why is None and M < min_m and (not decode_qkv or len(taken) != GEMM_M1_RUN):
            why = f"M={M}: only a group of exactly {GEMM_M1_RUN} weights takes the kernel"
        if why is None:
            why = next((w_why for _, w_why in checked if w_why), None)  # reported; the others are taken
        else:
            taken = []
        values = list(refs)
        for i in range(0, len(taken), MAX_WEIGHTS if name == LINEAR_OP else max(1, len(taken))):
            run = taken[i:i + MAX_WEIGHTS] if name == LINEAR_OP else taken
            Ns = tuple(checked[j][0] for j in run)
            epi = {LINEAR_RESIDUAL_OP: "residual", LINEAR_SWIGLU_OP: "swiglu"}.get(name)
            out_ts = [builtin_type(refs[j].type) for j in (run if epi is None else [0])]
            fn, d = _gemm_function(M, Ns, K, arch, x_t, out_ts, epi, module, quant, eps)
            packed = [[weights[j]] + ([] if quant is None else [scales[j]] + zeros[j:j + 1]) for j in run]
            operands = ([x] + ([norm_w] if norm_w is not None else []) + [v for vs in packed for v in vs]
                        + ([residual] if residual is not None else []))
            got = emit_call(op, fn, operands, out_ts, [refs[j].type for j in (run if epi is None else [0])])
            for j, v in zip(run if epi is None else [0], got):
                values[j] = v
            norm = "" if eps is None else "+norm" if d.norm is not None else "+norm dispatch"
            key = (M, Ns, K, (d.epilogue or "") + norm or None, quant)
            counts.setdefault(key, [0, d.plan.splits])[0] += 1
            out.flags += [f for f in d.flags if f not in out.flags]
        if why:
            out.iree[why] = out.iree.get(why, 0) + len(weights) - len(taken)
        replace_with_values(op, values)
    out.entries = [{"M": M, "N": Ns[0] if len(Ns) == 1 else list(Ns), "K": K, "ops": c, "mms": c * len(Ns),
                    "splits": splits, **({"epilogue": e} if e else {}),
                    **({"q4": f"{q.fmt}/{q.group}"} if q else {})}
                   for (M, Ns, K, e, q), (c, splits) in sorted(counts.items(),
                                                               key=lambda kv: (kv[0][:3], kv[0][3] or "", str(kv[0][4])))]
    return out
