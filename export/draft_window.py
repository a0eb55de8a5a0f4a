"""Sliding-window drafter attention: which context rows each drafter layer sees, and the ring cache.

A drafter layer of type `sliding_attention` (window W) is causal over the block and sees a key at
position k from a query at position q only when q - k < W (z-lab/dflash `dflash/model.py`,
`Qwen3DFlashAttention` and `_attention_mask`: is_causal defaults to the layer being a sliding one).
A `full_attention` layer sees the whole context and the whole block.

When every drafter layer slides, the context cache needs no more than the window: it becomes a
ring of W + B slots, plus one slot that is never read. Position p lives in slot p mod (W + B), so
the cache's bytes do not grow with max_context. The B extra slots are there because a round
absorbs up to B rows past the block start (padding, or rows a later round rejects) before the
next round overwrites them: with W + B slots such a write can only land on a position older than
any query's window. Rows of one absorb that would collide (a prompt longer than the ring, or
padding beyond those B rows) go to the spare slot instead.

The cache then gets unused slots up to the next multiple of KEY_ALIGN keys (cache rows + the B block
rows), which nothing writes and no query sees: with a window of 2048 and B = 8 the attention's
static key count was 2065, and IREE's attention at that odd length took 1.20 ms a layer on the H200,
against 0.18 ms at 2112 (experiments/2026-12-04-dflash2-27b/attn_probe_h200.txt).
"""

from __future__ import annotations

import torch

from dflash_iree.config import DrafterConfig

KEY_ALIGN = 64


def ring_slots(cfg: DrafterConfig, block_size: int) -> int | None:
    """The ring's slot count W + B when every layer of `cfg` slides (W the largest window), else None
    (the context cache is max_context rows, one per position)."""
    windows = cfg.layer_windows
    if not windows or not all(windows):
        return None
    return max(windows) + block_size


def cache_length(cfg: DrafterConfig, block_size: int, max_context: int) -> int:
    """Rows per layer of the drafter's context cache: max_context, or the ring plus its spare slot,
    padded so that the rows and the block's B keys come to a multiple of KEY_ALIGN."""
    ring = ring_slots(cfg, block_size)
    if ring is None:
        return max_context
    return -(-(ring + 1 + block_size) // KEY_ALIGN) * KEY_ALIGN - block_size


def absorb_slots(positions: torch.Tensor, start: torch.Tensor, ring: int | None, block_size: int) -> torch.Tensor:
    """Cache slots for the context rows at int64 positions [S, R] of one absorb whose block starts at
    int64 start [S]: the positions themselves without a ring; with one, p mod ring for
    start - (ring - B) <= p < start + B, and the spare slot `ring` for every other row."""
    if ring is None:
        return positions
    lo, hi = start[:, None] - (ring - block_size), start[:, None] + block_size
    keep = torch.logical_and(positions >= lo, positions < hi)  # not `&`: torch-mlir in IREE 3.13 has no aten.__and__
    return torch.where(keep, positions % ring, torch.full_like(positions, ring))


def slot_positions(start: torch.Tensor, n_slots: int, ring: int | None) -> torch.Tensor:
    """int64 [S, n_slots]: the position whose keys each cache slot holds for a block at start [S], or
    -1 where the slot holds nothing the block may read (past the block start; the spare slot).
    With a ring, slot j holds the latest position p < start with p mod ring == j."""
    j = torch.arange(n_slots, dtype=torch.int64, device=start.device)[None, :]
    s = start[:, None]
    if ring is None:
        return torch.where(j < s, j, torch.full_like(j, -1))
    held = s - 1 - torch.remainder(s - 1 - j, ring)
    return torch.where(torch.logical_and(j < ring, held >= 0), held, torch.full_like(held, -1))


def visibility(held: torch.Tensor, positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What each block query sees: bool [S, B, N] of the N cached context slots and bool [S, B, B]
    of the block (export/dflash.py `DrafterLayer.attend_block`'s ctx_visible and block_visible).

    Args:
        held: int64 [S, N], `slot_positions` (-1: never visible).
        positions: int64 [S, B], the block's absolute positions.
        window: 0 for a full_attention layer (every held slot, the whole block); W for a
            sliding_attention layer (causal over the block, keys within q - k < W).
    """
    S, B = positions.shape
    ctx = (held >= 0)[:, None, :].expand(S, B, held.shape[1])
    block = torch.ones(B, B, dtype=torch.bool, device=positions.device)
    if window:
        ctx = torch.logical_and(ctx, positions[:, :, None] - held[:, None, :] < window)
        i = torch.arange(B, device=positions.device)
        block = torch.logical_and(i[None, :] <= i[:, None], i[:, None] - i[None, :] < window)
    return ctx, block[None].expand(S, B, B)
