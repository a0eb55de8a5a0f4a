"""What one generation returns, for every decoder: the compiled Engine and the eager reference.

Torch-free (runtime/ has no torch), so it lives here beside the acceptance rule whose per-round
counts it reports. τ (acceptance length) = accepted + 1 per round, as in dflash_iree/acceptance.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .acceptance import tau_histogram
from .errors import DFlashError

# What a drafter drafts with at T > 0 (export/sampling.py `draft_tokens`): the target's own keyed noise
# ("coupled", what requests get), or, as benchmark controls that keep the tokens and lose acceptance,
# a greedy draft ("greedy") or the noise of another seed ("other": the seed xor OTHER_DRAFT_SEED).
DRAFT_NOISES = ("coupled", "greedy", "other")
OTHER_DRAFT_SEED = 0x5BD1E995


def draft_seed(seed: int, draft_noise: str) -> int | None:
    """The seed a sampled request's drafts use: its own ("coupled"), none (None: "greedy"), or
    seed xor OTHER_DRAFT_SEED ("other").

    Raises:
        DFlashError: a draft_noise not in DRAFT_NOISES.
    """
    if draft_noise not in DRAFT_NOISES:
        raise DFlashError(f"draft_noise {draft_noise!r}: use one of {', '.join(DRAFT_NOISES)}")
    if draft_noise == "greedy":
        return None
    return seed ^ OTHER_DRAFT_SEED if draft_noise == "other" else seed


class DraftTopK(NamedTuple):
    """The drafter's top-k at the drafted positions of one round (`generate(..., draft_top_k=k)`).

    ids: one list of k token ids per draft token of the round (row i: block position i + 1, the
        position of draft token i), best first: descending drafter logit, equal logits by lower id,
        so ids[i][0] is draft token i of a greedy request (a sampled request drafts with the target's
        noise, which may choose another of the drafter's tokens). `accepted` of the same round says how many rows were kept.
    logprobs: the matching log-probabilities, log_softmax(drafter logits / T) at those ids, with T
        the request's temperature when it samples (> 0) and 1 when it is greedy (the drafter's own
        distribution). top_k / top_p are not applied.
    """

    ids: list[list[int]]
    logprobs: list[list[float]]

    def to_dict(self) -> dict:
        return {"ids": self.ids, "logprobs": self.logprobs}


@dataclass
class GenerationResult:
    """Result of one request (`Engine.generate`, `generate_plain`, `generate_dflash`).

    tokens: new token ids (a stop token that ended generation is included).
    text: their text, cut before a stop string when one ended generation (None without a tokenizer,
        and from the eager reference, which works on ids).
    accepted: per round, draft tokens kept (0..block_size-1); empty for plain decoding.
    block_size: verify block size of the request (num_speculative_tokens + 1; 1 for plain).
    ttft_ms: time to first token in ms (prefill and its token to the host).
    decode_s: seconds from the first token to the last.
    draft_top_k: with draft_top_k = k > 0, a DraftTopK per round (the same rounds as `accepted`):
        ids and log-probs [n_drafted][k], n_drafted = num_speculative_tokens; empty otherwise.
    redrafts: rounds of `verify_draft` whose device draft was dropped because the host committed
        a different number of rows than the device accepted (0 with the built-in rule).
    """

    tokens: list[int]
    text: str | None = None
    accepted: list[int] = field(default_factory=list)
    block_size: int = 1
    ttft_ms: float = 0.0
    decode_s: float = 0.0
    draft_top_k: list[DraftTopK] = field(default_factory=list)
    redrafts: int = 0

    @property
    def tau(self) -> list[int]:
        """Acceptance length per round: accepted + 1 (the bonus token counted)."""
        return [a + 1 for a in self.accepted]

    @property
    def tau_mean(self) -> float:
        return sum(self.tau) / len(self.tau) if self.tau else 0.0

    @property
    def histogram(self) -> list[int]:
        """Rounds per tau = 1..block_size (empty for plain decoding)."""
        return tau_histogram(self.accepted, self.block_size) if self.accepted else []

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token."""
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0

    def stats(self) -> dict:
        """The JSON-ready statistics (`dflash-iree generate --json`'s "stats")."""
        return {"accepted": self.accepted, "tau": self.tau, "tau_mean": self.tau_mean, "histogram": self.histogram,
                "block_size": self.block_size, "ttft_ms": self.ttft_ms, "decode_tok_s": self.decode_tok_s,
                "new_tokens": len(self.tokens), "redrafts": self.redrafts}
