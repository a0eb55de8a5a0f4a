"""Splice custom dispatches into the exported module: the one place where that happens.

The export (export/aot.py) is arch-neutral (but for the attention form a backend runs best,
export/compile.py `Arch.attention`) and cached: a custom kernel appears in it as a torch op
that the compiler cannot lower by itself (a `torch.operator "torch.dflash.<op>"`, or any torch op
that a kernel should replace). `export/compile.py lower()` runs `splice_file` once per arch between
the export and iree-compile: it reads the exported module, replaces each such op with a call of a
function built for that arch and shape, and writes the spliced copy into the compile's temporary
stage folder; iree-compile then compiles the copy with the extra flags the splices returned.

A splice is a function `(module, arch) -> list[str] | None` in `SPLICES`: it rewrites the module in
place and returns the iree-compile flags its functions need, or None when it found nothing to
replace. What the splices share:

- `add_functions(module, text)`: parse MLIR module-body text (functions, `hal.executable.source`
  ops, ...) and move its top-level ops into the module; symbols already present are kept, not
  doubled, so a function named per shape is added once however many ops call it.
- `replace_with_call(op, callee, operands=None, result_types=None)`: replace a torch op (or a
  list of them, whose results the call returns in order) by `util.call @callee`. Torch operands
  are converted with `torch_c.to_builtin_tensor`, the call's results back with
  `torch_c.from_builtin_tensor`, and the ops' uses take the converted results.
  IREE's torch input pipeline accepts `util.call` of a `util.func private` beside the torch ops of
  a `func.func`.
- `find_ops(module, name, custom=...)`: the ops to replace, in module order.
- `builtin_type(torch_type)`: the builtin tensor type of a `!torch.vtensor` (signed and unsigned
  integers become signless, as `torch_c.to_builtin_tensor` does).

The splices:

- `splice_topk`: `torch.operator "torch.dflash.topk_logprobs"(logits [n, V] f32, temperature []
  f32, k)` (the custom op of export/ops.py) -> the draft top-K dispatch of kernels/topk.py,
  `topk_dispatch(n, V, k, arch)`, one per shape, named `dflash_topk_{n}x{V}x{k}`.
- `splice_gemm` (CUDA and gfx11/12 archs): `torch.aten.mm(x [M, K] bf16, transpose(W))` with W a
  module global (a weight parameter, [N, K] bf16, of at least GEMM_MIN_WEIGHT_BYTES) and a static
  2 <= M <= 64 -> the skinny-GEMM dispatch of kernels/gemm.py, `gemm_dispatch(M, N, K, arch)`, one
  per shape, named `dflash_gemm_{M}x{N}x{K}`, reading W in place (the transpose goes). The mms of
  one x (views of one value: a layer's q, k and v; gate and up) become one grouped dispatch,
  `gemm_dispatch(M, (N0, N1[, N2]), K, arch)`, named `dflash_gemm_{M}x{N0}_{N1}[_{N2}]x{K}`. At
  M = 1 (decode) only such a group of three (a layer's q, k and v) is taken; the rest stays IREE's.

- `splice_attention` (CUDA and gfx archs): `torch.aten.scaled_dot_product_attention` of a verify
  block (bf16 q [S, Hkv, R, hd], ATTENTION_MIN_ROWS <= R <= 64) whose keys and values are one layer's
  rows of the target's KV cache (export/qwen3.py `attend` over `write_cache`'s cache) -> the block
  attention of kernels/attention.py, `attention_dispatch(S, Hkv, R, hd, L, C, arch)`, which reads the
  whole cache in place with the layer as an argument.

- `splice_norm_rope` (every GPU arch): `torch.operator "torch.dflash.head_norm_rope"(x [S, T, H, hd],
  weight [hd], cos, sin [S, T, hd], eps)` (the custom op of export/ops.py, exported by the GPU form
  only) -> the head norm + rope dispatch of kernels/norm_rope.py, one per shape, dtype and eps, named
  `dflash_norm_rope_{S}x{T}x{H}x{hd}_{dtype}_{eps bits}` (T "D" when dynamic); a layer's q and k
  ops (the same cos and sin) as one dispatch, `..._{S}x{T}x{Hq}_{Hk}x{hd}_...`.

A custom op left after the splices (a `splices` dict without its splice) is refused by `splice_file`.

`last_report()` says what the last `splice_file` replaced, per splice (the compile manifest keeps it).

Needs the compile extra (iree-base-compiler's MLIR bindings), not torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from dflash_iree.errors import DFlashError

TOPK_OP = "torch.dflash.topk_logprobs"  # what the FX importer names the custom op of export/ops.py

_TORCH_TENSOR = re.compile(r"!torch\.vtensor<\[([^\]]*)\],([a-z]+[0-9]*)>")
_ELEMENT = {"si8": "i8", "si16": "i16", "si32": "i32", "si64": "i64", "ui8": "i8", "i1": "i1"}


def builtin_type(torch_type) -> str:
    """The builtin tensor type (text) of a `!torch.vtensor<[d0,d1,...],dtype>` type.

    Unknown dims (`?`, or -1 as some printers write them) stay dynamic; `si*`/`ui*` elements become
    signless `i*`. Raises DFlashError for any other type.
    """
    m = _TORCH_TENSOR.fullmatch(str(torch_type))
    if not m:
        raise DFlashError(f"splice: {torch_type} is not a !torch.vtensor with a known rank and dtype")
    dims = ["?" if d.strip() in ("?", "-1") else d.strip() for d in m[1].split(",") if d.strip()]
    return f"tensor<{''.join(d + 'x' for d in dims)}{_ELEMENT.get(m[2], m[2])}>"


def static_shape(torch_type) -> list[int]:
    """The dims of a `!torch.vtensor` type; raises DFlashError when one is dynamic."""
    dims = builtin_type(torch_type)[len("tensor<"):-1].split("x")[:-1]
    if "?" in dims:
        raise DFlashError(f"splice: {torch_type} has a dynamic dim; the kernel needs static shapes")
    return [int(d) for d in dims]


def load(path: str | Path):
    """Parse an MLIR file (text or bytecode) in a fresh context with IREE's dialects. Returns the module."""
    from iree.compiler import ir

    ctx = ir.Context()
    return ir.Module.parse(Path(path).read_bytes(), ctx)


def strip_locations(module) -> None:
    """Drop every source location of MODULE, in place: they hold absolute paths (the checkout,
    site-packages) or parse positions that iree-compile would embed in the .vmfb, so the same
    sources in another folder would give another sha256."""
    from iree.compiler.passmanager import PassManager

    with module.context:
        PassManager.parse("builtin.module(strip-debuginfo)").run(module.operation)


def symbols(module) -> set[str]:
    """Names of the module's top-level symbols."""
    return {str(op.attributes["sym_name"]).strip('"') for op in module.body.operations
            if "sym_name" in op.attributes}


def add_functions(module, text: str) -> list[str]:
    """Parse module-body TEXT and move its top-level ops to the top of MODULE, in their order.

    TEXT holds ops as they would stand inside `module { ... }`: `util.func private` functions,
    `hal.executable.source` ops, and so on; they may refer to each other and to MODULE's symbols
    only by name. An op whose symbol MODULE already has is dropped (the one there is kept), so a
    helper named per shape can be added for every op that uses it. Returns the symbols added.

    Raises:
        DFlashError: TEXT does not parse (the parser's diagnostics are in the message).
    """
    from iree.compiler import ir

    try:
        parsed = ir.Module.parse("module {\n" + text + "\n}", module.context)
    except ir.MLIRError as e:
        raise DFlashError(f"splice: the MLIR to add does not parse: {e}") from None
    have = symbols(module)
    first = next(iter(module.body.operations), None)
    added = []
    for op in list(parsed.body.operations):
        name = str(op.attributes["sym_name"]).strip('"') if "sym_name" in op.attributes else None
        if name in have:
            continue
        if first is None:
            module.body.append(op)
        else:
            op.move_before(first)
        if name:
            added.append(name)
            have.add(name)
    return added


def find_ops(module, name: str, custom: str | None = None) -> list:
    """Every op named NAME in MODULE, in walk order; for NAME `torch.operator`, only those whose
    `name` attribute is CUSTOM (e.g. "torch.dflash.topk_logprobs")."""
    from iree.compiler import ir

    found = []

    def visit(op):
        if op.name == name and (custom is None or str(op.attributes["name"]).strip('"') == custom):
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def replace_with_call(op, callee: str, operands: Iterable | None = None,
                      result_types: Sequence[str] | None = None, at_last: bool = False):
    """Replace OP (or a list of ops, in block order) by one `util.call @callee(operands)` and return
    the call op.

    Args:
        op: a torch op (ir.Operation or OpView) whose results are `!torch.vtensor`s, or a list of
            them; the call stands where the first stood and its results, in order, take the uses of
            the ops' results, in order.
        callee: a function of the module (add it first, e.g. with `add_functions`) that takes the
            builtin forms of the operands and returns the builtin forms of the ops' results.
        operands: the values to pass (default: all of the first op's operands). A `!torch.vtensor`
            value is passed through `torch_c.to_builtin_tensor`; any other value as it is (it must
            be defined before the first op).
        result_types: the callee's result types as text (default: `builtin_type` of the results).
        at_last: the call stands where the last op stood instead (its operands may be defined between
            the ops; the caller makes sure no use of an earlier op's results comes before it).

    The call's results go through `torch_c.from_builtin_tensor` back to the ops' result types, the
    ops' uses take them, and the ops are erased (the constants they alone used are left to the
    canonicalizer).

    Raises:
        DFlashError: an operand or result that is not a tensor of known rank and dtype, or a
            result count that differs from the ops'.
    """
    from iree.compiler import ir
    from iree.compiler.dialects import util

    ops = [o.operation for o in (op if isinstance(op, list) else [op])]
    first = ops[0]
    where = ops[-1] if at_last else first
    operands = list(first.operands if operands is None else operands)
    results = [r for o in ops for r in o.results]
    result_types = [builtin_type(r.type) for r in results] if result_types is None else list(result_types)
    if len(result_types) != len(results):
        raise DFlashError(f"splice: {callee} returns {len(result_types)} results where {first.name} has {len(results)}")
    with first.context, where.location, ir.InsertionPoint(where):
        args = []
        for v in operands:
            if str(v.type).startswith("!torch.vtensor"):
                v = ir.Operation.create("torch_c.to_builtin_tensor", results=[ir.Type.parse(builtin_type(v.type))],
                                        operands=[v]).result
            args.append(v)
        call = util.CallOp([ir.Type.parse(t) for t in result_types], callee, args)
        for old, new in zip(results, call.results):
            back = ir.Operation.create("torch_c.from_builtin_tensor", results=[old.type], operands=[new]).result
            old.replace_all_uses_with(back)
    for o in ops:
        o.erase()
    return call


def _constant(value, kind: str):
    owner = value.owner
    if getattr(owner, "name", None) != kind:
        raise DFlashError(f"splice: {value.get_name()} is not a {kind} in the exported module")
    return owner.attributes["value"]


def constant_int(value) -> int:
    """The integer of a `torch.constant.int` result. Raises DFlashError for any other value."""
    from iree.compiler import ir

    return ir.IntegerAttr(_constant(value, "torch.constant.int")).value


def constant_float(value) -> float:
    """The number of a `torch.constant.float` result. Raises DFlashError for any other value."""
    from iree.compiler import ir

    return ir.FloatAttr(_constant(value, "torch.constant.float")).value


_REPORT: dict[str, list] = {}


def last_report() -> dict[str, list]:
    """What the last `splice_file` replaced: splice name -> entries (for the manifest)."""
    return {k: list(v) for k, v in _REPORT.items()}


def splice_topk(module, arch: str) -> list[str] | None:
    """Replace every `torch.dflash.topk_logprobs` op with the draft top-K dispatch for ARCH.

    Each (n, V, k) gets one `util.func private @dflash_topk_{n}x{V}x{k}_op(tensor<nxVxf32>,
    tensor<f32>) -> (tensor<nxkxi32>, tensor<nxkxf32>)` that reads the temperature scalar and calls
    the dispatch's function (kernels/topk.py `topk_dispatch(..., name="dflash_topk_{n}x{V}x{k}")`).
    Records (n, V, K, count) per shape in `last_report()["topk"]`. Returns the flags the dispatch
    needs (the object search path), or None when there was no such op.

    Raises:
        DFlashError: a non-f32 or dynamic logits shape, k not a constant, or what `topk_dispatch`
            refuses (k outside 1..64, an arch without an object).
    """
    from dflash_iree.kernels.topk import topk_dispatch

    ops = find_ops(module, "torch.operator", TOPK_OP)
    if not ops:
        return None
    flags: list[str] = []
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
        flags += [f for f in d.flags if f not in flags]
        counts[(n, V, K)] = counts.get((n, V, K), 0) + 1
    _REPORT["topk"] = [{"n": n, "V": V, "K": K, "ops": c} for (n, V, K), c in sorted(counts.items())]
    return flags


# M = 1 (decode) keeps IREE's own matvec for a lone weight and for gate + up: in IREE on the H200 it
# ran the 8B layer at 0.63 of the copy bandwidth against 0.51 for the custom dispatch
# (bench/results/gemm_h200.json), and grouping gate + up at M = 1 cost 0.5 ms more kernel time a step
# (the grouped gate+up 60 us against IREE's 2 x 25, which also fuses the SiLU product into the up
# matvec; bench/results/speed_8b_h200_groups_ab.json, `dec`). A layer's q, k and v (a group of
# exactly three) do take the grouped dispatch at M = 1: its kernel time is about IREE's three
# matvecs' (0.655 against 0.621 ms a decode step, bench/results/speed_8b_h200_pairs.json) and it is
# two launches fewer a layer. The exact mode decodes plainly
# through the verify graph (M = block), which takes the dispatch, so drafted == plain holds.
GEMM_M1_RUN = 3
GEMM_MIN_M = 2
# Below this a weight's bytes take under a microsecond at the H200's bandwidth, less than the few µs
# a custom dispatch costs in IREE, and IREE's own matmul fuses with its neighbours: on the demo pair
# (384-wide layers) the drafted arm ran 1849 tok/s with the floor against 1633 without
# (bench/demo_rounds.py, bench/results/demo_rounds_h200.json). Every Qwen3-8B weight is above it.
GEMM_MIN_WEIGHT_BYTES = 4 << 20
_TRANSPOSES = ("torch.aten.t", "torch.aten.transpose.int")


def _owner_name(value) -> str | None:
    owner = value.owner
    return getattr(owner, "name", None)


def _weight_of(rhs):
    """The builtin [N, K] weight value when RHS is transpose(W) of a module global W, else None."""
    if _owner_name(rhs) not in _TRANSPOSES:
        return None
    t = rhs.owner
    if t.name == "torch.aten.transpose.int":
        try:
            dims = sorted(d % 2 for d in (constant_int(t.operands[1]), constant_int(t.operands[2])))
        except DFlashError:
            return None
        if dims != [0, 1]:
            return None
    src = t.operands[0]
    if _owner_name(src) != "torch_c.from_builtin_tensor":
        return None
    w = src.owner.operands[0]
    return w if _owner_name(w) == "util.global.load" else None


def _rows_of(x):
    """The value whose rows X is: the source of the `torch.aten.view` that made X (the export views
    the [1, M, K] hidden states as [M, K] once per projection), else X itself."""
    return x.owner.operands[0] if _owner_name(x) == "torch.aten.view" else x


def _immutable_globals(module) -> set[str]:
    """Names of MODULE's `util.global`s that are not `mutable` (the weights; not the KV cache)."""
    from iree.compiler import ir

    return {ir.StringAttr(op.attributes["sym_name"]).value for op in module.body.operations
            if op.name == "util.global" and "is_mutable" not in op.attributes}


def _global_name(load) -> str:
    """The global a `util.global.load` value reads."""
    from iree.compiler import ir

    return ir.FlatSymbolRefAttr(load.owner.attributes["global"]).value


def _reload(weights, before) -> list:
    """A fresh `util.global.load` of each weight's global just before the op BEFORE: a grouped call
    stands where its first mm stood, and a later mm's own load may stand after that (the globals
    are immutable, and IREE dedupes the loads)."""
    from iree.compiler import ir

    op = before.operation
    with op.context, op.location, ir.InsertionPoint(op):
        return [ir.Operation.create("util.global.load", results=[w.type],
                                    attributes={"global": w.owner.attributes["global"]}).result for w in weights]


_VIEWS = ("torch.aten.view", "torch.aten._unsafe_view")


def _only_user(value, names):
    """The op using VALUE when it has exactly one use and that op is named NAMES (a name or a
    tuple of names), else None."""
    uses = list(value.uses)
    if len(uses) != 1 or uses[0].owner.name not in ((names,) if isinstance(names, str) else names):
        return None
    return uses[0].owner


def _epilogue(mms: list):
    """The op that follows the mm run MMS and that a GEMM epilogue can take (kernels/gemm.py), as
    (kind, that op, [its operand besides the mms' results], [the ops it makes dead, users first],
    the mms' order in the dispatch):

    - "residual": one mm, `add.Tensor(r, view(mm), 1)` (the residual add after o_proj and down_proj;
      either operand order), the view and the mm used by nothing else;
    - "swiglu": two mms (gate, up; either order), `mul.Tensor(silu(view(gate)), view(up))` (either
      operand order), each intermediate used once.

    None when neither matches (then the run keeps its plain outputs)."""
    views = [_only_user(m.results[0], _VIEWS) for m in mms]
    if any(v is None for v in views):
        return None
    out = [builtin_type(v.results[0].type) for v in views]
    if len(mms) == 1:
        add = _only_user(views[0].results[0], "torch.aten.add.Tensor")
        if add is None or len(add.operands) != 3:
            return None
        try:
            if constant_int(add.operands[2]) != 1:
                return None
        except DFlashError:
            return None
        a, b = add.operands[0], add.operands[1]
        r = a if b == views[0].results[0] else b
        if r == views[0].results[0] or {builtin_type(r.type), builtin_type(add.results[0].type)} != {out[0]}:
            return None
        return "residual", add, [r], [add, views[0], mms[0]], [0]
    if len(mms) == 2 and out[0] == out[1]:
        for g in (0, 1):
            silu = _only_user(views[g].results[0], "torch.aten.silu")
            mul = silu and _only_user(silu.results[0], "torch.aten.mul.Tensor")
            if mul is None or _only_user(views[1 - g].results[0], "torch.aten.mul.Tensor") != mul:
                continue
            if builtin_type(mul.results[0].type) != out[0]:
                return None
            return "swiglu", mul, [], [mul, silu, views[g], views[1 - g], mms[g], mms[1 - g]], [g, 1 - g]
    return None


def splice_gemm(module, arch: str, min_weight_bytes: int = GEMM_MIN_WEIGHT_BYTES,
                epilogues: bool = True, decode_qkv: bool = True) -> list[str] | None:
    """Replace the `torch.aten.mm(x, transpose(W))`s of bf16 weight globals W with the skinny GEMM,
    the mms of one x together (up to 3: a layer's q, k and v projections; gate and up) in one dispatch.

    Taken: x [M, K] bf16 with a static GEMM_MIN_M <= M <= 64 (at M = 1, with DECODE_QKV, only a group of
    exactly GEMM_M1_RUN weights without an epilogue: a layer's q, k and v), W a `util.global.load` of an immutable
    [N, K] bf16 global of at least `min_weight_bytes` bytes, the result [M, N] bf16, and a shape the
    kernel takes on ARCH (kernels/gemm.py `why_unsupported`); every other mm is left to IREE. Mms
    in one block whose x are views of the same value with the same type form a group (a layer's q,
    k and v; gate and up; the drafter's context k and v projections of all its layers), cut into
    runs of at most 3 in module order; a run's call stands where its first mm stood. Every function
    of the export groups its weights the same way, so a weight's k split, and with it its bits, is
    the same wherever it is read. Archs: CUDA (sm_*) and gfx1100/1151/1201; others return None.
    With EPILOGUES (the default), a run whose results feed only the residual add (o_proj, down_proj)
    or only silu(gate) * up (`_epilogue`) is replaced together with that op, by the dispatch's
    epilogue ("residual", "swiglu"): one dispatch fewer each, and the same roundings.
    Each (M, Ns, K) gets one function `dflash_gemm_{M}x{N0}[_{N1}[_{N2}]]x{K}` (with an epilogue,
    `..._{residual|swiglu}_{out shape}`; its executable and counter global). Records per shape, in
    `last_report()["gemm"]`: M, N (a list for a group), K, `ops` (dispatches), `mms` (matmuls
    replaced), the k splits and the epilogue if any. Returns the flags (the object search path), or
    None when nothing was replaced.
    """
    from dflash_iree.kernels.gemm import ARCHS, MAX_WEIGHTS, gemm_dispatch, why_unsupported

    if arch not in ARCHS:
        return None
    immutable = _immutable_globals(module)
    groups: dict[tuple, list] = {}  # (rows value, x type, block) -> [(op, w, N)], first-seen order
    for op in find_ops(module, "torch.aten.mm"):
        x, rhs = op.operands
        w = _weight_of(rhs)
        if w is None or _global_name(w) not in immutable:
            continue
        xt, wt, yt = builtin_type(x.type), str(w.type), builtin_type(op.results[0].type)
        m = re.fullmatch(r"tensor<(\d+)x(\d+)xbf16>", xt)
        n = re.fullmatch(r"tensor<(\d+)x(\d+)xbf16>", wt)
        if not m or not n or int(m[2]) != int(n[2]):
            continue
        M, K, N = int(m[1]), int(m[2]), int(n[1])
        if 2 * N * K < min_weight_bytes or yt != f"tensor<{M}x{N}xbf16>" or why_unsupported(M, N, K, arch):
            continue
        groups.setdefault((_rows_of(x), xt, op.operation.block), []).append((op, w, N))
    if not groups:
        return None
    flags: list[str] = []
    counts: dict[tuple, int] = {}
    splits: dict[tuple, int] = {}
    for members in groups.values():
        for i in range(0, len(members), MAX_WEIGHTS):
            run = members[i:i + MAX_WEIGHTS]
            ops, ws, Ns = [r[0] for r in run], [r[1] for r in run], tuple(r[2] for r in run)
            x = ops[0].operands[0]
            M, K = static_shape(x.type)
            name = f"dflash_gemm_{M}x{'_'.join(map(str, Ns))}x{K}"
            epi = _epilogue(ops) if epilogues else None
            if M < GEMM_MIN_M and (not decode_qkv or len(members) != GEMM_M1_RUN or epi is not None):
                continue
            if epi is None:
                d = gemm_dispatch(M, Ns, K, arch, name=name)
                add_functions(module, d.mlir)
                replace_with_call(ops, name, [x, *_reload(ws, ops[0])], [f"tensor<{M}x{n}xbf16>" for n in Ns])
            else:
                kind, op, extra, dead, order = epi
                shape = static_shape(op.results[0].type)
                name += f"_{kind}_{'x'.join(map(str, shape))}"
                Ns = tuple(Ns[j] for j in order)
                d = gemm_dispatch(M, Ns, K, arch, name=name, epilogue=kind, out_shape=shape)
                add_functions(module, d.mlir)
                replace_with_call(op, name, [x, *_reload([ws[j] for j in order], op), *extra],
                                  [builtin_type(op.results[0].type)])
                for o in dead[1:]:
                    o.erase()
            key = (M, Ns, K, d.epilogue)
            counts[key] = counts.get(key, 0) + 1
            splits[key] = d.plan.splits
            flags += [f for f in d.flags if f not in flags]
    if not counts:
        return None
    _REPORT["gemm"] = [{"M": M, "N": Ns[0] if len(Ns) == 1 else list(Ns), "K": K, "ops": c, "mms": c * len(Ns),
                        "splits": splits[(M, Ns, K, e)], **({"epilogue": e} if e else {})}
                       for (M, Ns, K, e), c in sorted(counts.items(), key=lambda kv: (kv[0][:3], kv[0][3] or ""))]
    return flags


# Query rows below this (decode: R = the g query heads of a KV group) keep IREE's fused attention op:
# at the 8B shapes on the H200 it costs 10 µs a layer at 4 rows, where the kernel costs 14 µs, and
# 138 µs at 64 rows, where the kernel costs 26 (bench/attention_bench.py, attention_h200_kernel.json).
ATTENTION_MIN_ROWS = 8
SDPA_OP = "torch.aten.scaled_dot_product_attention"


def _list_ints(value) -> list[int] | None:
    """The ints of a `torch.prim.ListConstruct` of constant ints, else None."""
    if _owner_name(value) != "torch.prim.ListConstruct":
        return None
    try:
        return [constant_int(v) for v in value.owner.operands]
    except DFlashError:
        return None


def _cache_rows(kv):
    """(cache, layer, which, n) when KV (a `scaled_dot_product_attention` key or value operand) is
    export/qwen3.py's `cache[:, layer, which, :n].view(S, n, Hkv, hd).permute(0, 2, 1, 3)` of a
    [S, L, 2, C, Hkv * hd] tensor `cache` (n: the slice's end, a value), else None."""
    def arg(value, name, i=0):
        return value.owner.operands[i] if _owner_name(value) == name else None

    try:
        viewed = arg(kv, "torch.aten.permute")
        if viewed is None or _list_ints(kv.owner.operands[1]) != [0, 2, 1, 3]:
            return None
        sliced = arg(viewed, "torch.aten.view")
        if sliced is None or _owner_name(sliced) != "torch.aten.slice.Tensor":
            return None
        sl = sliced.owner
        dim, start, step = sl.operands[1], sl.operands[2], sl.operands[4]
        if constant_int(dim) != 1 or constant_int(step) != 1 or (
                _owner_name(start) != "torch.constant.none" and constant_int(start) != 0):
            return None
        src, picked = sl.operands[0], []
        for _ in range(2):  # select(select(cache, 1, layer), 1, which)
            if _owner_name(src) != "torch.aten.select.int" or constant_int(src.owner.operands[1]) != 1:
                return None
            picked.append(constant_int(src.owner.operands[2]))
            src = src.owner.operands[0]
        which, layer = picked
        return src, layer, which, sl.operands[3]
    except DFlashError:  # an operand that is not a constant int
        return None


_HEADS_TOKENS = [0, 2, 1, 3, 4]  # attend's permutation between [S, T, Hkv, g, hd] and [S, Hkv, T, g, hd]


def _token_major_q(q, S: int, Hkv: int, R: int, D: int):
    """(q0, g, [the ops that make q]) when q [S, Hkv, R, D] is export/qwen3.py `attend`'s rows =
    q0.view(S, T, Hkv, g, D).permute(0, 2, 1, 3, 4).clone().view(S, Hkv, T * g, D) of q0 [S, T, Hkv * g, D],
    else None."""
    if _owner_name(q) not in _VIEWS or _owner_name(q.owner.operands[0]) != "torch.aten.clone":
        return None
    clone = q.owner.operands[0].owner
    if _owner_name(clone.operands[0]) != "torch.aten.permute":
        return None
    perm = clone.operands[0].owner
    if _list_ints(perm.operands[1]) != _HEADS_TOKENS or _owner_name(perm.operands[0]) not in _VIEWS:
        return None
    view = perm.operands[0].owner
    q0 = view.operands[0]
    m = re.fullmatch(r"tensor<(\d+)x(\d+)x(\d+)x(\d+)x(\d+)xbf16>", builtin_type(view.results[0].type))
    if not m:
        return None
    s, T, h, g, d = (int(v) for v in m.groups())
    if (s, h, d, T * g) != (S, Hkv, D, R) or builtin_type(q0.type) != f"tensor<{S}x{T}x{Hkv * g}x{D}xbf16>":
        return None
    return q0, g, [q.owner, clone, perm, view]


def _token_major_out(out, S: int, Hkv: int, R: int, D: int, g: int):
    """[the ops, users first] of `attend`'s out.view(S, Hkv, T, g, D).permute(0, 2, 1, 3, 4).clone()
    .view(S, T, Hkv * g * D) when they are OUT's only use chain, else None."""
    view = _only_user(out, _VIEWS)
    perm = view and _only_user(view.results[0], "torch.aten.permute")
    clone = perm and _only_user(perm.results[0], "torch.aten.clone")
    last = clone and _only_user(clone.results[0], _VIEWS)
    if last is None or _list_ints(perm.operands[1]) != _HEADS_TOKENS:
        return None
    T = R // g
    if (builtin_type(view.results[0].type) != f"tensor<{S}x{Hkv}x{T}x{g}x{D}xbf16>"
            or builtin_type(last.results[0].type) != f"tensor<{S}x{T}x{Hkv * g * D}xbf16>"):
        return None
    return [last, clone, perm, view]


def splice_attention(module, arch: str, min_rows: int = ATTENTION_MIN_ROWS,
                     token_major: bool = True) -> list[str] | None:
    """Replace the verify block's `scaled_dot_product_attention` over the KV cache with the block attention.

    Taken: q [S, Hkv, R, hd] bf16 with a static min_rows <= R <= 64; k and v the rows [:n] of one
    layer of a [S, L, 2, C, Hkv * hd] bf16 cache (export/qwen3.py `attend` over `write_cache`'s cache,
    `_cache_rows`), keys at index 0 and values at 1 of the same layer; a boolean mask [S, 1, R, n]
    with a dynamic n; no dropout, not causal, no GQA flag. The cache goes to the kernel whole and is
    read in place (kernels/attention.py, `attention_dispatch(S, Hkv, R, hd, L, C, arch)`, one function
    per shape named `dflash_attention_{S}x{Hkv}x{R}x{hd}_{L}x{C}`, the layer a call argument). Every
    other attention stays IREE's (decode, prefill, the drafter's). Archs: CUDA (sm_*) and gfx*.
    When q is `attend`'s transpose of the model's [S, T, Hq, hd] and the result's only use is the
    transpose back to [S, T, Hq * hd], the kernel takes and gives the model's layout (`g` = Hq / Hkv)
    and both transposes go (two dispatches a layer; `token_major=False` keeps them). Records (S,
    Hkv, R, hd, count, and g when taken) per shape in `last_report()["attention"]`. Returns the
    flags (the object search path), or None when nothing was replaced.
    """
    from iree.compiler import ir

    from dflash_iree.kernels.attention import ARCHS, attention_dispatch, f32_bits, why_unsupported

    if arch not in ARCHS:
        return None
    flags: list[str] = []
    counts: dict[tuple, int] = {}
    for op in find_ops(module, SDPA_OP):
        q, k, v, mask, dropout, causal, scale = list(op.operands)[:7]
        gqa = list(op.operands)[7] if len(op.operands) > 7 else None
        if any(_owner_name(f) != "torch.constant.bool" or ir.BoolAttr(f.owner.attributes["value"]).value
               for f in (causal, gqa) if f is not None):
            continue
        if _owner_name(dropout) != "torch.constant.float" or ir.FloatAttr(dropout.owner.attributes["value"]).value != 0.0:
            continue
        if _owner_name(scale) == "torch.constant.float":
            sc = ir.FloatAttr(scale.owner.attributes["value"]).value
        elif _owner_name(scale) == "torch.constant.none":
            sc = None
        else:
            continue
        kr, vr = _cache_rows(k), _cache_rows(v)
        if (kr is None or vr is None or kr[0] != vr[0] or kr[1] != vr[1] or (kr[2], vr[2]) != (0, 1)
                or kr[3] != vr[3]):  # the same cache, layer and row count; keys at 0, values at 1
            continue
        cache, layer = kr[0], kr[1]
        qm = re.fullmatch(r"tensor<(\d+)x(\d+)x(\d+)x(\d+)xbf16>", builtin_type(q.type))
        cm = re.fullmatch(r"tensor<(\d+)x(\d+)x2x(\d+)x(\d+)xbf16>", builtin_type(cache.type))
        if not qm or not cm:
            continue
        S, Hkv, R, D = (int(x) for x in qm.groups())
        L, C = int(cm[2]), int(cm[3])
        if (int(cm[1]) != S or int(cm[4]) != Hkv * D or R < min_rows or not 0 <= layer < L
                or builtin_type(k.type) != f"tensor<{S}x{Hkv}x?x{D}xbf16>"  # heads split as the kernel reads them
                or not str(mask.type).startswith("!torch.vtensor")  # no mask (None): not export/qwen3.py's
                or builtin_type(mask.type) != f"tensor<{S}x1x{R}x?xi1>"
                or builtin_type(op.results[0].type) != builtin_type(q.type)
                or why_unsupported(S, Hkv, R, D, L, C, arch)):
            continue
        bits = "" if sc is None else f"_s{f32_bits(sc):08x}"  # one function per f32 scale
        # attend's transposes of q before and of the result after, taken into the kernel's addressing
        tq = _token_major_q(q, S, Hkv, R, D) if token_major else None
        tout = tq and _token_major_out(op.results[0], S, Hkv, R, D, tq[1])
        g = tq[1] if tout else 0
        name = f"dflash_attention_{S}x{Hkv}x{R}x{D}_{L}x{C}{bits}" + (f"_g{g}" if g else "")
        d = attention_dispatch(S, Hkv, R, D, L, C, arch, name=name, scale=sc, g=g)
        add_functions(module, d.mlir)
        with op.context, op.location, ir.InsertionPoint(op):
            i32 = ir.IntegerType.get_signless(32)
            layer_v = ir.Operation.create("arith.constant", results=[i32],
                                          attributes={"value": ir.IntegerAttr.get(i32, layer)}).result
        if g:
            replace_with_call(tout[0], name, [tq[0], cache, mask, layer_v], [builtin_type(tout[0].results[0].type)])
            for dead in tout[1:] + [op] + tq[2]:
                if not list(dead.results[0].uses):
                    dead.erase()
        else:
            replace_with_call(op, name, [q, cache, mask, layer_v], [builtin_type(q.type)])
        key = (S, Hkv, R, D, g)
        counts[key] = counts.get(key, 0) + 1
        flags += [f for f in d.flags if f not in flags]
    if not counts:
        return None
    _REPORT["attention"] = [{"S": S, "Hkv": Hkv, "R": R, "head_dim": D, "ops": c, **({"g": g} if g else {})}
                            for (S, Hkv, R, D, g), c in sorted(counts.items())]
    return flags


NORM_ROPE_OP = "torch.dflash.head_norm_rope"  # the custom op of export/ops.py


def _parse_norm_rope(op):
    """(S, T, H, hd, dtype, eps) of a head norm + rope op; T None when dynamic. Raises DFlashError."""
    x, weight, cos, sin, eps = op.operands
    dims = builtin_type(x.type)[len("tensor<"):-1].split("x")
    if len(dims) != 5 or "?" in (dims[0], dims[2], dims[3]):
        raise DFlashError(f"splice: {NORM_ROPE_OP} takes x [S, T, H, hd] with static S, H, hd, got {x.type}")
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


def splice_norm_rope(module, arch: str, pairs: bool = True) -> list[str] | None:
    """Replace every `torch.dflash.head_norm_rope` op (x [S, T, H, hd], weight [hd], cos, sin [S, T, hd],
    eps) with the head norm + rope dispatch for ARCH (kernels/norm_rope.py), one function per shape,
    dtype and eps, named `dflash_norm_rope_{S}x{T}x{H}x{hd}_{dtype}_{eps bits}` (T: "D" when dynamic).
    With PAIRS (the default), a layer's q and k ops (`_norm_rope_pairs`: the same position tables)
    become one dispatch, `dflash_norm_rope_{S}x{T}x{H}_{Hk}x{hd}_{dtype}_{eps bits}`, one launch
    less a layer and step.

    Records (S, T, H, head_dim, dtype, count) per shape in `last_report()["norm_rope"]` (H a list
    [H, Hk] for a pair). Returns the flags the dispatch needs, or None when there was no such op.

    Raises:
        DFlashError: operands of another rank or of mixed dtypes, eps not a constant, or what
            `norm_rope_dispatch` refuses (an arch without the kernel, such as host, an odd head_dim).
    """
    from dflash_iree.kernels.attention import f32_bits
    from dflash_iree.kernels.norm_rope import norm_rope_dispatch

    ops = find_ops(module, "torch.operator", NORM_ROPE_OP)
    if not ops:
        return None
    flags: list[str] = []
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
        flags += [f for f in d.flags if f not in flags]
        key = (S, T, H if Hk is None else (H, Hk), D, dtype)
        counts[key] = counts.get(key, 0) + 1
    _REPORT["norm_rope"] = [{"S": S, "T": T, "H": H if isinstance(H, int) else list(H), "head_dim": D, "dtype": dt,
                             "ops": c}
                            for (S, T, H, D, dt), c in sorted(counts.items(), key=lambda kv: str(kv[0]))]
    return flags


# name -> splice; run in this order by `splice_file`.
SPLICES: dict[str, Callable[[object, str], list[str] | None]] = {"topk": splice_topk, "gemm": splice_gemm,
                                                                  "attention": splice_attention,
                                                                  "norm_rope": splice_norm_rope}


def splice_file(src: str | Path, dst: str | Path, arch: str, splices: dict | None = None) -> tuple[Path, list[str]]:
    """Run every splice on the module at SRC for ARCH (an ARCH name of export/compile.py).

    When a splice changed the module, the spliced copy is written to DST (bytecode) and (DST, flags)
    is returned; when none did, nothing is written and (SRC, []) comes back, so a module without
    custom ops compiles exactly as exported.

    Raises:
        DFlashError: from a splice, a `torch.dflash.*` custom op that no splice replaced, or a spliced
            module that does not verify.
    """
    from iree.compiler import ir

    module = load(src)
    _REPORT.clear()
    changed, flags = False, []
    for splice in (SPLICES if splices is None else splices).values():
        got = splice(module, arch)
        if got is not None:
            changed = True
            flags += [f for f in got if f not in flags]
    left = sorted({str(op.attributes["name"]).strip('"') for op in find_ops(module, "torch.operator")
                   if str(op.attributes["name"]).startswith('"torch.dflash.')})
    if left:
        raise DFlashError(f"splice: {', '.join(left)} left in the module: its splice (export/splice.py SPLICES) "
                          "was not run, and iree-compile cannot lower a custom op")
    if not changed:
        return Path(src), []
    try:
        module.operation.verify()
    except ir.MLIRError as e:
        raise DFlashError(f"splice: the spliced module does not verify: {e}") from None
    strip_locations(module)  # the added text carries its parse locations ("-":line:col)
    with open(dst, "wb") as f:
        module.operation.write_bytecode(f)
    return Path(dst), flags
