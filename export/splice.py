"""The lowering of the export's named ops, per arch: the one place where kernels enter the module.

The export (export/aot.py) is arch-neutral (but for the attention form a backend runs best,
dflash_iree/arch.py `Arch.attention`) and cached: each custom kernel appears in it as a named op of
export/ops.py, a `torch.operator "torch.dflash.<name>"` holding the kernel's real inputs (and, where
IREE may get the op instead, the model's reference result). `export/compile.py lower()` runs
`splice_file` once per arch between the export and iree-compile: it reads the exported module, and
each lowering below replaces the ops it owns, by name, with a call of a kernel built for that arch
and shape, or with the op's reference result where the arch's rules give the op to IREE (then IREE
sees exactly the module it would see without the named op). No lowering looks at the ops around a
named op. iree-compile then compiles the spliced copy with the extra flags the lowerings returned.

The lowerings (`LOWERINGS`, run in this order; each `(module, arch) -> Lowered | None`):

- "topk": export/lower_topk.py, `dflash::topk_logprobs` -> the draft top-K (kernels/topk/), every arch.
- "gemm": export/lower_linear.py, `dflash::linear`, `linear_residual`, `linear_swiglu` -> the skinny
  GEMM (kernels/gemm/, CUDA and gfx11/12), its grouped form and its epilogues, or IREE's matmul.
- "attention": export/lower_attention.py, `dflash::block_attention` -> the block attention over the
  KV cache (kernels/attention/, CUDA and gfx), or IREE's attention.
- "norm_rope": export/lower_norm_rope.py, `dflash::head_norm_rope` -> the head norm + rope
  (kernels/norm_rope/, every GPU arch; a layer's q and k as one dispatch), and
  `dflash::norm_rope_kv_write` -> the same with the layer's KV cache write.
- "gdn": export/lower_gdn.py, `dflash::gated_delta_rule` -> the Gated DeltaNet step (kernels/gdn/,
  every GPU arch; a call's GDN layers all on the kernel or all on IREE's lowering of the eager rule).

Which archs have which kernel is dflash_iree/arch.py's (export/lowered.py `has_kernel`).

`splice_file` returns what it replaced (the compile manifest keeps it as `splices`): per lowering its
entries (one per kernel shape, with the call count), and under "rules" and "iree" the arch's rules
and, per lowering, how many ops (weights, for the linears) went to IREE and why. A named op that no
lowering replaced (an arch or form with no rule for it) is refused, naming the op; `strict` also
refuses an op given to IREE on an arch that has its kernel (the guard test, tests/test_splice.py).

The MLIR helpers are in export/mlir.py. Needs the compile extra (iree-base-compiler's MLIR bindings), not torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from dflash_iree.errors import DFlashError

from .lowered import Lowered
from .lower_attention import ATTENTION_MIN_ROWS, lower_attention  # noqa: F401 (re-exported)
from .lower_linear import GEMM_M1_RUN, GEMM_MIN_M, GEMM_MIN_WEIGHT_BYTES, lower_linear  # noqa: F401
from .lower_gdn import lower_gdn
from .lower_norm_rope import lower_norm_rope
from .lower_topk import lower_topk
from .mlir import find_ops, list_operands, load, op_name, replace_with_values, strip_locations  # noqa: F401 (load)
from .ops import ATTENTION_OP, LINEAR_OP, LINEAR_RESIDUAL_OP, LINEAR_SWIGLU_OP


# Where each named op with a reference keeps it: the operand index (a list for `linear`).
REFERENCE = {LINEAR_OP: 2, LINEAR_RESIDUAL_OP: 3, LINEAR_SWIGLU_OP: 2, ATTENTION_OP: 4}


def to_iree(*names: str) -> Callable[[object, str], Lowered | None]:
    """A lowering that gives every named op of NAMES (keys of `REFERENCE`) to IREE, as if the model had
    no named op (benches: a build without those kernels)."""
    def lower(module, arch: str) -> Lowered | None:
        ops = [op for name in names for op in find_ops(module, "torch.operator", name)]
        for op in ops:
            ref = op.operands[REFERENCE[op_name(op)]]
            replace_with_values(op, list_operands(ref) if op_name(op) == LINEAR_OP else [ref])
        return Lowered(iree={"to_iree": len(ops)}, rule={"kernel": False}) if ops else None

    return lower


# name -> lowering; run in this order by `splice_file`.
LOWERINGS: dict[str, Callable[[object, str], Lowered | None]] = {
    "topk": lower_topk, "gemm": lower_linear, "attention": lower_attention, "norm_rope": lower_norm_rope,
    "gdn": lower_gdn}
SPLICES = LOWERINGS  # the name export/compile.py and the benches pass experiments under


def before_row_invariance(splices: dict | None = None) -> dict:
    """SPLICES (default `LOWERINGS`) with the GPU rules before row invariance: decode's lone weights,
    gate/up and the weights under GEMM_MIN_WEIGHT_BYTES on IREE's matmuls (`lower_linear`
    row_invariant=False), and decode's attention on IREE's op (ATTENTION_MIN_ROWS). Benches build
    the build before with it (bench/speed_8b.py, bench/row_invariance_check.py)."""
    out = dict(LOWERINGS if splices is None else splices)
    out["gemm"] = functools.partial(out["gemm"], row_invariant=False)
    out["attention"] = functools.partial(out["attention"], min_rows=ATTENTION_MIN_ROWS)
    return out


def splice_file(src: str | Path, dst: str | Path, arch: str, splices: dict | None = None,
                strict: bool = False) -> tuple[Path, list[str], dict]:
    """Run every lowering (`LOWERINGS`, or SPLICES in its place) on the module at SRC for ARCH (an
    ARCH name of dflash_iree/arch.py).

    When a lowering changed the module, the spliced copy is written to DST (bytecode) and (DST,
    flags, report) is returned; when none did, nothing is written and (SRC, [], {}) comes back, so a
    module without named ops compiles exactly as exported. The report: lowering name -> its
    entries (when it placed a kernel), "rules" -> lowering name -> the arch's rule, "iree" ->
    lowering name -> reason -> ops given to IREE (module docstring).

    Raises:
        DFlashError: from a lowering, a `torch.dflash.*` named op that no lowering replaced, with
            STRICT an op given to IREE on an arch that has its kernel, or a spliced module that
            does not verify.
    """
    from iree.compiler import ir

    module = load(src)
    flags: list[str] = []
    report: dict = {}
    for name, lowering in (LOWERINGS if splices is None else splices).items():
        got = lowering(module, arch)
        if got is None:
            continue
        flags += [f for f in got.flags if f not in flags]
        if got.entries:
            report[name] = got.entries
        report.setdefault("rules", {})[name] = got.rule
        if got.iree:
            report.setdefault("iree", {})[name] = got.iree
            if strict and got.rule.get("kernel"):
                raise DFlashError(f"splice: {name} gave ops to IREE on {arch}, which has the kernel: "
                                  + "; ".join(f"{n} x {why}" for why, n in got.iree.items()))
    left = sorted({op_name(op) for op in find_ops(module, "torch.operator") if op_name(op).startswith("torch.dflash.")})
    if left:
        raise DFlashError(f"splice: {', '.join(left)} left in the module: no lowering for it on {arch} "
                          "(export/splice.py LOWERINGS), and iree-compile cannot lower a custom op")
    if not report:
        return Path(src), [], {}
    try:
        module.operation.verify()
    except ir.MLIRError as e:
        raise DFlashError(f"splice: the spliced module does not verify: {e}") from None
    strip_locations(module)  # the added text carries its parse locations ("-":line:col)
    with open(dst, "wb") as f:
        module.operation.write_bytecode(f)
    return Path(dst), flags, report
