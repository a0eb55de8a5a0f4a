"""What a caller may ask of `Engine.generate` / `Engine.stream` (GenerateOptions, the defaults in
one place), and the test seams of the decoding loop (Seams), which are not options.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

from dflash_iree import validate
from dflash_iree.errors import DFlashError
from dflash_iree.acceptance import accept_length


@dataclass(frozen=True)
class GenerateOptions:
    """One request's options; `Engine.generate(prompt, max_new_tokens, **options)` builds one.

    max_new_tokens: budget of new tokens (>= 1).
    temperature, top_k, top_p, seed: temperature 0 is greedy; otherwise a sample keyed by
        (seed, position), identical in plain and drafted decoding. top_k 0 and top_p 1.0 are off.
    speculative: False for plain decoding (queued one step ahead of the host).
    num_speculative_tokens: draft tokens verified per round, 1..block_size-1; None: all.
    stop: a stop string or token id, or a list of them (eos ids always stop).
    draft_top_k: k > 0 also returns, per round, the drafter's k best ids and their log-probs at
        every drafted position, from the compiled top-K dispatch (GenerationResult.draft_top_k, see
        DraftTopK); 1..K of the artifacts (`dflash-iree compile --draft-top-k K`, manifest
        `draft_top_k`). Drafting itself is unchanged (the same draft ids, hence the same tokens).
    exact: plain decoding (whatever `speculative` says: see `drafted`) through the verify graph (`verify_draft`'s when rounds are one call and
        the artifacts have it, else `verify`'s), so that drafted == plain holds bit for bit even in
        bf16 on a GPU.
    enable_thinking: passed to the chat template (off: drafters are trained without it).

    Raises (on construction):
        DFlashError: a sampling value, seed or max_new_tokens out of range or of the wrong type
            (dflash_iree/validate.py names the option and the range). The checks that need the
            artifacts (num_speculative_tokens, draft_top_k, the context length) are the Engine's.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    speculative: bool = True
    num_speculative_tokens: int | None = None
    stop: str | int | Sequence[str | int] | None = None
    draft_top_k: int = 0
    exact: bool = False
    enable_thinking: bool = False

    def __post_init__(self):
        t, k, p, seed = validate.sampling(self.temperature, self.top_k, self.top_p, self.seed, None)
        for name, value in (("temperature", t), ("top_k", k), ("top_p", p), ("seed", seed),
                            ("max_new_tokens", validate.count(self.max_new_tokens, "max_new_tokens",
                                                              "new tokens to generate"))):
            object.__setattr__(self, name, value)  # frozen: the checked, normalised value
        for name in ("speculative", "exact", "enable_thinking"):
            value = getattr(self, name)
            if not isinstance(value, bool) and type(value).__name__ != "bool_":  # numpy's bool passes
                raise DFlashError(f"{name} {value!r} is not True or False")
            object.__setattr__(self, name, bool(value))

    @property
    def drafted(self) -> bool:
        """Whether the request drafts: `speculative`, unless `exact` asks for plain decoding."""
        return self.speculative and not self.exact

    @classmethod
    def of(cls, options: GenerateOptions | None = None, **overrides) -> GenerateOptions:
        """`options` (default: all defaults) with the keyword `overrides` replaced.

        Raises:
            TypeError: a keyword that is no option (naming it and the options).
            DFlashError: sampling out of range (see the class).
        """
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"options is a {type(options).__name__}; pass a GenerateOptions (or the options as keywords)")
        if unknown:
            seams = [u for u in unknown if u in SEAM_NAMES]
            hint = f"; {', '.join(seams)}: test seams, set with Engine.with_seams(...)" if seams else ""
            raise TypeError(f"unknown generate option {', '.join(unknown)}: the options are {', '.join(names)}{hint}")
        return replace(options or cls(), **overrides)


@dataclass(frozen=True)
class Seams:
    """How the decoding loop runs where tests need to reach in; never set by a user request.

    accept: the acceptance rule, (draft ids [n], chosen ids [n + 1]) -> draft tokens kept, 0..n
        (dflash_iree.acceptance.accept_length; tests plant a broken one as a control).
    proposer: a stand-in drafter with the eager reference's Proposer interface (`begin(taps)`,
        `propose(tokens, new_taps, ctx_start) -> ids`; the runtime passes taps as None), for the
        scripted-drafter tests; None: the compiled drafter.
    fused_round: run each round as one `verify_draft` call when the artifacts have it (not with a
        proposer or draft_top_k); False: a `draft` call and a `verify` call. The tokens are the
        same either way; `exact` steps follow it (the graph a drafted request verifies with).
    draft_noise: what a sampled request drafts with (dflash_iree.generation.DRAFT_NOISES):
        "coupled" (the target's own keyed noise), or the benchmark's controls "greedy" and "other"
        (another seed), which draft with separate `draft` calls (no fused round). The tokens are
        the same for all three; only acceptance differs.
    """

    accept: Callable[[Sequence[int], Sequence[int]], int] = accept_length
    proposer: object = None
    fused_round: bool = True
    draft_noise: str = "coupled"


SEAM_NAMES = frozenset(f.name for f in fields(Seams))
