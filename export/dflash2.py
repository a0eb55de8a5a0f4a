"""The DFlash2 drafter: DFlash with a dynamic causal convolution around every sublayer and a
candidate selector that walks the drafter's top candidates left to right.

Parameter names follow the published DFlash2 checkpoints (z-lab/dflash `dflash/model.py`,
`DFlash2DraftModel`; vLLM `model_executor/models/qwen3_dflash2.py`): v1's keys plus
`layers.i.{attention_conv,mlp_conv}.{base_kernel,kernel_projection.weight}` and
`candidate_selector.{hidden_projection.weight,predecessor_codebook,successor_codebook}` (the
codebooks without a `.weight` suffix). Written from their published description, not copied.

What changes against v1 (export/dflash.py):
- In each layer, the normalised sublayer input x (input_layernorm's for attention,
  post_attention_layernorm's for the MLP) is projected to per-row, per-group tap deltas for two
  convolutions over the block rows: `prepare` convolves x before the sublayer, `finish` the
  sublayer's output (after o_proj / down_proj) before the residual add. Row i of a convolution is
  out[i, c] = sum over taps t < k of (base[t, c] + delta[i, t, c // group]) * in[i - t, c], with
  in[j] = 0 for j < 0: the block boundary. Only the block's rows pass through it; the context K/V
  (the drafter's context cache, `absorb`) never do, as in the published forward, whose
  convolution runs over the block's hidden states only.
- The draft is the selector's walk (`CandidateSelector.walk`), not each slot's argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_iree.config import DrafterConfig

from .dflash import DFlashDrafter, DrafterLayer, transform_logits
from .ops import top_k_per_stream
from .qwen3 import Qwen3, project
from .sampling import Sampling, argmax, keyed_uniform_at


def causal_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """One side of the dynamic causal convolution over the block rows.

    Args:
        x: [S, B, H], the block's rows (row 0 the anchor: nothing before it is read).
        delta: [S, B, k, H / group_size], each row's per-group tap deltas.
        base: [k, H], the static taps (one side of `base_kernel`).
        group_size: channels per group.

    Returns:
        [S, B, H] in x's dtype: out[i, c] = sum_t (base[t, c] + delta[i, t, c // group_size]) * x[i - t, c],
        x[j] = 0 for j < 0 (zeroed at the block boundary).
    """
    S, B, H = x.shape
    G = H // group_size
    rows = x.view(S, B, G, group_size)
    out = None
    for t in range(min(base.shape[0], B)):  # a tap at or past B reads only the zeros before the block
        shifted = rows if t == 0 else torch.cat([rows.new_zeros(S, t, G, group_size), rows[:, :B - t]], 1)
        term = (base[t].view(1, 1, G, group_size).to(x.dtype) + delta[:, :, t, :, None]) * shifted
        out = term if out is None else out + term
    return out.reshape(S, B, H)


class DynamicCausalConv(nn.Module):
    """The two convolutions around one sublayer: `base_kernel` [2, k, H] (side 0 before the
    sublayer, side 1 after) and `kernel_projection` H -> 2 * k * (H / group_size), read as
    [side, tap, group]."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, dtype=None, device=None):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size, dtype=dtype, device=device))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False,
                                           dtype=dtype, device=device)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, B, H], the normalised sublayer input -> (the sublayer's input [S, B, H], the deltas
        of `finish` [S, B, k, G])."""
        S, B, H = x.shape
        delta = project(x, [self.kernel_projection])[0].view(S, B, 2, self.kernel_size, H // self.group_size)
        return causal_conv(x, delta[:, :, 0], self.base_kernel[0], self.group_size), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [S, B, H] convolved with `prepare`'s deltas, before the residual add."""
        return causal_conv(y, delta, self.base_kernel[1], self.group_size)


class DFlash2Layer(DrafterLayer):
    """A drafter layer with `attention_conv` around its attention and `mlp_conv` around its MLP."""

    def __init__(self, cfg: DrafterConfig, dtype=None, device=None, attention: str = "fused"):
        super().__init__(cfg, dtype, device, attention)
        k, g = cfg.dflash2.conv_kernel_size, cfg.dflash2.conv_group_size
        self.attention_conv = DynamicCausalConv(cfg.hidden_size, k, g, dtype, device)
        self.mlp_conv = DynamicCausalConv(cfg.hidden_size, k, g, dtype, device)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_visible, block_visible=None) -> torch.Tensor:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        attended = project(self.attend_block(h, cos, sin, ctx_k, ctx_v, ctx_visible, block_visible),
                           [self.self_attn.o_proj])[0]
        x = x + self.attention_conv.finish(attended, delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        out = project(self.mlp.swiglu(h), [self.mlp.down_proj])[0]
        return x + self.mlp_conv.finish(out, delta)


class CandidateSelector(nn.Module):
    """`candidate_selector.*`: hidden_projection [r, H] and the predecessor / successor codebooks [V, r]."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int, dtype=None, device=None):
        super().__init__()
        self.top_k = top_k
        # K the top-K op is called with (>= top_k): export/aot.py raises it to the draft_topk entry
        # point's K, so that the module holds one top-K shape; two shapes of the host's top-K
        # object failed to link in iree-compile 3.13 (its symbols twice in one executable link)
        self.op_top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False, dtype=dtype, device=device)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank, dtype=dtype, device=device))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank, dtype=dtype, device=device))

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top_k candidates of each slot: ids int64 [S, T, K] (descending logit, equal logits by
        lower id: the draft top-K dispatch's order, export/ops.py `topk_logprobs`) and their logits,
        float32 [S, T, K]. logits: float32 [S, T, V]."""
        ones = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
        ids = top_k_per_stream(logits, ones, self.op_top_k)[0][..., :self.top_k].to(torch.int64)
        return ids, logits.gather(-1, ids)

    def walk(self, ids: torch.Tensor, unary: torch.Tensor, h: torch.Tensor, anchor: torch.Tensor,
             positions: torch.Tensor, sampling: Sampling | None) -> torch.Tensor:
        """The greedy left-to-right walk over the candidates, from the anchor.

        Slot i's candidate c scores unary[i, c] + <A[prev] * h'[i], B[c]>, with h' = hidden_projection(h),
        A the predecessor and B the successor codebook, and prev the anchor at slot 0, else slot
        i - 1's choice. Greedy: the best score (the better-ranked candidate on a tie). Sampled (a
        stream with temperature T > 0): argmax(score / T + gumbel), the gumbel of the target's
        keyed noise at (seed, position, candidate id) (export/sampling.py), so the choice is a
        sample of softmax(score / T) over the candidates, coupled to the target's own draw.

        Args:
            ids, unary: `candidates` (int64 and float32 [S, T, K]).
            h: [S, T, H], the drafter's normalised output at the T drafted slots.
            anchor: int64 [S]; positions: int64 [S, T], the drafted tokens' absolute positions.
            sampling: None (greedy), or the request's parameters (top_k / top_p are not applied).

        Returns:
            int64 [S, T], the draft.

        Algorithm: z-lab/dflash `CandidateSelector.select` (the greedy walk; its T > 0 draw is a
        multinomial sample of softmax(score / T), here the keyed Gumbel-max of the same distribution).
        """
        hp = project(h.to(self.hidden_projection.weight.dtype), [self.hidden_projection])[0].float()
        successors = F.embedding(ids, self.successor_codebook).float()  # S, T, K, r
        gumbel = t = None
        if sampling is not None:
            t = torch.where(sampling.temperature > 0, sampling.temperature, torch.ones_like(sampling.temperature))
            gumbel = -torch.log(-torch.log(keyed_uniform_at(sampling.seed, positions, ids)))
        prev, draft = anchor, []
        for i in range(ids.shape[1]):  # static: B - 1 steps in the graph
            query = F.embedding(prev, self.predecessor_codebook).float() * hp[:, i]  # S, r
            score = unary[:, i] + torch.matmul(successors[:, i], query[:, :, None])[..., 0]  # S, K
            choice = argmax(score)
            if sampling is not None:
                noisy = argmax(score / t[:, None] + gumbel[:, i])
                choice = torch.where(sampling.temperature > 0, noisy, choice)
            prev = ids[:, i].gather(1, choice[:, None])[:, 0]
            draft.append(prev)
        return torch.stack(draft, 1)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter: `DFlashDrafter` with DFlash2 layers and the candidate selector; same
    arguments, cache and call. `forward`'s logits are the drafter's (after the config's logit
    transform); its draft is the selector's walk over their top selector_top_k."""

    layer_cls = DFlash2Layer

    def __init__(self, cfg: DrafterConfig, max_context: int, block_size: int, streams: int = 1,
                 dtype=torch.float32, device=None, attention: str = "fused"):
        super().__init__(cfg, max_context, block_size, streams, dtype, device, attention)
        v2 = cfg.dflash2
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, v2.selector_rank,
                                                    v2.selector_top_k, dtype, device)

    def propose(self, target: Qwen3, h: torch.Tensor, anchor: torch.Tensor, positions: torch.Tensor,
                sampling: Sampling | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = transform_logits(project(h.to(target.dtype), [target.lm_head])[0].float(), self.cfg)
        ids, unary = self.candidate_selector.candidates(logits)
        return self.candidate_selector.walk(ids, unary, h, anchor, positions, sampling), logits


    def top_k(self, logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`DFlashDrafter.top_k` (the draft_topk entry point's), through the selector's top-K op shape
        (the best first, so the first k of op_top_k are the top k)."""
        K = max(k, self.candidate_selector.op_top_k)
        ids, logprobs = top_k_per_stream(logits, temperature, K)
        return ids[..., :k], logprobs[..., :k]


def drafter_class(cfg: DrafterConfig) -> type[DFlashDrafter]:
    """The module class of a drafter config: DFlash2Drafter when it has DFlash2 fields, else DFlashDrafter."""
    return DFlash2Drafter if cfg.dflash2 is not None else DFlashDrafter
