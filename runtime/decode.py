"""The decoding steps of one request on a CompiledPair: prefill, plain steps, one speculative round
(draft -> verify -> accept -> commit), and the stop-string check.

Each step reads and advances a Request (runtime/request.py); the Engine (runtime/engine.py) runs
them in order until the request is done. Acceptance is the pure host function of
dflash_iree/acceptance.py (or the test seam's rule), the same one the eager reference uses. Rollback
is by length: a round commits its tokens and the next call starts writing at the new anchor, so KV
rows written past the committed length are simply overwritten. Algorithm: z-lab/dflash
`dflash_generate` (chain verify, the bonus token), as in export/reference.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from dflash_iree import validate
from dflash_iree.acceptance import commit_round
from dflash_iree.generation import DraftTopK

from .module import CompiledPair
from .options import Seams
from .request import Request


def prefill(m: CompiledPair, req: Request, seams: Seams) -> None:
    """Run the prompt, commit the first token, and (drafted decoding) give the drafter the prompt.

    Sets req.t_start / req.t_first around the prefill call (the time to first token); absorbing the
    prompt's taps into the drafter's context cache counts as decoding time.
    """
    req.t_start = time.perf_counter()
    first, prompt_taps = m.prefill(req.prompt)
    req.tokens.append(first)
    req.t_first = time.perf_counter()
    req.done = req.stop.ends(req.tokens)
    if req.speculative:
        m.absorb(prompt_taps)
        if seams.proposer is not None:
            seams.proposer.begin(None)
        req.taps, req.ctx_start, req.n_valid = None, len(req.prompt), 0


def plain_ahead(m: CompiledPair, req: Request) -> Iterator[int] | None:
    """For plain decoding (not `exact`): the tokens after the first, each step queued before the
    host has the previous token (CompiledPair.decode_ahead; close it when done). None otherwise."""
    if req.speculative or req.options.exact:
        return None
    return m.decode_ahead(req.tokens[-1], len(req.prompt), req.stop.max_new_tokens - 1)


def plain_step(m: CompiledPair, req: Request, ahead: Iterator[int] | None) -> None:
    """Commit one token: the next of `ahead`, or (`exact`) a step through the verify graph (through
    `verify_draft` when the request's drafted twin would verify with it, so the two agree bit for bit)."""
    token = next(ahead) if ahead is not None else m.step_exact(req.tokens[-1], req.anchor_position, req.fused_exact)
    req.tokens.append(token)
    req.done = req.stop.ends(req.tokens)


def speculative_round(m: CompiledPair, req: Request, seams: Seams) -> None:
    """One round: draft n_draft tokens after the anchor, verify [anchor, draft...] on the target,
    accept a prefix, commit it with the bonus token."""
    start = req.anchor_position
    draft_ids = draft(m, req, seams, start)
    chosen = verify(m, req, draft_ids, start)
    accepted = seams.accept(draft_ids, chosen)
    commit(req, draft_ids, chosen, accepted, start)


def draft(m: CompiledPair, req: Request, seams: Seams, start: int) -> list[int]:
    """The round's n_draft draft ids (int) after the anchor at `start`: from the proposer seam, the
    top-K drafter (keeping its rows in req.draft_top), the device's draft of the last `verify_draft`,
    or a `draft` call (which also absorbs the last round's taps)."""
    n = req.n_draft
    if seams.proposer is not None:
        proposed = seams.proposer.propose(list(req.prompt) + req.tokens, None, req.ctx_start)
        return validate.token_ids(proposed, req.vocab_size, "proposer draft")[:n]
    if req.draft_top_k:
        ids, top_ids, top_lps = m.draft_topk(req.taps, req.ctx_start, req.n_valid, req.tokens[-1], start,
                                             req.logprob_temperature)
        k = req.draft_top_k
        req.draft_top.append(DraftTopK(top_ids[:n, :k].tolist(), top_lps[:n, :k].tolist()))
        return ids[:n]
    if req.next_draft is not None:
        return req.next_draft[:n]
    return m.draft(req.taps, req.ctx_start, req.n_valid, req.tokens[-1], start)[:n]


def verify(m: CompiledPair, req: Request, draft_ids: list[int], start: int) -> list[int]:
    """The target's chosen token after each row of [anchor, draft...] at `start` (len(draft_ids) + 1
    ids). Keeps the taps for the next draft and, as one `verify_draft` call, the device's next draft
    and its accepted-row count."""
    block = [req.tokens[-1]] + draft_ids
    if req.fused_round:
        chosen, req.next_draft, req.device_rows, req.taps = m.verify_draft(block, start)
    else:
        chosen, req.taps = m.verify(block, start)
    return chosen


def commit(req: Request, draft_ids: list[int], chosen: list[int], accepted: int, start: int) -> None:
    """Commit draft_ids[:accepted] and the bonus token chosen[accepted], cut at a stop id and at the
    budget (dflash_iree.acceptance.commit_round); the committed rows' taps become the drafter's
    next context. A device draft that followed other rows than the host kept is dropped (a redraft)."""
    r = commit_round(draft_ids, chosen, accepted, req.stop.ids, req.stop.budget(req.tokens))
    req.tokens += r.tokens
    req.accepted.append(r.accepted)
    req.ctx_start, req.n_valid = start, len(r.tokens)
    req.done = r.done
    if req.fused_round and req.device_rows != req.n_valid:
        req.next_draft = None
        req.redrafts += not req.done


def check_stop_strings(req: Request) -> None:
    """End the request at the shortest prefix of its tokens whose text holds a stop string."""
    cut = req.stop.cut(req.tokens)
    if cut is not None:
        del req.tokens[cut:]
        req.done = True
