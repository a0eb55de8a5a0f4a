"""MLIR helpers of the lowering (export/splice.py and export/lower_*.py): types, parsing, adding
functions, finding the named ops and replacing them.

- `builtin_type(torch_type)`: the builtin tensor type of a `!torch.vtensor` (signed and unsigned
  integers become signless, as `torch_c.to_builtin_tensor` does); `static_shape`.
- `add_functions(module, text)`: parse MLIR module-body text (functions, `hal.executable.source`
  ops, ...) and move its top-level ops into the module; symbols already present are kept, not
  doubled, so a function named per shape is added once however many ops call it.
- `find_ops(module, name, custom=...)`: the ops to replace, in module order.
- `replace_with_call(op, callee, operands=None, result_types=None)`: replace a torch op (or a list of
  them, whose results the call returns in order) by `util.call @callee`. Torch operands are converted
  with `torch_c.to_builtin_tensor`, the call's results back with `torch_c.from_builtin_tensor`, and
  the ops' uses take the converted results. IREE's torch input pipeline accepts `util.call` of a
  `util.func private` beside the torch ops of a `func.func`.
- `result_holder(op)`, `list_operands(value)`, `replace_with_values(op, values)`:
  a named op's tensor results (through the `torch.prim.ListUnpack` of a `Tensor[]` result), the
  tensors of a `Tensor[]` operand (its `torch.prim.ListConstruct`), and the op's replacement by its
  reference operands.

Needs the compile extra (iree-base-compiler's MLIR bindings), not torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from dflash_iree.errors import DFlashError

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
    the call's results as torch values (`emit_call`).

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
    ops = [o.operation for o in (op if isinstance(op, list) else [op])]
    first = ops[0]
    where = ops[-1] if at_last else first
    operands = list(first.operands if operands is None else operands)
    results = [r for o in ops for r in o.results]
    result_types = [builtin_type(r.type) for r in results] if result_types is None else list(result_types)
    if len(result_types) != len(results):
        raise DFlashError(f"splice: {callee} returns {len(result_types)} results where {first.name} has {len(results)}")
    news = emit_call(where, callee, operands, result_types, [r.type for r in results])
    for old, new in zip(results, news):
        old.replace_all_uses_with(new)
    for o in ops:
        o.erase()
    return news


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



def owner_name(value) -> str | None:
    """The name of the op that defines VALUE (None for a block argument)."""
    return getattr(value.owner, "name", None)


def is_none(value) -> bool:
    """Whether VALUE is a `torch.constant.none` (an optional operand left out)."""
    return owner_name(value) == "torch.constant.none"


def op_name(op) -> str:
    """The `name` attribute of a `torch.operator` (e.g. "torch.dflash.linear")."""
    return str(op.attributes["name"]).strip('"')


def list_operands(value) -> list:
    """The tensors of a `Tensor[]` operand of a named op: the operands of the `torch.prim.ListConstruct`
    that the FX importer writes for it. Raises DFlashError for any other value."""
    if owner_name(value) != "torch.prim.ListConstruct":
        raise DFlashError(f"splice: {value.get_name()} is not a list of tensors (torch.prim.ListConstruct)")
    return list(value.owner.operands)


def result_holder(op):
    """The op whose results are a named op's tensor results, in order: OP itself, or for an op that
    returns `Tensor[]`, the one `torch.prim.ListUnpack` of that list."""
    if len(op.results) != 1 or not str(op.results[0].type).startswith("!torch.list"):
        return op
    uses = list(op.results[0].uses)
    if len(uses) != 1 or uses[0].owner.name != "torch.prim.ListUnpack":
        raise DFlashError(f"splice: the list result of {op_name(op)} is not unpacked once (torch.prim.ListUnpack)")
    return uses[0].owner


def _erase_with_lists(op, holder) -> None:
    """Erase named op OP (and HOLDER, its ListUnpack, when that is another op), then the
    `ListConstruct`s of its list operands that nothing else uses."""
    lists = [v.owner for v in op.operands if owner_name(v) == "torch.prim.ListConstruct"]
    if holder is not None and holder.operation != op.operation:
        holder.operation.erase()
    op.operation.erase()
    for lst in lists:
        if not list(lst.results[0].uses):
            lst.erase()


def replace_with_values(op, values: Sequence) -> None:
    """Give the uses of named op OP's tensor results to VALUES (its reference operands, in order), and
    erase it: the lowering's IREE rule, after which IREE sees the reference ops alone."""
    holder = result_holder(op)
    results = list(holder.results)
    if len(results) != len(values):
        raise DFlashError(f"splice: {op_name(op)} has {len(results)} results and {len(values)} references")
    for old, new in zip(results, values):
        if old.type != new.type:
            raise DFlashError(f"splice: {op_name(op)}'s result {old.type} differs from its reference's {new.type}")
        old.replace_all_uses_with(new)
    _erase_with_lists(op, holder)


def emit_call(before, callee: str, operands: Iterable, result_types: Sequence[str], torch_types: Sequence) -> list:
    """Insert `util.call @callee(operands)` before op BEFORE and return its results as torch values.

    OPERANDS: `!torch.vtensor` values (passed through `torch_c.to_builtin_tensor`) or builtin values
    defined before BEFORE; RESULT_TYPES: the callee's result types (text); TORCH_TYPES: the torch
    types to give them back (`torch_c.from_builtin_tensor`), one per result.
    """
    from iree.compiler import ir
    from iree.compiler.dialects import util

    where = before.operation
    with where.context, where.location, ir.InsertionPoint(where):
        args = []
        for v in operands:
            if str(v.type).startswith("!torch.vtensor"):
                v = ir.Operation.create("torch_c.to_builtin_tensor", results=[ir.Type.parse(builtin_type(v.type))],
                                        operands=[v]).result
            args.append(v)
        call = util.CallOp([ir.Type.parse(t) for t in result_types], callee, args)
        return [ir.Operation.create("torch_c.from_builtin_tensor", results=[t], operands=[r]).result
                for r, t in zip(call.results, torch_types)]


def i32_constant(before, value: int):
    """An `arith.constant value : i32` inserted before op BEFORE (a kernel's scalar argument)."""
    from iree.compiler import ir

    where = before.operation
    with where.context, where.location, ir.InsertionPoint(where):
        i32 = ir.IntegerType.get_signless(32)
        return ir.Operation.create("arith.constant", results=[i32],
                                   attributes={"value": ir.IntegerAttr.get(i32, value)}).result


def is_constant_int(value) -> bool:
    """Whether VALUE is a `torch.constant.int` result (else a runtime `!torch.int`)."""
    return getattr(value.owner, "name", None) == "torch.constant.int"


def is_constant_bool(value) -> bool:
    """Whether VALUE is a `torch.constant.bool` result (else a runtime `!torch.bool`)."""
    return getattr(value.owner, "name", None) == "torch.constant.bool"


def i32_of_int(before, value):
    """A runtime `!torch.int` VALUE as an i32 (`torch_c.to_i64`, then `arith.trunci`), inserted before
    op BEFORE: a kernel's scalar argument that the export computed from a dynamic dim."""
    from iree.compiler import ir

    where = before.operation
    with where.context, where.location, ir.InsertionPoint(where):
        i64, i32 = ir.IntegerType.get_signless(64), ir.IntegerType.get_signless(32)
        wide = ir.Operation.create("torch_c.to_i64", results=[i64], operands=[value]).result
        return ir.Operation.create("arith.trunci", results=[i32], operands=[wide]).result


def constant_bool(value) -> bool:
    """The value of a `torch.constant.bool` result. Raises DFlashError for any other value."""
    from iree.compiler import ir

    return ir.BoolAttr(_constant(value, "torch.constant.bool")).value


def reshape_text(value: str, src: str, dst: str) -> tuple[str, str]:
    """(MLIR line, result name) that reshapes %VALUE of builtin type SRC to DST, where DST folds
    SRC's leading dims into one ([d0, .., dk, n] -> [d0 * .. * dk, n]) or unfolds them back; an
    empty line when the types are the same."""
    if src == dst:
        return "", value
    a, b = (src, dst) if src.count("x") > dst.count("x") else (dst, src)  # a: more dims
    rank = a.count("x")
    groups = f"[[{', '.join(map(str, range(rank - 1)))}], [{rank - 1}]]"
    out = f"{value}_r"
    if a == src:
        return f"    {out} = tensor.collapse_shape {value} {groups} : {src} into {dst}\n", out
    dims = a[len("tensor<"):-1].split("x")[:-1]
    return f"    {out} = tensor.expand_shape {value} {groups} output_shape [{', '.join(dims)}] : {src} into {dst}\n", out
