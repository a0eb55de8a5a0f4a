"""Chain acceptance: the host-side rule that keeps speculative decoding lossless.

Pure Python over token ids, shared by the eager reference and the runtime, so that a scripted
drafter and the planted control run through every decoding path.

Definitions used everywhere in this project, per round of a block of `1 + n` rows
(the anchor token at block position 0, then `n` draft tokens):
- `chosen[i]` is the target's own token after block position i (argmax, or the keyed sample);
- `accepted` = length of the longest prefix with `draft[i] == chosen[i]`, 0..n;
- the round commits `draft[:accepted]` plus the bonus token `chosen[accepted]`;
- acceptance length tau = accepted + 1 (the bonus token counted), 1..n+1.
Every committed token is the target's own choice at its position, which is what makes the output
equal to plain decoding (z-lab/dflash `dflash_generate`, the cumprod rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import DFlashError


def accept_length(draft: Sequence[int], chosen: Sequence[int]) -> int:
    """Number of draft tokens to keep: the longest prefix where draft[i] == chosen[i].

    Args:
        draft: n draft token ids (block positions 1..n).
        chosen: at least n+1 target choices (after block positions 0..n).
    """
    a = 0
    while a < len(draft) and int(draft[a]) == int(chosen[a]):
        a += 1
    return a


@dataclass
class RoundCommit:
    """What one verified block adds: the new tokens (kept drafts, then the bonus), the count of
    draft tokens kept, and whether generation is done (a stop token or the budget reached)."""

    tokens: list[int]
    accepted: int
    done: bool


def commit_round(
    draft: Sequence[int],
    chosen: Sequence[int],
    accepted: int,
    stop_ids: frozenset[int] | set[int],
    budget: int,
) -> RoundCommit:
    """Tokens a round commits, cut at the first stop token (kept) and at `budget` new tokens.

    Args:
        draft: the n draft ids.
        chosen: the target's n+1 choices.
        accepted: the kept draft count from the acceptance rule (`accept_length`).
        stop_ids: token ids that end generation (eos and user stop ids); the stop token is kept.
        budget: how many more tokens may be generated (>= 1).

    Returns:
        RoundCommit whose `accepted` counts only draft tokens that survived the cut.
    """
    new = [int(t) for t in draft[:accepted]] + [int(chosen[accepted])]
    new = new[:budget]
    stopped = False
    for i, t in enumerate(new):
        if t in stop_ids:
            new = new[: i + 1]
            stopped = True
            break
    # a cut that removes the bonus leaves only kept draft tokens
    kept = min(accepted, len(new))
    return RoundCommit(new, kept, stopped or len(new) >= budget)


def check_fits(n_prompt: int, max_new_tokens: int, block: int, max_context: int) -> None:
    """Refuse a request that does not fit the KV cache, before any work; nothing is truncated.

    Verify writes a whole block past the committed length, so prompt length + max_new_tokens +
    block must be at most max_context. Shared by the eager reference (block 1 for plain decoding)
    and the runtime (the artifact's block_size).

    Raises:
        DFlashError: an empty prompt, max_new_tokens < 1, or the sum over max_context; the message
            names the numbers and the fix.
    """
    if n_prompt < 1:
        raise DFlashError("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise DFlashError(f"max_new_tokens is {max_new_tokens}; ask for at least 1")
    need = n_prompt + max_new_tokens + block
    if need > max_context:
        raise DFlashError(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) + block ({block}) = {need} exceeds "
            f"max_context {max_context}; shorten the prompt, lower max_new_tokens, or raise max_context "
            "(--max-context; for compiled artifacts, recompile: dflash-iree compile --max-context N)")


def tau_histogram(accepted: Sequence[int], block_size: int) -> list[int]:
    """Counts of rounds with tau = 1..block_size (index 0 holds tau = 1)."""
    hist = [0] * block_size
    for a in accepted:
        hist[a] += 1
    return hist

