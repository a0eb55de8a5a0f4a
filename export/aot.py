"""Export the target and the drafter into one MLIR module: torch.export + iree-turbine `aot`.

One module holds every entry point of both models, so the target's embedding and lm_head (which
the drafter uses too) are bound once. What the module looks like from outside:

- Weights are external named parameters, never inlined: scope `target` with the target's
  safetensors keys, scope `drafter` with the drafter's keys (iree-turbine's ExternalTensorTrait).
- The two KV caches (the target's `kv_cache`, the drafter's `ctx_cache`), and a hybrid target's
  recurrent state slots (export/recurrent_state.py), are mutable module
  globals initialized to zeros by the module itself: they are neither function arguments (which
  IREE copies in full on every call, shared/notes/iree.md section 3) nor checkpoint parameters.
  Rollback is by length: the runtime keeps the committed length and passes `start`.
- Attention reads the cache only up to a length the caller chooses, in pages of `KV_PAGE` rows:
  the shape of the `pages` argument (its contents are ignored) is the dynamic dim that bounds
  every cache read, so decode cost follows the context, not `max_context`.
- Only [S, K]-sized data leaves a production entry point: chosen tokens, draft ids (and, from
  `draft_topk`, the draft's top-K ids and log-probs), and the taps, which the runtime keeps on the
  device and passes back to `absorb` / `draft`.
- What the host reads is not returned but written into buffers the caller passes, the last
  arguments (`EntryPoint.writes`): the runtime passes pinned host buffers, which it reads as soon as
  the call is done, instead of queueing a copy of a returned device buffer and waiting for it
  (docs/architecture.md, "Results written into the caller's buffers"). Only the taps (and `absorb`'s
  count) are returned.
- A sampled request drafts with the target's own keyed noise (`draft_sampled`, `draft_topk_sampled`
  and `verify_draft_sampled`'s next draft; export/sampling.py `draft_tokens`), so the draft is the
  token the target would draw if the drafter's logits were its own; greedy requests draft by argmax.
- `verify_draft` is a whole speculative round in one call (verify, the acceptance count on the
  device, the next draft), so a round costs one call and one read of the host's instead of two; the host's
  `accept_length` stays the rule, and the runtime checks the device's count against it every round.
- Every custom kernel is a named op of export/ops.py (the linears, the block attention, the head
  norm + rope, and `draft_topk`'s top-K, when compiled with a top-K count), which export/splice.py
  lowers per arch to the kernels of kernels/ or to IREE's own ops.
- The leading dim S of every argument is the stream count (`--streams`): each stream its own
  `start`, sampling parameters and `n_draft`; a module of S > 1 streams also has a per-stream
  prefill and absorb (export/stream_entry_points.py), so that a request joins without touching the others,
  and verify rounds of fewer rows with the draft's confidence (export/depth_entry_points.py).

The functions themselves, each one's signature and body, are in export/entry_points.py. The model
is built on the meta device, so exporting the 8B shapes allocates no weights.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from dflash_iree.config import DrafterConfig, TargetConfig
from dflash_iree.config_qwen35 import HybridConfig
from dflash_iree.errors import DFlashError
from dflash_iree.manifest import DTYPES, KV_PAGE  # noqa: F401 (KV_PAGE: cache rows per page, read from here too)

from .dflash import DFlashDrafter
from .dflash2 import drafter_class
from .qwen3 import Qwen3
from .qwen35 import Qwen35
from .entry_points import BODIES, EntryPoint, ExportShapes, TensorSpec, entry_points, export_shapes  # noqa: F401
from .mlir import strip_locations
from .depth_entry_points import depth_body
from .stream_entry_points import STREAM_BODIES

TARGET_SCOPE = "target"
DRAFTER_SCOPE = "drafter"
_STATE_SCOPE = "state"  # transient: these globals get a zero initializer after import

DTYPE_NAMES = {getattr(torch, d.torch): name for name, d in DTYPES.items()}  # torch dtype -> manifest name
_TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}



class Pair(nn.Module):
    """The root module of the export: the target and the drafter side by side, and the K of
    `draft_topk` (0: none)."""

    def __init__(self, target: Qwen3, drafter: DFlashDrafter, draft_top_k: int = 0):
        super().__init__()
        self.target = target
        self.drafter = drafter
        self.draft_top_k = draft_top_k


def build_pair(tcfg: TargetConfig, dcfg: DrafterConfig, max_context: int, block_size: int, streams: int,
               dtype: torch.dtype, draft_top_k: int = 0, attention: str = "fused", on_load=()) -> Pair:
    """Target and drafter on the meta device (no weights), in eval mode, without gradients.

    attention: the attention form (export/qwen3.py `ATTENTION`) the backend runs best.
    on_load: the scopes ("target", "drafter") quantized on load (--target-bits 4 / --drafter-bits 4):
        their float linears become the packed modules an MLX-written checkpoint of that geometry
        gives (export/quantized.py `swap_on_load`), scales and biases in the config's dtype.
    A hybrid target (`HybridConfig`) is a `Qwen35` with block_size recurrent state slots (the rows
    of a verify it rolls back within, export/recurrent_state.py).
    """
    with torch.device("meta"):
        if isinstance(tcfg, HybridConfig):
            target = Qwen35(tcfg, max_context, dcfg.target_layer_ids, streams, dtype, attention=attention,
                            state_slots=block_size)
        else:
            target = Qwen3(tcfg, max_context, dcfg.target_layer_ids, streams, dtype, attention=attention)
        drafter = drafter_class(dcfg)(dcfg, max_context, block_size, streams, dtype, attention=attention)
        if dcfg.dflash2 is not None:  # one top-K shape in the module (export/dflash2.py CandidateSelector)
            drafter.candidate_selector.op_top_k = max(dcfg.dflash2.selector_top_k, draft_top_k)
    # A 4-bit checkpoint's packed layers become export/quantized.py's modules, named and typed as the
    # checkpoint stores them (its safetensors headers only are read); the dequantization is in the graph.
    from .load import read_quantized, tie_embeddings, torch_dtype
    from .quantized import swap_on_load

    target = tie_embeddings(read_quantized(target, tcfg.folder, dtype))
    drafter = read_quantized(drafter, dcfg.folder, dtype)
    for scope, module, cfg in (("target", target, tcfg), ("drafter", drafter, dcfg)):
        if scope in on_load:
            swap_on_load(module, torch_dtype(cfg.dtype), dtype)
    pair = Pair(target, drafter, draft_top_k).eval()
    pair.requires_grad_(False)
    return pair


def state_globals(pair: Pair) -> dict[str, torch.Tensor]:
    """name -> buffer of every module-initialized mutable global: the two KV caches and, for a
    hybrid target, its recurrent state slots (`target.state.gdn_slots`, `conv_slots`, `slot_start`)."""
    out = {"target.kv_cache": pair.target.kv_cache}
    if isinstance(pair.target, Qwen35):
        out.update({f"target.state.{n}": b for n, b in pair.target.state.named_buffers()})
    out["drafter.ctx_cache"] = pair.drafter.ctx_cache
    return out


def parameter_table(pair: Pair) -> dict[str, dict[str, dict]]:
    """scope -> key -> {shape, dtype}: the checkpoint tensors the module binds (tied ones once)."""
    from .quantized import QuantLinear

    out = {}
    for scope, module in ((TARGET_SCOPE, pair.target), (DRAFTER_SCOPE, pair.drafter)):
        out[scope] = {k: {"shape": list(p.shape), "dtype": DTYPE_NAMES[p.dtype]} for k, p in module.named_parameters()}
        for prefix, m in module.named_modules():  # MLX's uint32 words: bound as stored, held as int32
            if isinstance(m, QuantLinear):
                for name, stored in m.stored_dtypes.items():
                    if f"{prefix}.{name}" in out[scope]:
                        out[scope][f"{prefix}.{name}"]["dtype"] = stored
    return out



def _linear_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """aten.linear as a 2-D matmul against the transposed weight.

    torch-mlir lowers a linear on [S, T, H] to a weight transpose, a broadcast and a batch_matmul.
    IREE cannot fold that transpose into the matmul, so it hoists a transposed copy of every weight
    into a module initializer (tens of GiB for 8B shapes, once per entry point that uses it) or, with
    hoisting off, transposes every weight on every call. As [S*T, H] @ W^T the transpose folds into
    the matmul and the parameters are read in place.
    """
    y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t()).reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _example(spec: TensorSpec, dims: dict[str, torch.export.Dim]):
    """A meta example tensor (dynamic dims at size 2) and its dynamic-shape entry."""
    shape = [2 if isinstance(d, str) else d for d in spec.shape]
    dynamic = {i: dims[d] for i, d in enumerate(spec.shape) if isinstance(d, str)}
    return torch.zeros(shape, dtype=_TORCH_DTYPES[spec.dtype], device="meta"), dynamic


def export_module(pair: Pair, shapes: ExportShapes, sampled: bool = True, log=None, only=None, debug=()):
    """Export every entry point of `pair` into one MLIR module.

    Args:
        log: called with a progress line after each traced entry point and after the import.
        only: names of the entry points to export (tests); None for all.
        debug: (EntryPoint, body) pairs exported after those: functions that only a test or a probe
            calls (tests/test_row_invariance.py returns the logits that production keeps on the device).

    Returns:
        (iree-turbine's ExportOutput: `.save_mlir(path)` writes the module, the entry points).
    """
    import iree.turbine.aot as aot
    from iree.turbine.aot.tensor_traits import ExternalTensorTrait

    log = log or (lambda msg: None)
    # Parameters are external, named by their checkpoint keys: what aot.externalize_module_parameters
    # does, except that it tags a tied tensor (lm_head.weight is model.embed_tokens.weight) under each
    # of its names, the last one winning; named_parameters() yields it once, under the key a tied
    # checkpoint stores.
    for scope, module in ((TARGET_SCOPE, pair.target), (DRAFTER_SCOPE, pair.drafter)):
        for name, param in module.named_parameters():
            ExternalTensorTrait(scope, name).set(param)
    # The caches (and a hybrid's state slots) are non-persistent buffers: tag them so the importer
    # emits a global without reading their (meta) data; _finish_globals then gives them zeros.
    for name, buf in state_globals(pair).items():
        ExternalTensorTrait(_STATE_SCOPE, name).set(buf)

    dims = {name: torch.export.Dim(name, min=d["min"], max=d["max"]) for name, d in shapes.dims.items()}
    entries = [e for e in entry_points(shapes, sampled) if only is None or e.name in only]
    debug_bodies = {e.name: body for e, body in debug}
    entries += [e for e, _ in debug]
    fxb = aot.FxProgramsBuilder(pair)
    with aot.decompositions.extend_aot_decompositions() as table:
        table[torch.ops.aten.linear.default] = _linear_2d
        for entry in entries:
            examples = [_example(a, dims) for a in entry.args]
            body = (debug_bodies.get(entry.name) or BODIES.get(entry.name) or STREAM_BODIES.get(entry.name)
                    or depth_body(entry.name))
            fxb.export_program(body, name=entry.name, args=tuple(e for e, _ in examples),
                               dynamic_shapes=tuple(d for _, d in examples), strict=False)
            log(f"export: traced {entry.name}")
    output = aot.export(fxb, module_name="dflash", import_symbolic_shape_expressions=True)
    _finish_globals(output.mlir_module)
    strip_locations(output.mlir_module)
    log(f"import: {len(entries)} entry points in one MLIR module")
    return output, entries


def _finish_globals(module_op) -> None:
    """Post-import fixes on the module, in place.

    - Cache globals (scope `state`) get a zero splat initializer: module state, no parameter.
      Two of one type get +0.0 and -0.0: IREE 3.13 gives mutable globals of one type and one splat
      initial value one storage, so that writing one writes the other (experiments/2026-12-05-
      global-aliasing/: the hybrid demo target's two attention layers' KV cache and its 2-layer
      drafter's context cache, [1, 2, 2, 512, 128] bf16 both, drafted != plain). A third of one type,
      or two integer ones, has no such value left and is refused.
    - `torch.constant.device "meta"` (the export ran on meta tensors) becomes "cpu": the device of a
      created tensor means nothing to IREE, but some lowerings refuse "meta".
    """
    from iree.compiler import ir

    with module_op.context, ir.Location.unknown():
        seen: dict[str, list[str]] = {}  # type -> names of the state globals of that type so far
        for op in module_op.regions[0].blocks[0].operations:
            if op.operation.name != "util.global" or "initial_value" not in op.attributes:
                continue
            if f'"{_STATE_SCOPE}"::' not in str(op.attributes["initial_value"]):
                continue
            ty = ir.TypeAttr(op.attributes["type"]).value
            same = seen.setdefault(str(ty), [])
            same.append(ir.StringAttr(op.attributes["sym_name"]).value)
            element = ir.RankedTensorType(ty).element_type
            if len(same) > (1 if isinstance(element, ir.IntegerType) else 2):
                raise DFlashError(f"module state {', '.join(same)} are all {ty}: IREE 3.13 would give them one "
                                  f"storage (export/aot.py _finish_globals); this pair cannot be compiled safely yet")
            zero = (ir.IntegerAttr.get(element, 0) if isinstance(element, ir.IntegerType)
                    else ir.FloatAttr.get(element, 0.0 if len(same) == 1 else -0.0))
            op.attributes["initial_value"] = ir.DenseElementsAttr.get_splat(ty, zero)

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        if child.operation.name == "torch.constant.device":
                            child.attributes["value"] = ir.StringAttr.get("cpu")
                        walk(child.operation)

        walk(module_op.operation if hasattr(module_op, "operation") else module_op)


def shapes_dict(shapes: ExportShapes) -> dict:
    d = asdict(shapes)
    d["dims"] = shapes.dims
    return d
