"""Export the target and the drafter into one MLIR module: torch.export + iree-turbine `aot`.

One module holds every entry point of both models, so the target's embedding and lm_head (which
the drafter uses too) are bound once. What the module looks like from outside:

- Weights are external named parameters, never inlined: scope `target` with the target's
  safetensors keys, scope `drafter` with the drafter's keys (iree-turbine's ExternalTensorTrait).
- The two KV caches (the target's `kv_cache`, the drafter's `ctx_cache`) are mutable module
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
- The leading dim S of every argument is the stream count (1 for now).

The model is built on the meta device, so exporting the 8B shapes allocates no weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from dflash_iree.config import DrafterConfig, TargetConfig
from dflash_iree.manifest import DTYPES, KV_PAGE  # noqa: F401 (KV_PAGE: cache rows per page, read from here too)

from .dflash import DFlashDrafter
from .qwen3 import Qwen3
from .sampling import Sampling
from .mlir import strip_locations

TARGET_SCOPE = "target"
DRAFTER_SCOPE = "drafter"
_STATE_SCOPE = "state"  # transient: these globals get a zero initializer after import

DTYPE_NAMES = {getattr(torch, d.torch): name for name, d in DTYPES.items()}  # torch dtype -> manifest name
_TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One argument or result: a name, a shape (ints, or the name of a dynamic dim) and a dtype name."""

    name: str
    shape: tuple
    dtype: str

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class EntryPoint:
    """A function of the compiled module."""

    name: str
    model: str  # "target" | "drafter"
    args: tuple[TensorSpec, ...]
    results: tuple[TensorSpec, ...]
    doc: str
    writes: tuple[str, ...] = ()  # the last args: the call writes these outputs into the caller's buffers

    def to_dict(self) -> dict:
        return {"name": self.name, "model": self.model, "doc": self.doc, "writes": list(self.writes),
                "args": [a.to_dict() for a in self.args], "results": [r.to_dict() for r in self.results]}


@dataclass(frozen=True)
class ExportShapes:
    """The static facts of an export: what the manifest records and the runtime relies on."""

    streams: int
    block_size: int
    max_context: int
    dtype: str  # "bf16" | "f16" | "f32"
    tap_width: int  # n_taps * hidden_size
    kv_page: int = KV_PAGE
    draft_top_k: int = 0  # K of the `draft_topk` entry point; 0: no such entry point

    @property
    def dims(self) -> dict:
        """Dynamic dims: name -> inclusive range and meaning."""
        c = self.max_context
        return {
            "T": {"min": 1, "max": c, "doc": "prompt tokens in one prefill call"},
            "R": {"min": 1, "max": c, "doc": "context rows in one absorb call"},
            "P": {"min": 1, "max": c // self.kv_page,
                  "doc": f"cache pages attention reads: pages.shape[0] * {self.kv_page} rows, "
                         "at least the end of this call's rows (target) or the block start (draft)"},
        }


def export_shapes(plan) -> ExportShapes:
    """ExportShapes of a compile plan (export/compile.py `Plan`)."""
    return ExportShapes(plan.streams, plan.block_size, plan.max_context, plan.dtype,
                        plan.drafter.num_taps * plan.target.hidden_size, draft_top_k=plan.draft_top_k)


class Pair(nn.Module):
    """The root module of the export: the target and the drafter side by side, and the K of
    `draft_topk` (0: none)."""

    def __init__(self, target: Qwen3, drafter: DFlashDrafter, draft_top_k: int = 0):
        super().__init__()
        self.target = target
        self.drafter = drafter
        self.draft_top_k = draft_top_k


def build_pair(tcfg: TargetConfig, dcfg: DrafterConfig, max_context: int, block_size: int, streams: int,
               dtype: torch.dtype, draft_top_k: int = 0, attention: str = "fused") -> Pair:
    """Target and drafter on the meta device (no weights), in eval mode, without gradients.

    attention: the attention form (export/qwen3.py `ATTENTION`) the backend runs best.
    """
    with torch.device("meta"):
        target = Qwen3(tcfg, max_context, dcfg.target_layer_ids, streams, dtype, attention=attention)
        drafter = DFlashDrafter(dcfg, max_context, block_size, streams, dtype, attention=attention)
    pair = Pair(target, drafter, draft_top_k).eval()
    pair.requires_grad_(False)
    return pair


def parameter_table(pair: Pair) -> dict[str, dict[str, dict]]:
    """scope -> key -> {shape, dtype}: the checkpoint tensors the module binds (tied ones once)."""
    out = {}
    for scope, module in ((TARGET_SCOPE, pair.target), (DRAFTER_SCOPE, pair.drafter)):
        out[scope] = {k: {"shape": list(p.shape), "dtype": DTYPE_NAMES[p.dtype]} for k, p in module.named_parameters()}
    return out


def entry_points(shapes: ExportShapes, sampled: bool = True) -> list[EntryPoint]:
    """Every function of the module, in export order.

    The target's steps come greedy (argmax) and, when `sampled`, as `*_sampled` variants that take
    per-stream temperature, top_k, top_p and seed tensors (export/sampling.py); a stream with
    temperature 0 is greedy in those too. Greedy requests use the plain ones, which skip the ~64
    vocab-wide reductions per row that keyed top-k / top-p sampling costs. The drafter's `draft`
    comes as `draft_sampled` too, which drafts with the target's keyed noise (coupled drafting), as
    `verify_draft_sampled` drafts its next block. With `shapes.draft_top_k` K > 0, `draft_topk`
    (and `draft_topk_sampled`) follows: the same draft, plus its top-K.
    """
    S, B, N, dt = shapes.streams, shapes.block_size, shapes.tap_width, shapes.dtype
    tokens = lambda t: TensorSpec("tokens", (S, t), "i64")  # noqa: E731
    start = TensorSpec("start", (S,), "i64")
    pages = TensorSpec("pages", ("P",), "i8")
    sampling = (TensorSpec("temperature", (S,), "f32"), TensorSpec("top_k", (S,), "i64"),
                TensorSpec("top_p", (S,), "f32"), TensorSpec("seed", (S,), "i64"))
    chosen = lambda t: TensorSpec("chosen", (S, t), "i64")  # noqa: E731
    taps = lambda t: TensorSpec("taps", (S, t, N), dt)  # noqa: E731
    n_draft = TensorSpec("n_draft", (S,), "i64")
    steps = [  # name, inputs, outputs written into the caller's buffers, results, doc
        ("prefill", (tokens("T"), start, pages), (chosen(1),), (taps("T"),),
         "Run the prompt (or a chunk of it) at positions [start, start+T) into the KV cache; chosen is "
         "the target's token after the last row; taps (keep on the device) feed `absorb`."),
        ("verify", (tokens(B), start, pages), (chosen(B),), (taps(B),),
         "Run the block [anchor, drafts] at [start, start+B); chosen[:, i] is the target's token after "
         "block row i; taps (keep on the device) feed the next `draft`."),
        ("decode", (tokens(1), start, pages), (chosen(1),), (),
         "Plain decoding: one token at position start."),
        ("verify_draft", (tokens(B), start, n_draft, pages), (TensorSpec("round", (S, 2 * B), "i64"),), (taps(B),),
         "One speculative round in one call: `verify` the block [anchor, drafts] at [start, start+B), "
         "count the accepted drafts on the device (leading block[i+1] == chosen[i], i < n_draft), then "
         "`draft` the next block after the bonus token from the accepted rows' taps. round[:, :B] is "
         "chosen, round[:, B:2B-1] the next draft, round[:, 2B-1] the accepted rows (accepted + 1); "
         "taps (keep on the device) serve a separate `draft` when the host commits another count."),
    ]
    out = []
    for suffix, extra in (("", ()), ("_sampled", sampling)) if sampled else (("", ()),):
        for name, inputs, writes, results, doc in steps:
            out.append(EntryPoint(name + suffix, "target", inputs + extra + writes, results, doc,
                                  tuple(w.name for w in writes)))
    out.append(EntryPoint(
        "absorb", "drafter", (taps("R"), start), (TensorSpec("ctx_len", (S,), "i64"),),
        "Project R context rows (the target's taps at positions [start, start+R)) into the drafter's "
        "context cache; returns start + R."))
    draft_args = (taps(B), TensorSpec("ctx_start", (S,), "i64"), TensorSpec("n_valid", (S,), "i64"),
                  TensorSpec("anchor", (S,), "i64"), pages)
    draft = TensorSpec("draft", (S, B - 1), "i64")
    draft_doc = ("Absorb the first n_valid rows of the last verify's taps (positions [ctx_start, ctx_start+n_valid); "
                 "rows past n_valid are ignored), then draft block_size-1 tokens after the anchor at position "
                 "ctx_start+n_valid. After prefill, pass any taps with n_valid = 0.")
    coupled = (" Each draft token is chosen with the target's keyed noise at its position (export/sampling.py "
               "`draft_tokens`: coupled drafting); a stream with temperature 0 drafts greedily.")
    K = shapes.draft_top_k
    top = (draft, TensorSpec("topk_ids", (S, B - 1, K), "i32"), TensorSpec("topk_logprobs", (S, B - 1, K), "f32"))
    top_doc = (f" At each drafted position also the drafter's {K} best ids (descending logit, equal logits by lower "
               "id) and log_softmax(logits / temperature) at them, from the top-K dispatch of kernels/.")
    for suffix, extra in (("", ()), ("_sampled", sampling)) if sampled else (("", ()),):
        what = coupled if extra else " The draft is greedy."
        out.append(EntryPoint("draft" + suffix, "drafter", draft_args + extra + (draft,), (), draft_doc + what,
                              ("draft",)))
        if K:
            temperature = () if extra else (TensorSpec("temperature", (S,), "f32"),)
            out.append(EntryPoint(
                "draft_topk" + suffix, "drafter", draft_args + temperature + extra + top, (),
                f"`draft{suffix}`." + top_doc + (" temperature is the request's." if extra else
                                                 " temperature > 0; 1 gives the drafter's own distribution."),
                tuple(t.name for t in top)))
    return out


def _read_len(pages: torch.Tensor) -> int:
    return pages.shape[0] * KV_PAGE


def _step(m: Pair, tokens, start, pages, sampling: Sampling | None, last_only: bool = False):
    chosen, _, taps = m.target(tokens, start, sampling, read_len=_read_len(pages), last_only=last_only)
    return chosen, taps


def _step_into(m: Pair, tokens, start, pages, sampling: Sampling | None, chosen, last_only: bool = False):
    """`_step` with its chosen tokens copied into the caller's `chosen`; returns the taps."""
    c, taps = _step(m, tokens, start, pages, sampling, last_only)
    chosen.copy_(c)
    return taps


# The exported bodies; torch.export names the arguments after these parameters. An output the host
# reads is copied into its argument (IREE writes a mutated argument in place, no result of its own);
# a body with nothing left to return returns an empty tuple (the importer refuses None).
def prefill(m, tokens, start, pages, chosen):
    return _step_into(m, tokens, start, pages, None, chosen, last_only=True)


def prefill_sampled(m, tokens, start, pages, temperature, top_k, top_p, seed, chosen):
    return _step_into(m, tokens, start, pages, Sampling(temperature, top_k, top_p, seed), chosen, last_only=True)


def verify(m, tokens, start, pages, chosen):
    return _step_into(m, tokens, start, pages, None, chosen)


def verify_sampled(m, tokens, start, pages, temperature, top_k, top_p, seed, chosen):
    return _step_into(m, tokens, start, pages, Sampling(temperature, top_k, top_p, seed), chosen)


def decode(m, tokens, start, pages, chosen):
    _step_into(m, tokens, start, pages, None, chosen)
    return ()


def decode_sampled(m, tokens, start, pages, temperature, top_k, top_p, seed, chosen):
    _step_into(m, tokens, start, pages, Sampling(temperature, top_k, top_p, seed), chosen)
    return ()


def accepted_drafts(block: torch.Tensor, chosen: torch.Tensor, n_draft: torch.Tensor) -> torch.Tensor:
    """The chain rule of `dflash_iree.acceptance.accept_length`, on the device.

    Args:
        block: int64 [S, B], [anchor, drafts..., padding].
        chosen: int64 [S, B], the target's token after each block row.
        n_draft: int64 [S], real drafts in the block (rows past 1 + n_draft are padding).

    Returns:
        int64 [S]: the number of leading i < n_draft with block[:, i + 1] == chosen[:, i].
    """
    B = block.shape[1]
    i = torch.arange(B - 1, dtype=torch.int64, device=block.device)[None, :]
    miss = (block[:, 1:] != chosen[:, :-1]) | (i >= n_draft[:, None])
    # The first miss, or B - 1 when every row matches: a max over reversed indices rather than a
    # cumprod (IREE needs no scan) or an integer min (which IREE 3.13 miscompiled on CUDA, see
    # export/sampling.py `argmax`).
    return (B - 1) - torch.amax(torch.where(miss, (B - 1) - i, 0), 1)


def _verify_then_draft(m, tokens, start, n_draft, pages, sampling, round_):
    chosen, taps = _step(m, tokens, start, pages, sampling)
    n_valid = accepted_drafts(tokens, chosen, n_draft) + 1
    bonus = torch.gather(chosen, 1, (n_valid - 1)[:, None])[:, 0]
    draft = m.drafter(m.target, taps, start, n_valid, bonus, read_len=_read_len(pages), sampling=sampling)[0]
    # one int64 row, so a round costs one read of the host's
    round_.copy_(torch.cat([chosen, draft, n_valid[:, None]], 1))
    return taps


def verify_draft(m, tokens, start, n_draft, pages, round):  # noqa: A002 (the manifest's name)
    return _verify_then_draft(m, tokens, start, n_draft, pages, None, round)


def verify_draft_sampled(m, tokens, start, n_draft, pages, temperature, top_k, top_p, seed, round):  # noqa: A002
    return _verify_then_draft(m, tokens, start, n_draft, pages, Sampling(temperature, top_k, top_p, seed), round)


def absorb(m, taps, start):
    m.drafter.absorb(taps, start)
    return start + taps.shape[1]


def _draft_into(m, taps, ctx_start, n_valid, anchor, pages, sampling, draft):
    ids, logits = m.drafter(m.target, taps, ctx_start, n_valid, anchor, read_len=_read_len(pages), sampling=sampling)
    draft.copy_(ids)
    return logits


def _draft_topk_into(m, args, temperature, sampling, draft, topk_ids, topk_logprobs):
    logits = _draft_into(m, *args, sampling, draft)
    top_ids, top_lps = m.drafter.top_k(logits, temperature, m.draft_top_k)
    topk_ids.copy_(top_ids)
    topk_logprobs.copy_(top_lps)
    return ()


def draft(m, taps, ctx_start, n_valid, anchor, pages, draft):
    _draft_into(m, taps, ctx_start, n_valid, anchor, pages, None, draft)
    return ()


def draft_sampled(m, taps, ctx_start, n_valid, anchor, pages, temperature, top_k, top_p, seed, draft):
    _draft_into(m, taps, ctx_start, n_valid, anchor, pages, Sampling(temperature, top_k, top_p, seed), draft)
    return ()


def draft_topk(m, taps, ctx_start, n_valid, anchor, pages, temperature, draft, topk_ids, topk_logprobs):
    return _draft_topk_into(m, (taps, ctx_start, n_valid, anchor, pages), temperature, None, draft, topk_ids,
                            topk_logprobs)


def draft_topk_sampled(m, taps, ctx_start, n_valid, anchor, pages, temperature, top_k, top_p, seed, draft,
                       topk_ids, topk_logprobs):
    return _draft_topk_into(m, (taps, ctx_start, n_valid, anchor, pages), temperature,
                            Sampling(temperature, top_k, top_p, seed), draft, topk_ids, topk_logprobs)


_BODIES = {f.__name__: f for f in (prefill, prefill_sampled, verify, verify_sampled, decode, decode_sampled,
                                   verify_draft, verify_draft_sampled, absorb, draft, draft_sampled, draft_topk,
                                   draft_topk_sampled)}


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


def export_module(pair: Pair, shapes: ExportShapes, sampled: bool = True, log=None, only=None):
    """Export every entry point of `pair` into one MLIR module.

    Args:
        log: called with a progress line after each traced entry point and after the import.
        only: names of the entry points to export (tests); None for all.

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
    # The caches are non-persistent buffers: tag them so the importer emits a global without
    # reading their (meta) data; _finish_globals then gives them a zero initializer.
    ExternalTensorTrait(_STATE_SCOPE, "target.kv_cache").set(pair.target.kv_cache)
    ExternalTensorTrait(_STATE_SCOPE, "drafter.ctx_cache").set(pair.drafter.ctx_cache)

    dims = {name: torch.export.Dim(name, min=d["min"], max=d["max"]) for name, d in shapes.dims.items()}
    entries = [e for e in entry_points(shapes, sampled) if only is None or e.name in only]
    fxb = aot.FxProgramsBuilder(pair)
    with aot.decompositions.extend_aot_decompositions() as table:
        table[torch.ops.aten.linear.default] = _linear_2d
        for entry in entries:
            examples = [_example(a, dims) for a in entry.args]
            fxb.export_program(_BODIES[entry.name], name=entry.name, args=tuple(e for e, _ in examples),
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
    - `torch.constant.device "meta"` (the export ran on meta tensors) becomes "cpu": the device of a
      created tensor means nothing to IREE, but some lowerings refuse "meta".
    """
    from iree.compiler import ir

    with module_op.context, ir.Location.unknown():
        for op in module_op.regions[0].blocks[0].operations:
            if op.operation.name != "util.global" or "initial_value" not in op.attributes:
                continue
            if f'"{_STATE_SCOPE}"::' not in str(op.attributes["initial_value"]):
                continue
            ty = ir.TypeAttr(op.attributes["type"]).value
            zero = ir.FloatAttr.get(ir.RankedTensorType(ty).element_type, 0.0)
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
