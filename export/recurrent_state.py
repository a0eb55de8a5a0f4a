"""The recurrent state of a hybrid target's Gated DeltaNet layers, and its rollback on the device.

A speculative round runs the target over B rows [anchor, drafts], and only the first a + 1 are
kept; the KV cache rolls back by its length alone, a recurrent state does not. The state here
keeps one slot per verify row (vLLM's `spec_state_indices`, SGLang's intermediate state cache;
shared/notes/next-families.md §2): a call writes the state after each of its rows into slots
0..T-1 and records the position of row 0, and the next call, at position `start`, resumes from the
slot of the row at start - 1. So rejected rows are never read, no host copy is made, and the entry
points keep their arguments: the committed length the host passes as `start` picks the slot.
A call of more rows than slots (a long prefill) writes its last state only, to slot 0 (on a GPU
its blocks of 16 rows each write their last state there and the next block resumes from it).
Why slots and not checkpoint + replay (bytes and host times): experiments/2026-12-02-gdn-forms/README.md.

The buffers are non-persistent module globals, like the KV cache, zero-initialised and per stream:
- gdn_slots: float32 [S, slots, n_gdn, Hv, dk, dv];
- conv_slots: [S, slots, n_gdn, K - 1, conv_dim] in the model dtype (the conv's last inputs);
- slot_start: int64 [S], the position of row 0 of the last call's slots.
A call at start = 0 (a new sequence) reads a zero state.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_iree.config_qwen35 import HybridConfig


class RecurrentState(nn.Module):
    """Per-row state slots of every GDN layer (see the module docstring).

    Args:
        cfg: the hybrid target's config; streams: S; slots: rows a call may keep every state of
            (the verify block size B); dtype: the conv window's dtype (the model's).
    """

    def __init__(self, cfg: HybridConfig, streams: int, slots: int, dtype=torch.float32, device=None):
        super().__init__()
        n = len(cfg.gdn_layers)
        shape = (streams, slots, n, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.register_buffer("gdn_slots", torch.zeros(shape, dtype=torch.float32, device=device), persistent=False)
        conv = (streams, slots, n, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
        self.register_buffer("conv_slots", torch.zeros(conv, dtype=dtype, device=device), persistent=False)
        self.register_buffer("slot_start", torch.zeros(streams, dtype=torch.int64, device=device), persistent=False)

    @property
    def slots(self) -> int:
        return self.gdn_slots.shape[1]

    def _base(self, stream, device) -> torch.Tensor:
        """int64 [S'] flat row of slot 0 of each stream a call runs: every stream (stream None), or
        stream `stream` alone (an int, or the SymInt of export/stream_entry_points.py `_slot_index`)."""
        S, B = self.gdn_slots.shape[:2]
        if stream is None:
            return torch.arange(S, dtype=torch.int64, device=device) * B
        return torch.arange(1, dtype=torch.int64, device=device) + stream * B

    def slot(self, start: torch.Tensor, stream=None) -> torch.Tensor:
        """int64 [S'] (start's shape): the slot that holds the state after position start - 1 of each
        stream a call runs (`_base`), clamped into range (a start the last call did not reach is not
        a rollback this module can do)."""
        began = self.slot_start if stream is None else self.slot_start.narrow(0, stream, 1)
        return (start - 1 - began).clamp(0, self.slots - 1)

    def read(self, start: torch.Tensor, stream=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The states before position `start` (int64 [S'], S' = S, or 1 with `stream`: that stream
        alone): gdn [S', n_gdn, Hv, dk, dv] f32 and conv windows [S', n_gdn, K - 1, conv_dim]; zeros
        where start is 0."""
        S, B = self.gdn_slots.shape[:2]
        at = self._base(stream, start.device) + self.slot(start, stream)
        gdn = self.gdn_slots.view(S * B, *self.gdn_slots.shape[2:]).index_select(0, at)
        conv = self.conv_slots.view(S * B, *self.conv_slots.shape[2:]).index_select(0, at)
        fresh = (start == 0)[:, None, None, None]
        return torch.where(fresh[..., None], 0.0, gdn), torch.where(fresh, 0.0, conv).to(conv.dtype)

    def rows(self, start: torch.Tensor, stream=None) -> torch.Tensor:
        """int32 [S', 2] (S' and `stream` as in `read`): per stream the flat row (gdn_slots viewed as
        [S * slots, ...]) of the slot `read` reads, -1 where start is 0 (zeros), and the flat row of
        slot 0, which a call's row t writes at + t: the kernel's `rows` (export/ops.py `gated_delta_rule`)."""
        base = self._base(stream, start.device)
        at = torch.where(start == 0, -1, base + self.slot(start, stream))
        return torch.stack([at, base], 1).to(torch.int32)

    def _flat_rows(self, start: torch.Tensor, n_rows: int, stream=None) -> torch.Tensor:
        return (self._base(stream, start.device)[:, None]
                + torch.arange(n_rows, dtype=torch.int64, device=start.device)[None, :]).reshape(-1)

    def written_gdn(self, start: torch.Tensor, gdn: list[list[torch.Tensor]], stream=None) -> torch.Tensor:
        """gdn_slots with the states of `write` in place, as a new value (the buffer untouched): the
        export's reference of the slots after every GDN layer (export/qwen35.py `Qwen35.step`)."""
        S, B = self.gdn_slots.shape[:2]
        g = torch.stack([torch.stack(per_row, 1) for per_row in gdn], 2)  # S', T, n, Hv, dk, dv
        n = g.shape[0] * g.shape[1]
        flat = self.gdn_slots.view(S * B, *self.gdn_slots.shape[2:])
        return flat.index_copy(0, self._flat_rows(start, g.shape[1], stream), g.reshape(n, *g.shape[2:])).view(
            self.gdn_slots.shape)

    def write(self, start: torch.Tensor, gdn: list[list[torch.Tensor]] | None, conv: list[torch.Tensor],
              stream=None) -> None:
        """Keep a call's states, in place: gdn[l][t] [S', Hv, dk, dv] and conv[l] [S', T, K - 1, conv_dim],
        per GDN layer l the state after each row t (T of them, T <= slots) or after the last row only
        (T = 1; S' and `stream` as in `read`). gdn None: the conv windows only (the export's kernel form
        stores the gdn slots itself, export/qwen35.py `Qwen35.step`)."""
        S, B = self.gdn_slots.shape[:2]
        n_rows = conv[0].shape[1] if conv else 0
        if not n_rows:
            return
        c = torch.stack(conv, 2)  # S', T, n, K - 1, conv_dim
        rows = self._flat_rows(start, n_rows, stream)
        n = c.shape[0] * n_rows
        if gdn is not None:
            g = torch.stack([torch.stack(per_row, 1) for per_row in gdn], 2)  # S', T, n, Hv, dk, dv
            self.gdn_slots.view(S * B, *self.gdn_slots.shape[2:]).index_copy_(0, rows, g.reshape(n, *g.shape[2:]))
        self.conv_slots.view(S * B, *self.conv_slots.shape[2:]).index_copy_(
            0, rows, c.reshape(n, *c.shape[2:]).to(self.conv_slots.dtype))

    def commit(self, start: torch.Tensor, T: int, per_row: bool, stream=None) -> None:
        """Record where the slots just written start: row 0 at `start` (per_row) or, for a call
        that kept its last state only, at start + T - 1 (every stream's, or with `stream` that one's)."""
        # always a computed value: a buffer mutated to an entry point's own argument (copy_(start))
        # exported with no global store at all (iree-turbine 3.13), so the slots never moved
        began = start + (0 if per_row else T - 1)
        if stream is None:
            self.slot_start.copy_(began)
        else:
            self.slot_start.index_copy_(0, torch.arange(1, dtype=torch.int64, device=start.device) + stream, began)

    def nbytes(self) -> dict:
        """Bytes of each buffer (what the manifest records)."""
        return {name: buf.numel() * buf.element_size() for name, buf in self.named_buffers()}
