"""The per-stream entry points of a module with several streams (S > 1): one stream's prompt
prefilled into its own slot of the KV caches, leaving the other streams' slots untouched.

Every other entry point already keeps each stream's state its own: `start` [S] is each stream's
cache write position, and attention masks key rows past each stream's own query positions, so the
shared `pages` length is only an upper bound of the rows read (the longest stream's), never what a
stream sees. What a module of S streams cannot do with [S, T] steps is let one request join while
the others run: a prefill of [S, T] would write T rows into every slot. So for S > 1 the module
also has
- `prefill_stream` (and `prefill_stream_sampled`): tokens [1, T] at positions [start, start + T) of
  stream `stream`'s slot of the target's KV cache; chosen after the last row, taps returned;
- `absorb_stream`: R rows of taps into stream `stream`'s slot of the drafter's context cache.

A module of one stream has neither (its `prefill` and `absorb` serve its only slot), so its
signatures, records and spliced kernels are those of before. The layers are the model's own
(export/qwen3.py, export/dflash.py); only the cache rows differ: one stream's, found by index on the
flat cache view, as `cache_rows` finds all streams' (one `index_copy_` to write, one `index_select`
to read: the forms IREE compiles on a mutable global). The attention of these calls is IREE's (no
block-attention splice: that kernel reads all S streams of the cache).
"""

from __future__ import annotations

import torch

from dflash_iree.manifest import KV_PAGE

from . import draft_window
from .entry_points import EntryPoint, ExportShapes, TensorSpec
from .qwen3 import attention_fn, project, rope_tables
from .sampling import Sampling, choose_tokens


def stream_entry_points(shapes: ExportShapes, sampled: bool = True) -> list[EntryPoint]:
    """The per-stream entry points (none for S = 1), in export order."""
    if shapes.streams == 1:
        return []
    N, dt = shapes.tap_width, shapes.dtype
    one = lambda name: TensorSpec(name, (1,), "i64")  # noqa: E731
    pages = TensorSpec("pages", ("P",), "i8")
    sampling = (TensorSpec("temperature", (1,), "f32"), TensorSpec("top_k", (1,), "i64"),
                TensorSpec("top_p", (1,), "f32"), TensorSpec("seed", (1,), "i64"))
    chosen = TensorSpec("chosen", (1, 1), "i64")
    taps = lambda t: TensorSpec("taps", (1, t, N), dt)  # noqa: E731
    doc = ("Run one stream's prompt (or a chunk of it) at positions [start, start+T) into slot `stream` "
           "(0..S-1) of the KV cache, the other slots untouched; chosen is the target's token after the last "
           "row; taps (keep on the device) feed `absorb_stream`.")
    out = []
    for suffix, extra in (("", ()), ("_sampled", sampling)) if sampled else (("", ()),):
        out.append(EntryPoint("prefill_stream" + suffix, "target",
                              (TensorSpec("tokens", (1, "T"), "i64"), one("stream"), one("start"), pages) + extra
                              + (chosen,), (taps("T"),), doc, ("chosen",)))
    out.append(EntryPoint("absorb_stream", "drafter", (taps("R"), one("stream"), one("start")),
                          (TensorSpec("ctx_len", (1,), "i64"),),
                          "Project R context rows of one stream (the target's taps at positions [start, start+R)) "
                          "into slot `stream` of the drafter's context cache; returns start + R."))
    return out


def _slot_rows(cache: torch.Tensor, stream: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """Rows of cache [S, L, 2, C, D]'s flat [S*L*2*C, D] view holding the keys (then, + C, the values)
    of `positions` (int64 [T]) in layer `layer` of slot `stream` (int64 [1]): int64 [T]."""
    _, L, _, C, _ = cache.shape
    return (stream * L + layer) * 2 * C + positions


def _write_slot(cache: torch.Tensor, stream, layer: int, positions, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [1, T, Hkv, hd] into one layer of slot `stream` at `positions` [T], in place."""
    C, D = cache.shape[3], cache.shape[4]
    rows = _slot_rows(cache, stream, layer, positions)
    T = k.shape[1]
    values = torch.cat([k.reshape(T, D), v.reshape(T, D)], 0).to(cache.dtype)
    cache.view(-1, D).index_copy_(0, torch.cat([rows, rows + C]), values)


def _read_slot(cache: torch.Tensor, stream, layer: int, read_len: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, read_len, Hkv, hd] of the first read_len rows of one layer of slot `stream`."""
    C, D = cache.shape[3], cache.shape[4]
    rows = _slot_rows(cache, stream, layer, torch.arange(read_len, dtype=torch.int64, device=cache.device))
    flat = cache.view(-1, D)
    shape = (1, read_len, D // hd, hd)
    return flat.index_select(0, rows).view(shape), flat.index_select(0, rows + C).view(shape)


def target_prefill_stream(target, tokens: torch.Tensor, stream: torch.Tensor, start: torch.Tensor, read_len: int,
                          sampling: Sampling | None) -> tuple[torch.Tensor, torch.Tensor]:
    """export/qwen3.py `Qwen3.forward` with last_only for one stream's slot of the cache.

    Args:
        tokens: int64 [1, T]; stream: int64 [1], the slot; start: int64 [1], position of tokens[:, 0].
        read_len: cache rows attention reads (>= start + T).
        sampling: None (greedy) or [1]-shaped parameters.

    Returns:
        chosen int64 [1, 1] (the token after the last row), taps [1, T, n_taps * hidden].
    """
    T = tokens.shape[1]
    cfg, cache = target.cfg, target.kv_cache
    pos = start + torch.arange(T, dtype=torch.int64, device=tokens.device)
    positions = pos[None, :]
    x = target.model.embed_tokens(tokens)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
    key_pos = torch.arange(read_len, dtype=torch.int64, device=tokens.device)
    visible = key_pos[None, None, :] <= positions[:, :, None]
    taps = {}
    for i, layer in enumerate(target.model.layers):
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
        _write_slot(cache, stream, i, pos, k, v)
        keys, values = _read_slot(cache, stream, i, read_len, cfg.head_dim)
        x = layer.finish(x, attention_fn(layer.attention)(q, keys, values, visible))
        if i in target.tap_layer_ids:
            taps[i] = x
    h = target.model.norm(x)
    if cfg.num_hidden_layers - 1 in taps:  # HF's hidden_states[L] is after the final norm, as in Qwen3.forward
        taps[cfg.num_hidden_layers - 1] = h
    tapped = torch.cat([taps[i] for i in target.tap_layer_ids], -1) if taps else x[..., :0]
    logits = project(h[:, -1:], [target.lm_head])[0].float()
    return choose_tokens(logits, positions[:, -1:] + 1, sampling), tapped


def drafter_absorb_stream(drafter, taps: torch.Tensor, stream: torch.Tensor, start: torch.Tensor) -> None:
    """export/dflash.py `DFlashDrafter.absorb` into one stream's slot: taps [1, R, N] at positions
    [start, start + R) (start, stream: int64 [1]); a ring cache keeps its window of them
    (export/draft_window.py)."""
    R = taps.shape[1]
    pos = start + torch.arange(R, dtype=torch.int64, device=taps.device)
    ctx = drafter.hidden_norm(project(taps.to(drafter.fc.weight.dtype), [drafter.fc])[0])
    cos, sin = rope_tables(pos[None, :], drafter.cfg.head_dim, drafter.cfg.rope_theta, ctx.dtype)
    kv = project(ctx, [p for layer in drafter.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)])
    slots = draft_window.absorb_slots(pos[None], start + R, drafter.ring, drafter.block_size)[0]
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.rotate_kv(kv[2 * i], kv[2 * i + 1], cos, sin)
        _write_slot(drafter.ctx_cache, stream, i, slots, k, v)


# The exported bodies (the root `Pair` first, as in export/entry_points.py).
def prefill_stream(m, tokens, stream, start, pages, chosen):
    c, taps = target_prefill_stream(m.target, tokens, stream, start, pages.shape[0] * KV_PAGE, None)
    chosen.copy_(c)
    return taps


def prefill_stream_sampled(m, tokens, stream, start, pages, temperature, top_k, top_p, seed, chosen):
    c, taps = target_prefill_stream(m.target, tokens, stream, start, pages.shape[0] * KV_PAGE,
                                    Sampling(temperature, top_k, top_p, seed))
    chosen.copy_(c)
    return taps


def absorb_stream(m, taps, stream, start):
    drafter_absorb_stream(m.drafter, taps, stream, start)
    return start + taps.shape[1]


STREAM_BODIES = {f.__name__: f for f in (prefill_stream, prefill_stream_sampled, absorb_stream)}
