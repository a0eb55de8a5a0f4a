"""The target's token choice inside the graph: argmax, or a sample keyed by (seed, position).

Lossless speculative decoding needs the target to draw the same token at the same absolute
position whether it is decoding one token or verifying a block. So the randomness is not a
stateful generator: each (seed, position, token id) is hashed to a uniform number, turned into a
Gumbel variate, and the sample is argmax(logits / T + gumbel) over the tokens that survive top-k
and top-p (Gumbel-max trick). Only int64 multiply, xor, shift, and, and float ops are used, with
no sort or topk, so the same function exports through IREE and no vocab-sized tensor leaves the
graph.

The top-k and top-p cut-offs are found by bisection on a logit threshold (`_BISECT_STEPS` steps,
float32): the kept set is every token whose logit is at or above the threshold, so ties at the
cut-off are kept, as in Hugging Face's `TopKLogitsWarper`. Tokens whose logits differ by less than
the final bisection width (about range / 2**32) are not separated.

The drafter drafts with the same noise (`draft_tokens`): its token for a position is
argmax(draft_logits / T + gumbel) with the gumbel of that very (seed, position, token id), so a
drafter close to the target proposes the token the target will draw: coupling by shared randomness
(Daliri, Musco and Suresh, "Coupling without communication and drafter-invariant speculative
decoding", 2024, arXiv:2408.07978), whose match probability is at least (1 - TV) / (1 + TV) between
the two distributions. The target's choice is untouched, so drafted == plain seeded sampling holds
as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_M32 = 0xFFFFFFFF
_BISECT_STEPS = 32


class Sampling(NamedTuple):
    """Per-stream sampling parameters, as runtime tensors (S = number of streams).

    temperature: float32 [S]; 0 means greedy (argmax).
    top_k: int64 [S]; 0 means no top-k cut.
    top_p: float32 [S]; 1.0 means no nucleus cut.
    seed: int64 [S]; only the low 32 bits are used.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finalizer (xorshift-multiply, constants below 2**31 so no int64 overflow).
    # torch.bitwise_xor, not `^`: IREE's torch lowering has no aten.__xor__.Tensor.
    x = torch.bitwise_xor(x, x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = torch.bitwise_xor(x, x >> 15)
    x = (x * 0x1B873593) & _M32
    return torch.bitwise_xor(x, x >> 16)


def keyed_uniform(seed: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) float32 [S, T, V], a pure function of (seed, position, token id).

    Args:
        seed: int64 [S].
        positions: int64 [S, T], absolute positions of the tokens being chosen.
        vocab_size: V.
    """
    return keyed_uniform_at(seed, positions, torch.arange(vocab_size, dtype=torch.int64, device=positions.device))


def keyed_uniform_at(seed: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`keyed_uniform` at given token ids only: the same numbers, float32 [S, T, K].

    Args:
        seed: int64 [S]; positions: int64 [S, T]; ids: int64 [S, T, K] (or [V], broadcast).
    """
    key = _mix32(torch.bitwise_xor(_mix32(seed & _M32)[:, None], positions & _M32) & _M32)
    h = _mix32((key[..., None] + ids * 0x61C88647) & _M32)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _threshold(scores: torch.Tensor, enough) -> torch.Tensor:
    """Largest threshold t (to bisection width) with enough(scores >= t) true, per row: [..., 1]."""
    lo = scores.amin(-1, keepdim=True)  # enough() holds here: every token kept
    hi = scores.amax(-1, keepdim=True)
    for _ in range(_BISECT_STEPS):
        mid = lo + (hi - lo) * 0.5
        ok = enough(scores >= mid)
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    return lo


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (the first index of the maximum) as int64, from max reductions.

    IREE 3.13's GPU codegen fails to compile torch.argmax's arg_compare for many vocabulary sizes
    (512, 4096, 152064, 248320, ...), and on CUDA an int32 *min* reduction over the indices compiled
    but returned -1 everywhere (seen on the H200: its initial value acts as -1). So the index comes
    from an int32 max over non-negative scores, max(where(x == max, V - i, 0)). A row holding NaN
    gives V.

    A single row (decode's) of at least 8 chunks of ARGMAX_CHUNK logits goes in two levels: IREE gives
    a reduction one workgroup a row, and one workgroup over a [1, 151936] row took 0.13 ms of the
    Qwen3-8B decode step on an H100. The row is padded with -inf to whole chunks; each chunk reduces in parallel to
    its maximum and the first index of it; then the first chunk holding the row's maximum gives the
    index. Max is exact, so the result is the same index, ties (+0 and -0 included) and NaN rows too.
    Chunks that divide V exactly would save the padding copy, but 151936 = 128 x 1187 (a prime), and
    IREE 3.13 runs a reduction over 1187 nearly serially: on an H100 that form was 2.3x slower than
    one level; the padded one made the 8B decode step 0.979x the time. Several rows (verify, draft)
    keep one level: there IREE copies the rows into the padded buffer with a slow strided copy, and
    the 8B verify and draft steps took 1.01x and 1.04x the time (experiments/2026-12-07-argmax/).
    The index is exact in either form, so the choice per row count leaves row invariance alone.

    Args:
        x: float [..., V].

    Returns:
        int64 [...]: the first index of the maximum, or V where the row holds a NaN.
    """
    V, c = x.shape[-1], ARGMAX_CHUNK
    n = -(-V // c)
    if n < 8 or x.numel() != V:
        return _argmax_flat(x)
    xc = torch.nn.functional.pad(x, (0, n * c - V), value=float("-inf")).reshape(*x.shape[:-1], n, c)
    m = xc.amax(-1)  # [..., n]; NaN for a chunk holding one
    rev = c - torch.arange(c, dtype=torch.int32, device=x.device)
    local = c - _top_score(xc, m[..., None], rev)  # [..., n] int32
    reverse = n * c - (torch.arange(n, dtype=torch.int32, device=x.device) * c + local)  # n c - the chunk's first index
    best = _top_score(m, m.amax(-1, keepdim=True), reverse)
    return (n * c - best).clamp(max=V).to(torch.int64)  # a NaN row: no chunk matches, n c -> V


# Logits a chunk of `argmax`'s first level for one row (a power of two: IREE splits and vectorizes the reduction).
ARGMAX_CHUNK = 4096


def _top_score(x: torch.Tensor, top: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The largest of `scores` where x equals top (0 where none does): max(where(x == top, scores, 0)) over
    the last dimension. x float [..., n], top broadcast to it, scores int32 [n] (positive) -> int32 [...]."""
    return torch.where(x == top, scores, torch.zeros_like(scores)).amax(-1)


def _argmax_flat(x: torch.Tensor) -> torch.Tensor:
    """`argmax` in one level: int64 [...] from float [..., V]."""
    V = x.shape[-1]
    reverse = V - torch.arange(V, dtype=torch.int32, device=x.device)  # V .. 1: the first index scores highest
    best = _top_score(x, x.amax(-1, keepdim=True), reverse)
    return (V - best).to(torch.int64)


def _kept(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [S, T, V]: the tokens that survive top-k and top-p of `scores` (logits / T), the best
    always (ties at a cut-off are kept)."""
    V = scores.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))[:, None, None]
    t_k = _threshold(scores, lambda keep: keep.sum(-1, keepdim=True, dtype=torch.int32) >= k)  # int32: see argmax
    probs = torch.softmax(scores, -1)
    p = top_p[:, None, None]
    t_p = _threshold(scores, lambda keep: (probs * keep).sum(-1, keepdim=True) >= p)
    # top_p = 1 keeps everything, whatever float rounding does to the mass of the tail
    t_p = torch.where(p >= 1.0, scores.amin(-1, keepdim=True), t_p)
    return (scores >= torch.maximum(t_k, t_p)) | (scores >= scores.amax(-1, keepdim=True))


def choose_tokens(logits: torch.Tensor, positions: torch.Tensor, sampling: Sampling | None) -> torch.Tensor:
    """The target's token for each row: argmax, or a keyed Gumbel-max sample.

    Args:
        logits: float32 [S, T, V].
        positions: int64 [S, T], absolute position of the token each row chooses (row position + 1).
        sampling: None for greedy in every stream; otherwise per-stream parameters, where a
            stream with temperature 0 is still greedy.

    Returns:
        int64 [S, T] token ids.
    """
    return _choose(logits, positions, sampling, cut=True)


# The drafter's choice ranges over the whole vocabulary, not over its own top-k / top-p kept set:
# the cut gained at most 1% in tau on the demo pair and cost a round 0.39 ms on the H200 (70 more
# dispatches a draft in the tiny sm_80 build); experiments/2026-12-02-coupled-drafting/, docs/architecture.md.
DRAFT_CUT = False


def draft_tokens(logits: torch.Tensor, positions: torch.Tensor, sampling: Sampling | None,
                 cut: bool | None = None) -> torch.Tensor:
    """The drafter's token for each drafted position: argmax (greedy requests, and streams with
    temperature 0), else the Gumbel-max choice with the target's own keyed noise (coupled drafting).

    Args:
        logits: float32 [S, T, V], the drafter's logits for T drafted positions.
        positions: int64 [S, T], the absolute position of each drafted token: the key the target
            samples that position with (`choose_tokens` gets row position + 1 for the same token).
        sampling: the request's parameters, or None (greedy: plain argmax, nothing more computed).
        cut: default `DRAFT_CUT` (False): the choice ranges over the whole vocabulary; True: over
            the tokens that survive the request's top-k / top-p of the drafter's own logits (the
            drafter cannot know the target's kept set; a benchmark arm).

    Returns:
        int64 [S, T] draft token ids.

    Algorithm: Daliri, Musco and Suresh 2024 (module docstring); the noise is `keyed_uniform`'s.
    """
    return _choose(logits, positions, sampling, DRAFT_CUT if cut is None else cut)


def _choose(logits, positions, sampling: Sampling | None, cut: bool) -> torch.Tensor:
    greedy = argmax(logits)
    if sampling is None:
        return greedy
    temperature, top_k, top_p, seed = sampling
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scores = logits / t[:, None, None]
    u = keyed_uniform(seed, positions, scores.shape[-1])
    noisy = scores - torch.log(-torch.log(u))
    if cut:
        noisy = torch.where(_kept(scores, top_k, top_p), noisy, torch.full_like(noisy, float("-inf")))
    return torch.where((temperature > 0)[:, None], argmax(noisy), greedy)
