"""The DFlash drafter: a block-diffusion draft model fed by the target's tapped hidden states.

Parameter names follow the published DFlash checkpoints (`fc.weight`, `hidden_norm.weight`,
`norm.weight`, `layers.N.*`); there is no embedding and no lm_head: the drafter uses the target's
(z-lab/dflash `dflash/model.py`, `DFlashDraftModel`).

Per round, for a block starting at absolute position `start`:
- the context rows committed last round (the target's taps at positions [ctx_start, start)) are
  fused, `hidden_norm(fc(taps))`, and projected with every layer's k_proj / v_proj, k_norm and
  RoPE into the drafter's context cache (context K/V only: block K/V never stay in the cache);
- the block [anchor, mask x (B - 1)] is embedded with the target's `embed_tokens`; in every layer
  its queries attend, with no causal mask, to the cached context (positions < start) and to the
  block's own K/V;
- the last layer's output goes through the drafter's `norm` and the target's lm_head, and the
  draft is read at block positions 1..B-1: greedy, or for a sampled request chosen with the
  target's own keyed noise at each token's absolute position (export/sampling.py `draft_tokens`,
  coupled drafting);
- on request (`top_k`), the k best ids and log-probs of those logits, through the custom op that
  the compiled module replaces with the draft top-K dispatch of kernels/ (export/ops.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_iree.config import DrafterConfig

from . import draft_window
from .ops import top_k_per_stream
from .qwen3 import DecoderLayer, Qwen3, RMSNorm, attention_fn, cache_rows, project, rope_tables, write_cache
from .sampling import Sampling, draft_tokens


class DrafterLayer(DecoderLayer):
    """A Qwen3 layer whose keys and values are [cached context K/V, the block's own K/V]."""

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_visible, block_visible=None) -> torch.Tensor:
        return self.finish(x, self.attend_block(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_visible,
                                                block_visible))

    def attend_block(self, h, cos, sin, ctx_k, ctx_v, ctx_visible, block_visible=None) -> torch.Tensor:
        """The block's attention before o_proj: h [S, B, hidden] (normalised) -> [S, B, Hq * hd].

        Keys and values are the cached context's (ctx_k, ctx_v [S, N, Hkv, hd], visible where
        ctx_visible [S, 1 or B, N]) and the block's own, from h: all visible, or where
        block_visible [S, B, B] (a sliding_attention layer's, export/draft_window.py).
        """
        S, B, _ = h.shape
        q, k, v = self.self_attn.qkv(h, cos, sin)
        keys = torch.cat([ctx_k, k], 1)
        values = torch.cat([ctx_v, v], 1)
        if block_visible is None:
            block_visible = torch.ones(S, B, B, dtype=torch.bool, device=h.device)
        visible = torch.cat([ctx_visible.expand(S, B, -1), block_visible], -1)
        return attention_fn(self.attention)(q, keys, values, visible)


def transform_logits(logits: torch.Tensor, cfg: DrafterConfig) -> torch.Tensor:
    """The drafter config's optional logit transform: logits * output_multiplier, then, with
    final_logit_softcapping cap > 0, tanh(logits / cap) * cap (z-lab/dflash `compute_logits`);
    unchanged when neither is set. logits: float32 [..., V]."""
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping > 0:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


class DFlashDrafter(nn.Module):
    """DFlash drafter with a context KV cache [S, L, 2, N, kv_dim]: N = max_context, or, when every
    layer is a sliding_attention one, a ring of window + block_size slots and a spare
    (export/draft_window.py).

    Args:
        cfg: the drafter config (checked against the target by `load_drafter_config`).
        max_context: context cache length in tokens; must equal the target's.
        block_size: B, the verify block (anchor + B - 1 drafts), as DrafterConfig.block gave it.
        streams: leading stream dimension S (1 for now).
        dtype, device, attention: as for `Qwen3`.
    """

    layer_cls = DrafterLayer  # DFlash2Drafter's layers add the convolutions (export/dflash2.py)

    def __init__(self, cfg: DrafterConfig, max_context: int, block_size: int, streams: int = 1,
                 dtype=torch.float32, device=None, attention: str = "fused"):
        super().__init__()
        self.cfg = cfg
        self.max_context = max_context
        self.block_size = block_size
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.layers = nn.ModuleList(self.layer_cls(cfg, dtype, device, attention) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.ring = draft_window.ring_slots(cfg, block_size)
        rows = draft_window.cache_length(cfg, block_size, max_context)
        shape = (streams, cfg.num_hidden_layers, 2, rows, cfg.kv_dim)
        self.register_buffer("ctx_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def absorb(self, taps: torch.Tensor, start: torch.Tensor, n_valid: torch.Tensor | None = None) -> None:
        """Project context rows into the context cache at positions [start, start + R).

        Args:
            taps: [S, R, num_taps * hidden_size], the target's taps for those positions.
            start: int64 [S], position of taps[:, 0].
            n_valid: int64 [S], the real rows (the next block starts at start + n_valid); default R.
                Only a ring cache uses it, to choose which rows it keeps.
        """
        R = taps.shape[1]
        positions = start[:, None] + torch.arange(R, dtype=torch.int64, device=taps.device)
        ctx = self.hidden_norm(project(taps.to(self.norm.weight.dtype), [self.fc])[0])
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, ctx.dtype, self.cfg.yarn)
        block_start = start + (R if n_valid is None else n_valid)
        rows = cache_rows(self.ctx_cache, draft_window.absorb_slots(positions, block_start, self.ring, self.block_size))
        # every layer's k and v projections of the one ctx as one named op (grouped dispatches)
        kv = project(ctx, [p for layer in self.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)])
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.rotate_kv(kv[2 * i], kv[2 * i + 1], cos, sin)
            write_cache(self.ctx_cache, rows[i], k, v)

    def forward(self, target: Qwen3, taps: torch.Tensor, ctx_start: torch.Tensor, n_valid: torch.Tensor,
                anchor: torch.Tensor, read_len: int | None = None,
                sampling: Sampling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorb last round's context rows, then draft one block.

        Args:
            target: supplies embed_tokens and lm_head.
            taps: [S, R, num_taps * hidden_size], the context rows committed last round; rows at
                index >= n_valid are padding (they land at positions >= the block start, which the
                block never reads and the next round overwrites).
            ctx_start: int64 [S], position of taps[:, 0].
            n_valid: int64 [S], how many of the R rows are real; the block starts at ctx_start + n_valid.
            anchor: int64 [S], the last committed token (block position 0).
            read_len: context cache rows to read (>= block start); default max_context. A ring cache
                reads all its slots, whatever read_len says.
            sampling: None: a greedy draft; else the request's sampling parameters, and each draft
                token is chosen with the target's keyed noise at its position (`draft_tokens`).

        Returns:
            draft: int64 [S, B - 1], the draft for block positions 1..B-1 (absolute positions
                start + 1 .. start + B - 1).
            logits: float32 [S, B - 1, vocab_size].
        """
        self.absorb(taps, ctx_start, n_valid)
        return self.draft_block(target, ctx_start, n_valid, anchor, read_len, sampling, self.context)

    def context(self, layer: int, read_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached context keys and values [S, read_len, Hkv, hd] of one layer, every stream's."""
        S, hd = self.ctx_cache.shape[0], self.cfg.head_dim
        return (self.ctx_cache[:, layer, 0, :read_len].view(S, read_len, -1, hd),
                self.ctx_cache[:, layer, 1, :read_len].view(S, read_len, -1, hd))

    def draft_block(self, target: Qwen3, ctx_start: torch.Tensor, n_valid: torch.Tensor, anchor: torch.Tensor,
                    read_len: int | None, sampling: Sampling | None, context) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` after its absorb: the block at ctx_start + n_valid drafted over the context that
        `context(layer, read_len)` reads (`self.context`; one stream's slot in
        export/stream_entry_points.py). Same arguments and results as `forward`."""
        B = self.block_size
        S = anchor.shape[0]
        read_len = self.max_context if read_len is None else read_len
        if self.ring is not None:
            read_len = self.ctx_cache.shape[3]
        start = ctx_start + n_valid
        masks = torch.full((S, B - 1), self.cfg.mask_token_id, dtype=torch.int64, device=anchor.device)
        block = torch.cat([anchor[:, None], masks], 1)
        x = target.model.embed_tokens(block) * self.cfg.input_embedding_scale
        x = x.to(self.norm.weight.dtype)
        positions = start[:, None] + torch.arange(B, dtype=torch.int64, device=anchor.device)
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype, self.cfg.yarn)
        windows = self.cfg.layer_windows or (0,) * len(self.layers)
        if self.ring is None and not any(windows):  # every layer full: one [S, 1, N] row of context visibility
            key_pos = torch.arange(read_len, dtype=torch.int64, device=anchor.device)
            visible = {0: ((key_pos[None, :] < start[:, None])[:, None, :], None)}
        else:
            held = draft_window.slot_positions(start, read_len, self.ring)
            visible = {w: draft_window.visibility(held, positions, w) for w in sorted(set(windows))}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, *context(i, read_len), *visible[windows[i]])
        return self.propose(target, self.norm(x[:, 1:]), anchor, positions[:, 1:], sampling)

    def propose(self, target: Qwen3, h: torch.Tensor, anchor: torch.Tensor, positions: torch.Tensor,
                sampling: Sampling | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft from the last layer's normalised output h [S, B - 1, hidden] at the drafted
        slots (absolute positions int64 [S, B - 1]): draft int64 [S, B - 1] and logits float32
        [S, B - 1, V], as `forward` returns them. v1: each slot's own choice (`draft_tokens`)."""
        logits = transform_logits(project(h.to(target.dtype), [target.lm_head])[0].float(), self.cfg)
        return draft_tokens(logits, positions, sampling), logits

    @staticmethod
    def top_k(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's top-k: ids int32 [S, B - 1, k] (descending logit, equal logits by lower id, so
        ids[..., 0] is the greedy draft) and log_softmax(logits / temperature) at them, float32.

        Args:
            logits: float32 [S, B - 1, vocab_size], as `forward` returns them.
            temperature: float32 [S], > 0.
            k: 1..min(64, vocab_size).
        """
        return top_k_per_stream(logits, temperature, k)
