"""The Qwen3.5-family hybrid target: eager reference and `torch.export` source in one `nn.Module`.

Authority: transformers 5.24.0 `models/qwen3_5/modular_qwen3_5.py` (`Qwen3_5DecoderLayer`,
`Qwen3_5TextModel`, and the `Qwen3Next*` attention, norm and rotary classes it builds on).
Parameter names equal the checkpoint's keys, under `model.` (qwen3_5_text) or
`model.language_model.` (the qwen3_5 wrapper), so an artifact binds the checkpoint as it is.

As export/qwen3.py's `Qwen3`, one forward runs T new tokens per stream at [start, start + T) and
returns the chosen tokens, the logits and the drafter's taps. Its layers are of two kinds
(`cfg.layer_types`):
- "full_attention": gated attention (`GatedAttention`), whose KV cache [S, L_attn, 2, C, kv_dim]
  holds the attention layers only and rolls back by its length, as Qwen3's;
- "linear_attention": Gated DeltaNet (export/gdn.py), whose recurrent state lives in per-row slots
  and rolls back by the `start` of the next call (export/recurrent_state.py).
Every norm is zero-centred, x_hat * (1 + w) in float32 (`zc_rms_norm`), except the DeltaNet's
gated output norm.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from dflash_iree.config_qwen35 import HybridConfig

from . import ops
from .gdn import GatedDeltaNet
from .qwen3 import (MLP, apply_rope, as_float32, attention_fn, cache_rows, project, project_residual, query_rows_mask,
                    write_cache)
from .qwen35_rope import rope_tables
from .recurrent_state import RecurrentState
from .sampling import Sampling, choose_tokens

PREFILL_BLOCK = 16  # rows of one GDN step op in a prefill: the kernel's most (kernels/gdn/dispatch.py MAX_T)


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by (1 + weight), all in float32, cast back to x's dtype (`Qwen3NextRMSNorm`).
    x: [..., dim]; weight: [dim]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


class ZCRMSNorm(nn.Module):
    """`zc_rms_norm` with its weight (zeros: the identity scale)."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zc_rms_norm(x, self.weight, self.eps)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of x [S, T, H, hd] by cos, sin [S, T, rotary_dim]; the rest pass."""
    r = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], -1)


class GatedAttention(nn.Module):
    """`self_attn` of a Qwen3.5 full-attention layer: q_proj yields query and gate interleaved per
    head ([Hq, 2 * hd]); zero-centred q_norm / k_norm; partial RoPE; GQA; output * sigmoid(gate)."""

    def __init__(self, cfg: HybridConfig, dtype=None, device=None, attention: str = "matmul"):
        super().__init__()
        kw = dict(bias=cfg.attention_bias, dtype=dtype, device=device)
        self.cfg = cfg
        self.attention = attention
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * cfg.q_dim, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, **kw)
        self.o_proj = nn.Linear(cfg.q_dim, cfg.hidden_size, **kw)
        self.q_norm = ZCRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = ZCRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)

    def qkv_gate(self, x: torch.Tensor, cos, sin):
        """x [S, T, hidden] -> rotated q [S, T, Hq, hd], k, v [S, T, Hkv, hd], gate [S, T, Hq * hd].

        The q/k norms and rope are exported in the "fused" (GPU) form as the custom op
        `dflash::head_norm_rope` (export/ops.py; zero-centred, rotary_dim dims rotated), which
        export/splice.py replaces with one dispatch for q and k (kernels/norm_rope/), q read in place
        from the [query, gate] heads. Eager runs (the reference, training) and the CPU form compute
        them op by op, as export/qwen3.py `norm_rope` does for Qwen3.
        """
        c = self.cfg
        S, T, _ = x.shape
        qg, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        qg = qg.view(S, T, c.num_attention_heads, 2 * c.head_dim)
        q, gate = qg.chunk(2, -1)
        k = k.view(S, T, c.num_key_value_heads, c.head_dim)
        if self.attention == "fused" and ops.exporting():
            q = ops.head_norm_rope(qg, self.q_norm.weight, cos, sin, self.q_norm.eps, True, c.rotary_dim)
            k = ops.head_norm_rope(k, self.k_norm.weight, cos, sin, self.k_norm.eps, True, c.rotary_dim)
        else:
            q = partial_rope(self.q_norm(q), cos, sin)
            k = partial_rope(self.k_norm(k), cos, sin)
        return q, k, v.view(S, T, c.num_key_value_heads, c.head_dim), gate.reshape(S, T, c.q_dim)


def gated_cache_attention(q, gate, cache, layer: int, read_len: int, positions, attention: str) -> torch.Tensor:
    """export/qwen3.py `cache_attention` with the gated output: softmax(q k^T / sqrt(hd)) v over
    the first read_len rows of attention layer `layer` of cache, times sigmoid(gate).

    q: [S, T, Hq, hd]; gate: [S, T, Hq * hd]; cache [S, L_attn, 2, C, kv_dim]; positions int64 [S, T].
    Returns [S, T, Hq * hd] in q's dtype; exported, the named op `dflash::block_attention` with its gate.
    """
    S, hd = cache.shape[0], q.shape[-1]
    keys = cache[:, layer, 0, :read_len].view(S, read_len, -1, hd)
    values = cache[:, layer, 1, :read_len].view(S, read_len, -1, hd)
    key_pos = torch.arange(read_len, dtype=torch.int64, device=positions.device)[None, None, :]
    visible = key_pos <= positions[:, :, None]
    out = attention_fn(attention)(q, keys, values, visible) * torch.sigmoid(gate)
    if not ops.exporting():
        return out
    return ops.block_attention(q, cache, layer, query_rows_mask(visible, q.shape[2] // keys.shape[2]), out, gate)


class HybridLayer(nn.Module):
    """One Qwen3.5 decoder layer: x + mixer(norm(x)), then x + mlp(norm(x)); the mixer is
    `linear_attn` (GatedDeltaNet) or `self_attn` (GatedAttention) by `layer_type`."""

    def __init__(self, cfg: HybridConfig, layer_type: str, dtype=None, device=None, attention: str = "matmul"):
        super().__init__()
        self.layer_type = layer_type
        self.attention = attention
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, dtype, device)
        else:
            self.self_attn = GatedAttention(cfg, dtype, device, attention)
        self.mlp = MLP(cfg, dtype, device)
        self.input_layernorm = ZCRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = ZCRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def finish(self, x: torch.Tensor, mixed: torch.Tensor, out_proj: nn.Linear) -> torch.Tensor:
        x = project_residual(mixed, out_proj, x)
        return self.mlp.add_to(x, self.post_attention_layernorm(x))

    def attend(self, x, cos, sin, positions, cached) -> torch.Tensor:
        """The attention layer. cached: None (training: causal attention within the block), or
        cached(q, k, v, gate, attention form) -> the gated attention over the KV cache after writing
        k, v into it (`Qwen35.forward`'s, or one stream's slot: export/stream_entry_points.py)."""
        q, k, v, gate = self.self_attn.qkv_gate(self.input_layernorm(x), cos, sin)
        if cached is None:
            visible = positions[:, None, :] <= positions[:, :, None]
            out = attention_fn(self.attention)(q, k, v, visible) * torch.sigmoid(gate)
        else:
            out = cached(q, k, v, gate, self.attention)
        return self.finish(x, out, self.self_attn.o_proj)

    def mix(self, x, state, window, per_token: bool, rule=None):
        """The DeltaNet layer: returns (the layer's output, states, windows), see `GatedDeltaNet.forward`."""
        y, states, windows = self.linear_attn(self.input_layernorm(x), state, window, per_token, rule)
        return self.finish(x, y, self.linear_attn.out_proj), states, windows


class HybridBody(nn.Module):
    """The text model: embed_tokens, layers, norm."""

    def __init__(self, cfg: HybridConfig, dtype=None, device=None, attention: str = "matmul"):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(HybridLayer(cfg, t, dtype, device, attention) for t in cfg.layer_types)
        self.norm = ZCRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class Qwen35(nn.Module):
    """Qwen3.5-family hybrid decoder with a static KV cache, recurrent state slots and drafter taps.

    Args:
        cfg: the target config (`HybridConfig`).
        max_context: KV cache length in tokens (C).
        tap_layer_ids: decoder layers whose outputs feed the drafter, in the drafter's order (any
            layer type).
        streams: leading stream dimension S of the caches.
        dtype: parameter and cache dtype; the DeltaNet state is float32 whatever it is.
        device: "meta" builds the structure without memory.
        attention: "fused" or "matmul", as `Qwen3`'s (export/qwen3.py `ATTENTION`).
        state_slots: rows a call keeps every state of (the verify block size B); a call of more
            rows keeps its last state only.
        prefill_form: the DeltaNet rule of calls longer than state_slots: "chunked" (`chunked_rule`)
            or "per_token" (`recurrent_rule`).
    """

    def __init__(self, cfg: HybridConfig, max_context: int, tap_layer_ids=(), streams: int = 1,
                 dtype=torch.float32, device=None, attention: str = "matmul", state_slots: int = 16,
                 prefill_form: str = "chunked"):
        super().__init__()
        self.cfg = cfg
        self.max_context = max_context
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.prefill_form = prefill_form
        body = HybridBody(cfg, dtype, device, attention)
        if cfg.weight_prefix == "model.language_model.":
            self.model = nn.Module()
            self.model.language_model = body
            # the drafter reads target.model.embed_tokens; an alias outside the module tree, so
            # that the parameter keeps its one checkpoint key
            object.__setattr__(self.model, "embed_tokens", body.embed_tokens)
        else:
            self.model = body
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = body.embed_tokens.weight
        shape = (streams, len(cfg.attention_layers), 2, max_context, cfg.kv_dim)
        self.register_buffer("kv_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.state = RecurrentState(cfg, streams, state_slots, dtype, device)

    @property
    def body(self) -> HybridBody:
        return self.model.language_model if hasattr(self.model, "language_model") else self.model

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, sampling: Sampling | None = None,
                read_len: int | None = None, use_cache: bool = True,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run T new tokens per stream at positions [start, start + T): `Qwen3.forward`'s arguments
        and results (chosen int64 [S, T], logits float32 [S, T, V], taps [S, T, n_taps * hidden]).

        With use_cache, the KV cache rows [start, start + T) are written and the DeltaNet layers
        resume from the state after position start - 1 (zeros at start 0), then keep the state
        after each row (T <= state_slots, the token-by-token rule) or after the last row (longer
        calls, `prefill_form`). Without it (training), each call starts from zero states and keeps none.
        """
        read_len = self.max_context if read_len is None else read_len
        positions = start[:, None] + torch.arange(tokens.shape[1], dtype=torch.int64, device=tokens.device)
        cached = None
        if use_cache:
            cache, rows = self.kv_cache, cache_rows(self.kv_cache, positions)

            def cached(layer: int, q, k, v, gate, attention: str):
                write_cache(cache, rows[layer], k, v)
                return gated_cache_attention(q, gate, cache, layer, read_len, positions, attention)
        return self.step(tokens, start, positions, cached, sampling, last_only)

    def step(self, tokens: torch.Tensor, start: torch.Tensor, positions: torch.Tensor, cached,
             sampling: Sampling | None, last_only: bool, stream=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` with the KV cache's part given: cached(attention layer index, q, k, v, gate,
        attention form) writes k, v and returns the gated attention over the cache (None: no cache,
        no state kept).
        stream: None (tokens [S, T], every stream) or one stream's slot (tokens [1, T]; an int, or
        export/stream_entry_points.py `_slot_index`'s SymInt), whose recurrent state alone is read
        and written. Returns `forward`'s results."""
        T = tokens.shape[1]
        cfg = self.cfg
        body = self.body
        x = body.embed_tokens(tokens)
        cos, sin = rope_tables(positions, cfg, x.dtype)
        per_token = T <= self.state.slots or self.prefill_form == "per_token"
        keep_rows = T <= self.state.slots
        if cached is not None:
            gdn0, conv0 = self.state.read(start, stream)
        else:
            S = tokens.shape[0]
            gdn0 = torch.zeros(S, len(cfg.gdn_layers), *self.state.gdn_slots.shape[3:], device=tokens.device)
            conv0 = torch.zeros(S, len(cfg.gdn_layers), *self.state.conv_slots.shape[3:], dtype=x.dtype,
                                device=tokens.device)
        kept_gdn, kept_conv, taps = [], [], {}
        n_attn = n_gdn = 0
        # Exported, each GDN layer's rule is the named op `dflash::gated_delta_rule` (export/lower_gdn.py:
        # the kernels/gdn/ step on a GPU), the slots a value threaded through the layers and stored
        # once at the end. Eager, and the ops given to IREE, compute what the code without the op
        # computes. A call longer than the slots (a prefill) runs as blocks of up to PREFILL_BLOCK
        # rows, each keeping its last state in slot 0, where the next block resumes.
        rule_op = ops.exporting() and cached is not None and bool(cfg.gdn_layers)
        if rule_op:
            threaded = {"slots": self.state.gdn_slots, "rows": self.state.rows(start, stream)}
            last_gdn = len(cfg.gdn_layers) - 1
            resume = threaded["rows"][:, 1:].expand(-1, 2)  # read and write the row of slot 0

            def rule(l: int, lin, mixed, b, a, o, states):
                # the reference slots: unchanged until the last GDN layer, whose carry every layer's states
                ref = (self.state.written_gdn(start, kept_gdn + [states if keep_rows else states[-1:]], stream)
                       if l == last_gdn
                       else threaded["slots"])
                blocks = [(0, T)] if keep_rows else [(t, min(t + PREFILL_BLOCK, T)) for t in range(0, T, PREFILL_BLOCK)]
                outs = []
                for t0, t1 in blocks:
                    o_t, threaded["slots"] = ops.gated_delta_rule(
                        mixed[:, t0:t1], b[:, t0:t1], a[:, t0:t1], lin.A_log, lin.dt_bias,
                        threaded["rows"] if t0 == 0 else resume, threaded["slots"], l, cfg.linear_num_key_heads,
                        keep_rows, o[:, t0:t1], ref if t1 == T else threaded["slots"])
                    outs.append(o_t)
                return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        for i, layer in enumerate(body.layers):
            if layer.layer_type == "full_attention":
                x = layer.attend(x, cos, sin, positions, None if cached is None else partial(cached, n_attn))
                n_attn += 1
            else:
                x, states, windows = layer.mix(x, gdn0[:, n_gdn], conv0[:, n_gdn], per_token,
                                               partial(rule, n_gdn, layer.linear_attn) if rule_op else None)
                kept_gdn.append(states if keep_rows else states[-1:])
                kept_conv.append(windows if keep_rows else windows[:, -1:])
                n_gdn += 1
            if i in self.tap_layer_ids:
                taps[i] = x
        if cached is not None:
            if rule_op:
                self.state.gdn_slots.copy_(threaded["slots"])
            self.state.write(start, None if rule_op else kept_gdn, kept_conv, stream)
            self.state.commit(start, T, keep_rows, stream)
        h = body.norm(x)
        if cfg.num_hidden_layers - 1 in taps:
            taps[cfg.num_hidden_layers - 1] = h  # HF's hidden_states[L] is taken after the final norm
        tapped = torch.cat([taps[i] for i in self.tap_layer_ids], -1) if taps else x[..., :0]
        if last_only:
            h, positions = h[:, -1:], positions[:, -1:]
        logits = as_float32(project(h, [self.lm_head])[0])
        chosen = choose_tokens(logits, positions + 1, sampling)
        return chosen, logits, tapped
