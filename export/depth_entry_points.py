"""The verify rounds of fewer rows that a module of several streams adds (S > 1): the batch engine's
draft depth (runtime/depth.py; docs/architecture.md, "Draft depth for shared rounds").

A round of `verify_draft` runs [S, B] rows whatever each stream drafted, so a stream that verifies
fewer drafts saves nothing. A module of S > 1 streams therefore also has `verify_rows{R}` (and
`verify_rows{R}_sampled`) for every R of `depth_rows(B)`: the same round over [S, R] rows (the
anchor and up to R - 1 drafts per stream), and, beside the next draft, the drafter's confidence in
it: the top-1 log-prob log_softmax(logits / T) at each drafted position (T the stream's temperature,
1 when it is greedy), which the depth rule turns into an expected accepted length. The next draft
is always B - 1 tokens, whatever R verified. A module of one stream has none of them, so its
signatures and records are those of before.

Why {B, B/2, 2}: B keeps a confident round as it was; 2 (the anchor and one draft) is the cheapest
round that still drafts; B/2 sits near the demo pair's mean τ (2.8 at B = 8). Each R is one more
pair of target + drafter functions to compile (the tiny S = 4 host export traced its six in 78 s of
212 s on busy cores), so three rows, not every R (the measured cost curve:
experiments/2026-12-02-draft-depth/).
"""

from __future__ import annotations

import torch

from dflash_iree.manifest import VERIFY_ROWS, depth_rows, rows_of

from .entry_points import EntryPoint, ExportShapes, TensorSpec, _read_len, _step, verify_then_draft
from .sampling import Sampling

def depth_entry_points(shapes: ExportShapes, sampled: bool = True) -> list[EntryPoint]:
    """The `verify_rows{R}` entry points of a module (none for S = 1, nor for a hybrid target: the
    rule's plain step is a `prefill` of one row a stream, which a hybrid's static prefill chunk does
    not take), in export order."""
    S, B, N, dt = shapes.streams, shapes.block_size, shapes.tap_width, shapes.dtype
    if S == 1 or shapes.prefill_chunk:
        return []
    start = TensorSpec("start", (S,), "i64")
    n_draft = TensorSpec("n_draft", (S,), "i64")
    pages = TensorSpec("pages", ("P",), "i8")
    sampling = (TensorSpec("temperature", (S,), "f32"), TensorSpec("top_k", (S,), "i64"),
                TensorSpec("top_p", (S,), "f32"), TensorSpec("seed", (S,), "i64"))
    confidence = TensorSpec("confidence", (S, B - 1), "f32")
    out = []
    for R in depth_rows(B):
        round_ = TensorSpec("round", (S, R + B), "i64")
        doc = (f"`verify_draft` over {R} rows: verify [anchor, up to {R - 1} drafts] at [start, start+{R}), count "
               f"the accepted drafts (i < n_draft <= {R - 1}), draft the next block of {B - 1} after the bonus token. "
               f"round[:, :{R}] is chosen, round[:, {R}:{R + B - 1}] the next draft, round[:, {R + B - 1}] the "
               f"accepted rows; confidence[:, j] is the drafter's top-1 log_softmax(logits / T) at next-draft "
               f"position j (T: the stream's temperature, 1 when greedy).")
        for suffix, extra in (("", ()), ("_sampled", sampling)) if sampled else (("", ()),):
            out.append(EntryPoint(f"{VERIFY_ROWS}{R}{suffix}", "target",
                                  (TensorSpec("tokens", (S, R), "i64"), start, n_draft, pages) + extra
                                  + (round_, confidence), (TensorSpec("taps", (S, R, N), dt),), doc,
                                  ("round", "confidence")))
    return out


def top1_logprob(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """max_v log_softmax(logits / T)_v: float32 [S, B - 1] from logits float32 [S, B - 1, V] and
    temperature float32 [S] (None or 0: T = 1, a greedy stream's)."""
    if temperature is not None:
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        logits = logits / t[:, None, None]
    # max - logsumexp = -log(sum(exp(l - max))): one reduction less, and explicit dims (a logsumexp
    # over dim -1 left a torch.constant.int that iree-compile could not legalize)
    top = torch.amax(logits, 2, keepdim=True)
    return -torch.log(torch.sum(torch.exp(logits - top), 2))


def _rows_round(m, tokens, start, n_draft, pages, sampling: Sampling | None, round_, confidence):
    chosen, taps = _step(m, tokens, start, pages, sampling)

    def draft(n_valid, bonus):  # the next block, and its confidence written beside it
        block, logits = m.drafter(m.target, taps, start, n_valid, bonus, read_len=_read_len(pages), sampling=sampling)
        confidence.copy_(top1_logprob(logits, None if sampling is None else sampling.temperature))
        return block

    return verify_then_draft(tokens, n_draft, chosen, taps, draft, round_)


# The exported bodies: one per variant, exported under every R's name (the shape is the example's).
def verify_rows(m, tokens, start, n_draft, pages, round, confidence):  # noqa: A002 (the manifest's name)
    return _rows_round(m, tokens, start, n_draft, pages, None, round, confidence)


def verify_rows_sampled(m, tokens, start, n_draft, pages, temperature, top_k, top_p, seed, round,  # noqa: A002
                        confidence):
    return _rows_round(m, tokens, start, n_draft, pages, Sampling(temperature, top_k, top_p, seed), round,
                       confidence)


def depth_body(name: str):
    """The body exported under a `verify_rows{R}[_sampled]` name; None for any other name."""
    if rows_of(name) is None:
        return None
    return verify_rows_sampled if name.endswith("_sampled") else verify_rows
