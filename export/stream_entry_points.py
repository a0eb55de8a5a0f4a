"""The per-stream entry points of a module with several streams (S > 1): one stream's step in its
own slot of the KV caches, leaving the other streams' slots untouched.

Every other entry point already keeps each stream's state its own: `start` [S] is each stream's
cache write position, and attention masks key rows past each stream's own query positions, so the
shared `pages` length is only an upper bound of the rows read (the longest stream's), never what a
stream sees. What a module of S streams cannot do with [S, T] steps is let one request join while
the others run (a prefill of [S, T] would write T rows into every slot), nor run one stream for
the cost of one: every [S, B] round computes all S slots, so 1-stream DFlash on the 4-stream
module ran at 0.86x the one-stream module on the H200 (issue #29). So for S > 1 the module also has
- `prefill_stream` (and `prefill_stream_sampled`): tokens [1, T] at positions [start, start + T) of
  stream `stream`'s slot of the target's KV cache; chosen after the last row, taps returned;
- `absorb_stream`: R rows of taps into stream `stream`'s slot of the drafter's context cache;
- `decode_stream` (and `_sampled`): `decode` of one stream, tokens [1, 1];
- `verify_draft_stream` (and `_sampled`): `verify_draft` of one stream, tokens [1, B], n_draft
  [1]: the round in slot `stream` of both caches, outputs laid out as `verify_draft`'s with S = 1.
The batch engine calls the last two (and `prefill_stream` + `absorb_stream` as its plain step)
when exactly one stream runs (runtime/stream_calls.py).

A module of one stream has none (its own entry points serve its only slot), so its signatures,
records, spliced kernels and exported MLIR are those of before. The layers are the model's own
(export/qwen3.py, export/dflash.py `draft_block`); only the cache rows differ: one slot's. Writes
are one `index_copy_` per layer on the flat cache view at that slot's rows (the form IREE compiles
on a mutable global; one index vector plus a constant per layer, as `cache_rows` for S > 1). Reads
are two `narrow`s of the flat view at a dynamic start: a slice at a runtime offset, which IREE folds
into the dispatch that reads it, where an `index_select` of the rows (the form before) gathered them
into a new tensor every layer (experiments/2026-12-02-one-stream/). The slot comes as the *shape*
of the `stream` argument (int8 [slot + 1], contents ignored; `slot_arg`), as `pages` brings the
rows read: a dynamic dim is a host value of the call, where a slot read from an int64 tensor's
contents made every call wait on a device-to-host read before it could dispatch. The target's
attention is the named op `dflash::block_attention` over the cache viewed as one stream of S * L
layers at the runtime layer slot * L + l (`_slot_attention`), so GPU archs run the block-attention
kernel here as in `verify_draft`; the linears and the head norm + rope are the model's named ops,
spliced as in the other entry points.
"""

from __future__ import annotations

import torch

from . import draft_window, ops
from .entry_points import EntryPoint, ExportShapes, TensorSpec, _read_len, verify_then_draft
from .qwen3 import as_float32, attention_fn, project, query_rows_mask, rope_tables
from .sampling import Sampling, choose_tokens


def stream_entry_points(shapes: ExportShapes, sampled: bool = True) -> list[EntryPoint]:
    """The per-stream entry points (none for S = 1), in export order."""
    if shapes.streams == 1:
        return []
    N, dt = shapes.tap_width, shapes.dtype
    one = lambda name: TensorSpec(name, (1,), "i64")  # noqa: E731
    slot = TensorSpec("stream", ("Q",), "i8")
    pages = TensorSpec("pages", ("P",), "i8")
    sampling = (TensorSpec("temperature", (1,), "f32"), TensorSpec("top_k", (1,), "i64"),
                TensorSpec("top_p", (1,), "f32"), TensorSpec("seed", (1,), "i64"))
    chosen = TensorSpec("chosen", (1, 1), "i64")
    taps = lambda t: TensorSpec("taps", (1, t, N), dt)  # noqa: E731
    doc = ("Run one stream's prompt (or a chunk of it) at positions [start, start+T) into slot `stream` "
           "(0..S-1) of the KV cache, the other slots untouched; chosen is the target's token after the last "
           "row; taps (keep on the device) feed `absorb_stream`.")
    T = shapes.prefill_chunk or "T"
    if shapes.prefill_chunk:
        doc += (f" T is {T} rows (a hybrid target's prefill chunk); the runtime runs a prompt's remainder "
                "through `verify_stream`.")
    B = shapes.block_size
    out = []
    for suffix, extra in (("", ()), ("_sampled", sampling)) if sampled else (("", ()),):
        out.append(EntryPoint("prefill_stream" + suffix, "target",
                              (TensorSpec("tokens", (1, T), "i64"), slot, one("start"), pages) + extra
                              + (chosen,), (taps(T),), doc, ("chosen",)))
        if shapes.prefill_chunk:
            out.append(EntryPoint("verify_stream" + suffix, "target",
                                  (TensorSpec("tokens", (1, B), "i64"), slot, one("start"), pages) + extra
                                  + (TensorSpec("chosen", (1, B), "i64"),), (taps(B),),
                                  "`verify` of one stream in slot `stream`, the other slots untouched: a hybrid "
                                  "target's prompt remainder, each row's recurrent state kept, so that the padding "
                                  "of its last block rolls back by the next call's start.", ("chosen",)))
    out.append(EntryPoint("absorb_stream", "drafter", (taps("R"), slot, one("start")),
                          (TensorSpec("ctx_len", (1,), "i64"),),
                          "Project R context rows of one stream (the target's taps at positions [start, start+R)) "
                          "into slot `stream` of the drafter's context cache; returns start + R."))
    n_draft = one("n_draft")
    for suffix, extra in (("", ()), ("_sampled", sampling)) if sampled else (("", ()),):
        out.append(EntryPoint("decode_stream" + suffix, "target",
                              (TensorSpec("tokens", (1, 1), "i64"), slot, one("start"), pages) + extra
                              + (chosen,), (),
                              "`decode` of one stream: its token at position start of slot `stream`, the other "
                              "slots untouched.", ("chosen",)))
        out.append(EntryPoint("verify_draft_stream" + suffix, "target",
                              (TensorSpec("tokens", (1, B), "i64"), slot, one("start"), n_draft, pages)
                              + extra + (TensorSpec("round", (1, 2 * B), "i64"),), (taps(B),),
                              "`verify_draft` of one stream in slot `stream` of both caches, the other slots "
                              "untouched: the same round and outputs, with S = 1.", ("round",)))
    return out


def slot_arg(slot: int) -> torch.Tensor:
    """The `stream` argument naming slot `slot` (0..S-1): int8 [slot + 1], its contents ignored."""
    return torch.zeros(slot + 1, dtype=torch.int8)


def _slot_index(stream: torch.Tensor, streams: int):
    """The slot that `stream` (`slot_arg`) names: its length - 1, an int (under torch.export, the
    dynamic dim Q - 1, whose range [1, S] proves every slice of that slot inside the cache), checked
    to lie in [0, streams)."""
    s = stream.shape[0] - 1
    torch._check(s >= 0)
    torch._check(s < streams)
    return s


def _slot_rows(cache: torch.Tensor, slot, positions: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """Per layer, the rows of cache [S, L, 2, C, D]'s flat [S*L*2*C, D] view holding the keys, then
    the values, of `positions` (int64 [T]) in slot `slot` (`_slot_index`'s int), indexed by layer.

    A static T (decode, verify, the round's absorb): one int64 [L, 2T] tensor, export/qwen3.py
    `cache_rows`' one-stream form, computed once a call; each layer's write indexes a row of it
    inside its scatter (one index dispatch a layer cost the demo round 5 dispatches more than
    `verify_draft`'s). A dynamic T (prefill, absorb): L int64 [2T] vectors, each layer adding its
    constant offset, `cache_rows`' form for S > 1, which IREE's GPU codegen takes."""
    _, L, _, C, _ = cache.shape
    if isinstance(positions.shape[0], int):
        layers = torch.arange(L, dtype=torch.int64, device=positions.device)[:, None]
        at = (slot * L + layers) * (2 * C) + positions[None, :]  # L, T
        return torch.cat([at, at + C], 1)
    at = slot * (L * 2 * C) + positions
    flat = torch.cat([at, at + C])
    return [flat + layer * 2 * C for layer in range(L)]


def _write_slot(cache: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [1, T, Hkv, hd] into the cache at one layer's `_slot_rows` [2T], in place (one `index_copy_`
    on the flat view, as export/qwen3.py `write_cache`: the form IREE compiles on a mutable global)."""
    D = cache.shape[4]
    T = k.shape[1]
    values = torch.cat([k.reshape(T, D), v.reshape(T, D)], 0).to(cache.dtype)
    cache.view(-1, D).index_copy_(0, rows, values)


def _read_slot(cache: torch.Tensor, slot, layer: int, read_len: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, read_len, Hkv, hd] of the first read_len rows of one layer of slot `slot`
    (`_slot_index`'s int): two slices of the flat view at a dynamic start, no copy (an `index_select`
    of the rows gathered them into a new tensor every layer: experiments/2026-12-02-one-stream/)."""
    _, L, _, C, D = cache.shape
    flat = cache.view(-1, D)
    base = (slot * L + layer) * 2 * C
    shape = (1, read_len, D // hd, hd)
    return flat.narrow(0, base, read_len).view(shape), flat.narrow(0, base + C, read_len).view(shape)


def _slot_attention(q: torch.Tensor, cache: torch.Tensor, slot, layer: int, read_len: int, visible: torch.Tensor,
                    attention: str, gate: torch.Tensor | None = None) -> torch.Tensor:
    """export/qwen3.py `cache_attention` in slot `slot` (`_slot_index`'s int): q [1, T, Hq, hd] over
    the first read_len rows of one layer of that slot (visible [1, T, read_len]); [1, T, Hq * hd],
    times sigmoid(gate [1, T, Hq * hd]) with a gate (a hybrid target's, export/qwen35.py).

    Exported, the named op `dflash::block_attention` over the cache viewed as one stream of S * L
    layers, at layer slot * L + layer: a runtime layer, which the block-attention kernel takes as an
    argument (export/lower_attention.py), so the one-stream round runs the kernel that `verify_draft`
    runs where IREE's attention cost more (the 8B round: 11.46 against 9.32 ms,
    experiments/2026-12-02-streams-8b/)."""
    hd = q.shape[-1]
    keys, values = _read_slot(cache, slot, layer, read_len, hd)
    out = attention_fn(attention)(q, keys, values, visible)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    if not ops.exporting():
        return out
    S, L = cache.shape[:2]
    one = cache.view(1, S * L, *cache.shape[2:])
    g = q.shape[2] // (cache.shape[-1] // hd)  # query heads per KV head
    return ops.block_attention(q, one, slot * L + layer, query_rows_mask(visible, g), out, gate)


def target_step_stream(target, tokens: torch.Tensor, stream: torch.Tensor, start: torch.Tensor, read_len: int,
                       sampling: Sampling | None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """export/qwen3.py `Qwen3.forward` for one stream's slot of the cache.

    Args:
        tokens: int64 [1, T]; stream: int8 [slot + 1] (`slot_arg`); start: int64 [1], position of tokens[:, 0].
        read_len: cache rows attention reads (>= start + T).
        sampling: None (greedy) or [1]-shaped parameters.
        last_only: choose a token for the last row only (prefill).

    Returns:
        chosen int64 [1, T] ([1, 1] with last_only), the target's token after each row;
        taps [1, T, n_taps * hidden].
    """
    if hasattr(target, "state"):
        return _hybrid_step_stream(target, tokens, stream, start, read_len, sampling, last_only)
    T = tokens.shape[1]
    cfg, cache = target.cfg, target.kv_cache
    slot = _slot_index(stream, cache.shape[0])
    pos = start + torch.arange(T, dtype=torch.int64, device=tokens.device)
    positions = pos[None, :]
    x = target.model.embed_tokens(tokens)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype, cfg.yarn)
    key_pos = torch.arange(read_len, dtype=torch.int64, device=tokens.device)
    visible = key_pos[None, None, :] <= positions[:, :, None]
    rows = _slot_rows(cache, slot, pos)
    taps = {}
    for i, layer in enumerate(target.model.layers):
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
        _write_slot(cache, rows[i], k, v)
        x = layer.finish(x, _slot_attention(q, cache, slot, i, read_len, visible, layer.attention))
        if i in target.tap_layer_ids:
            taps[i] = x
    h = target.model.norm(x)
    if cfg.num_hidden_layers - 1 in taps:  # HF's hidden_states[L] is after the final norm, as in Qwen3.forward
        taps[cfg.num_hidden_layers - 1] = h
    tapped = torch.cat([taps[i] for i in target.tap_layer_ids], -1) if taps else x[..., :0]
    if last_only:
        h, positions = h[:, -1:], positions[:, -1:]
    logits = as_float32(project(h, [target.lm_head])[0])
    return choose_tokens(logits, positions + 1, sampling), tapped


def _hybrid_step_stream(target, tokens, stream, start, read_len, sampling, last_only):
    """`target_step_stream` of a hybrid target (export/qwen35.py `Qwen35.step`): its attention layers
    write and read their slot of the KV cache, its DeltaNet layers the slot's recurrent state."""
    cache = target.kv_cache
    slot = _slot_index(stream, cache.shape[0])
    pos = start + torch.arange(tokens.shape[1], dtype=torch.int64, device=tokens.device)
    positions = pos[None, :]
    visible = torch.arange(read_len, dtype=torch.int64, device=tokens.device)[None, None, :] <= positions[:, :, None]
    rows = _slot_rows(cache, slot, pos)

    def cached(layer: int, q, k, v, gate, attention: str):
        _write_slot(cache, rows[layer], k, v)
        return _slot_attention(q, cache, slot, layer, read_len, visible, attention, gate)
    chosen, _, taps = target.step(tokens, start, positions, cached, sampling, last_only, slot)
    return chosen, taps


def drafter_absorb_stream(drafter, taps: torch.Tensor, stream: torch.Tensor, start: torch.Tensor,
                          n_valid: torch.Tensor | None = None) -> None:
    """export/dflash.py `DFlashDrafter.absorb` into one stream's slot: taps [1, R, N] at positions
    [start, start + R) of slot `stream` (`slot_arg`; start, n_valid: int64 [1]; n_valid, the real
    rows, default R); a ring cache keeps its window of them (export/draft_window.py)."""
    R = taps.shape[1]
    pos = start + torch.arange(R, dtype=torch.int64, device=taps.device)
    ctx = drafter.hidden_norm(project(taps.to(drafter.fc.weight.dtype), [drafter.fc])[0])
    cos, sin = rope_tables(pos[None, :], drafter.cfg.head_dim, drafter.cfg.rope_theta, ctx.dtype,
                           drafter.cfg.yarn)
    kv = project(ctx, [p for layer in drafter.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)])
    block_start = start + (R if n_valid is None else n_valid)
    slots = draft_window.absorb_slots(pos[None], block_start, drafter.ring, drafter.block_size)[0]
    rows = _slot_rows(drafter.ctx_cache, _slot_index(stream, drafter.ctx_cache.shape[0]), slots)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.rotate_kv(kv[2 * i], kv[2 * i + 1], cos, sin)
        _write_slot(drafter.ctx_cache, rows[i], k, v)


def drafter_draft_stream(drafter, target, taps, stream, ctx_start, n_valid, anchor, read_len: int,
                         sampling: Sampling | None) -> tuple[torch.Tensor, torch.Tensor]:
    """export/dflash.py `DFlashDrafter.forward` in one stream's slot of the context cache: absorb the
    first n_valid rows of taps [1, R, N] at ctx_start, draft the block after anchor (all int64 [1]).
    Returns draft int64 [1, B - 1] and logits float32 [1, B - 1, V]."""
    drafter_absorb_stream(drafter, taps, stream, ctx_start, n_valid)
    slot = _slot_index(stream, drafter.ctx_cache.shape[0])
    hd = drafter.cfg.head_dim
    context = lambda layer, n: _read_slot(drafter.ctx_cache, slot, layer, n, hd)  # noqa: E731
    return drafter.draft_block(target, ctx_start, n_valid, anchor, read_len, sampling, context)


# The exported bodies (the root `Pair` first, as in export/entry_points.py).
def _target_stream(m, tokens, stream, start, pages, sampling, chosen, last_only: bool):
    """`prefill_stream` (last_only) and `verify_stream`: the target's step in one slot, chosen
    written, taps returned."""
    c, taps = target_step_stream(m.target, tokens, stream, start, _read_len(pages), sampling, last_only)
    chosen.copy_(c)
    return taps


def prefill_stream(m, tokens, stream, start, pages, chosen):
    return _target_stream(m, tokens, stream, start, pages, None, chosen, last_only=True)


def prefill_stream_sampled(m, tokens, stream, start, pages, temperature, top_k, top_p, seed, chosen):
    return _target_stream(m, tokens, stream, start, pages, Sampling(temperature, top_k, top_p, seed), chosen,
                          last_only=True)


def verify_stream(m, tokens, stream, start, pages, chosen):
    return _target_stream(m, tokens, stream, start, pages, None, chosen, last_only=False)


def verify_stream_sampled(m, tokens, stream, start, pages, temperature, top_k, top_p, seed, chosen):
    return _target_stream(m, tokens, stream, start, pages, Sampling(temperature, top_k, top_p, seed), chosen,
                          last_only=False)


def absorb_stream(m, taps, stream, start):
    drafter_absorb_stream(m.drafter, taps, stream, start)
    return start + taps.shape[1]


def _decode_stream(m, tokens, stream, start, pages, sampling, chosen):
    c, _ = target_step_stream(m.target, tokens, stream, start, _read_len(pages), sampling)
    chosen.copy_(c)
    return ()


def decode_stream(m, tokens, stream, start, pages, chosen):
    return _decode_stream(m, tokens, stream, start, pages, None, chosen)


def decode_stream_sampled(m, tokens, stream, start, pages, temperature, top_k, top_p, seed, chosen):
    return _decode_stream(m, tokens, stream, start, pages, Sampling(temperature, top_k, top_p, seed), chosen)


def _verify_draft_stream(m, tokens, stream, start, n_draft, pages, sampling, round_):
    """export/entry_points.py `_verify_then_draft` in slot `stream`: the same round, [1]-shaped."""
    read_len = _read_len(pages)
    chosen, taps = target_step_stream(m.target, tokens, stream, start, read_len, sampling)
    draft = lambda n_valid, bonus: drafter_draft_stream(m.drafter, m.target, taps, stream, start, n_valid,  # noqa: E731
                                                        bonus, read_len, sampling)[0]
    return verify_then_draft(tokens, n_draft, chosen, taps, draft, round_)


def verify_draft_stream(m, tokens, stream, start, n_draft, pages, round):  # noqa: A002 (the manifest's name)
    return _verify_draft_stream(m, tokens, stream, start, n_draft, pages, None, round)


def verify_draft_stream_sampled(m, tokens, stream, start, n_draft, pages, temperature, top_k, top_p, seed,
                                round):  # noqa: A002
    return _verify_draft_stream(m, tokens, stream, start, n_draft, pages, Sampling(temperature, top_k, top_p, seed),
                                round)


STREAM_BODIES = {f.__name__: f for f in (prefill_stream, prefill_stream_sampled, verify_stream, verify_stream_sampled,
                                          absorb_stream, decode_stream, decode_stream_sampled, verify_draft_stream,
                                          verify_draft_stream_sampled)}
