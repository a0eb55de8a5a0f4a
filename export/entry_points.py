"""The compiled module's functions: each entry point's signature (`entry_points`, what the manifest
records) and its body (what export/aot.py exports under that name).

Every body takes the root `Pair` module (export/aot.py) first, then the entry point's arguments in
manifest order; the outputs the host reads are written into the caller's buffers, the last arguments
(`EntryPoint.writes`). A sampled request's target step chooses with keyed noise and its drafts use
the same noise (export/sampling.py `choose_tokens`, `draft_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_iree.manifest import KV_PAGE

from .sampling import Sampling

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
    decode_steps: int = 0  # k of the `decode_steps` entry point (k >= 2 plain steps a call); 0: none
    # prefill's static row count (a hybrid target's chunk: its DeltaNet loops unroll over the
    # rows); 0: prefill takes the dynamic T
    prefill_chunk: int = 0

    @property
    def dims(self) -> dict:
        """Dynamic dims: name -> inclusive range and meaning (no T with a static `prefill_chunk`)."""
        c = self.max_context
        prompt = {} if self.prefill_chunk else {"T": {"min": 1, "max": c, "doc": "prompt tokens in one prefill call"}}
        slot = {} if self.streams == 1 else {"Q": {"min": 1, "max": self.streams,
                                                   "doc": "a one-stream call's slot + 1 (the `stream` argument's shape)"}}
        return {
            **prompt, **slot,
            "R": {"min": 1, "max": c, "doc": "context rows in one absorb call"},
            "P": {"min": 1, "max": c // self.kv_page,
                  "doc": f"cache pages attention reads: pages.shape[0] * {self.kv_page} rows, "
                         "at least the end of this call's rows (target) or the block start (draft)"},
        }


def export_shapes(plan) -> ExportShapes:
    """ExportShapes of a compile plan (export/compile.py `Plan`)."""
    return ExportShapes(plan.streams, plan.block_size, plan.max_context, plan.dtype,
                        plan.drafter.num_taps * plan.target.hidden_size, draft_top_k=plan.draft_top_k,
                        prefill_chunk=plan.prefill_chunk, decode_steps=plan.decode_steps)



def entry_points(shapes: ExportShapes, sampled: bool = True) -> list[EntryPoint]:
    """Every function of the module, in export order.

    The target's steps come greedy (argmax) and, when `sampled`, as `*_sampled` variants that take
    per-stream temperature, top_k, top_p and seed tensors (export/sampling.py); a stream with
    temperature 0 is greedy in those too. Greedy requests use the plain ones, which skip the ~64
    vocab-wide reductions per row that keyed top-k / top-p sampling costs. The drafter's `draft`
    comes as `draft_sampled` too, which drafts with the target's keyed noise (coupled drafting), as
    `verify_draft_sampled` drafts its next block. With `shapes.draft_top_k` K > 0, `draft_topk`
    (and `draft_topk_sampled`) follows: the same draft, plus its top-K. With S > 1 streams, the
    per-stream prefill and absorb of export/stream_entry_points.py come last, then the rounds of
    fewer rows of export/depth_entry_points.py.
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
    T = shapes.prefill_chunk or "T"
    steps = [  # name, inputs, outputs written into the caller's buffers, results, doc
        ("prefill", (tokens(T), start, pages), (chosen(1),), (taps(T),),
         "Run the prompt (or a chunk of it) at positions [start, start+T) into the KV cache; chosen is "
         "the target's token after the last row; taps (keep on the device) feed `absorb`."
         + (f" T is {T} rows (a hybrid target's prefill chunk); the runtime runs a prompt's remainder "
            "through `verify`." if shapes.prefill_chunk else "")),
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
    k = shapes.decode_steps
    if k:
        steps.insert(3, ("decode_steps", (tokens(1), start, pages), (chosen(k), TensorSpec("last", (S, 1), "i64")), (),
                         f"Plain greedy decoding, {k} steps in one call: step i (at start + i) takes step i - 1's "
                         f"token on the device; chosen[:, i] is step i's token, last the final one (the next "
                         f"call's tokens). pages cover start + {k} rows. Greedy only: a sampled request decodes "
                         "one step a call."))
    out = []
    for suffix, extra in (("", ()), ("_sampled", sampling)) if sampled else (("", ()),):
        for name, inputs, writes, results, doc in steps:
            if name == "decode_steps" and extra:
                continue  # greedy only: k sampled steps trace k vocab-wide samplers, minutes at 8B
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
    from .depth_entry_points import depth_entry_points  # here: they build on this file's types
    from .stream_entry_points import stream_entry_points

    return out + stream_entry_points(shapes, sampled) + depth_entry_points(shapes, sampled)


def _read_len(pages: torch.Tensor) -> int:
    return pages.shape[0] * KV_PAGE


def _step(m, tokens, start, pages, sampling: Sampling | None, last_only: bool = False):
    chosen, _, taps = m.target(tokens, start, sampling, read_len=_read_len(pages), last_only=last_only)
    return chosen, taps


def _step_into(m, tokens, start, pages, sampling: Sampling | None, chosen, last_only: bool = False):
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


def _decode_steps_into(m, tokens, start, pages, sampling: Sampling | None, chosen, last=None) -> None:
    """k = chosen.shape[1] plain decode steps in one call: step 0 takes tokens [S, 1] int64, step i
    (at start + i) step i - 1's chosen token, on the device; chosen [S, k] int64 gets the k tokens
    and `last` [S, 1] the final one. Each step is `decode`'s graph (the same ops at one row), and
    attention reads the pages sized for the last step: masked keys add exact zeros, as in verify."""
    tok, out = tokens, []
    for i in range(chosen.shape[1]):
        tok, _ = _step(m, tok, start + i, pages, sampling)
        out.append(tok)
    chosen.copy_(torch.cat(out, dim=1))
    if last is not None:
        last.copy_(tok)


def decode_steps(m, tokens, start, pages, chosen, last=None):
    _decode_steps_into(m, tokens, start, pages, None, chosen, last)
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


def verify_then_draft(tokens, n_draft, chosen, taps, draft, round_):
    """The fused round after the target's verify step: the device's acceptance over n_draft [S]
    drafts of tokens [S, B] given the target's chosen [S, B], then `draft(n_valid, bonus)` (the
    drafter's next block [S, B - 1] after the bonus token), packed into round_ [S, 2B]: chosen,
    draft, n_valid. Returns taps. Shared by `verify_draft` and export/stream_entry_points.py's
    one-stream form."""
    n_valid = accepted_drafts(tokens, chosen, n_draft) + 1
    bonus = torch.gather(chosen, 1, (n_valid - 1)[:, None])[:, 0]
    # one int64 row, so a round costs one read of the host's
    round_.copy_(torch.cat([chosen, draft(n_valid, bonus), n_valid[:, None]], 1))
    return taps


def _verify_then_draft(m, tokens, start, n_draft, pages, sampling, round_):
    chosen, taps = _step(m, tokens, start, pages, sampling)
    draft = lambda n_valid, bonus: m.drafter(m.target, taps, start, n_valid, bonus, read_len=_read_len(pages),  # noqa: E731
                                             sampling=sampling)[0]
    return verify_then_draft(tokens, n_draft, chosen, taps, draft, round_)


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


BODIES = {f.__name__: f for f in (prefill, prefill_sampled, verify, verify_sampled, decode, decode_sampled,
                                   decode_steps,
                                   verify_draft, verify_draft_sampled, absorb, draft, draft_sampled, draft_topk,
                                   draft_topk_sampled)}
