"""One compiled module on one device: typed calls to its entry points for a single stream.

Entry points (export/aot.py): `prefill`, `verify`, `decode`, `verify_draft` (each also
`*_sampled`), `absorb`, `draft`, and `draft_topk` when the artifacts were compiled with
`--draft-top-k K` (K >= 1). Every call passes `pages`, an int8 vector whose length bounds the KV cache rows that attention reads
(`kv_page` rows a page), so a step's cost follows the context length, not `max_context`. Taps stay
on the device: `prefill` and `verify` return them as device arrays and `absorb` / `draft` take
them back.

Host transfer contract: every device -> host copy goes through `CompiledPair._host`, which counts
the bytes in `host_bytes`. What it copies: the target's chosen tokens (int64, one per block row),
the draft ids (int64 [B - 1]), from `verify_draft` both in one int64 [2B] row with the device's
accepted-row count, and, from `draft_topk` only, the draft's top-K ids (int32
[B - 1, K]) and log-probs (float32 [B - 1, K]): 8 * (B - 1) * K more bytes a round. Never logits,
taps or caches (tests/test_runtime.py checks the count).
"""

from __future__ import annotations

import numpy as np


class CompiledPair:
    """Calls into a loaded module for stream 0.

    Args:
        device: the iree.runtime HalDevice.
        functions: entry-point name -> iree.runtime.FunctionInvoker.
        block_size, kv_page, tap_width: from the manifest.
        tap_dtype: numpy dtype of the taps (for the zero rows passed to the first `draft`).
    """

    def __init__(self, device, functions: dict, block_size: int, kv_page: int, tap_width: int, tap_dtype):
        self.device, self.fn = device, functions
        self.block_size, self.kv_page = block_size, kv_page
        self._zero_taps = np.zeros((1, block_size, tap_width), tap_dtype)
        self._sampling: tuple = ()
        self._suffix = ""
        self.host_bytes = 0  # bytes copied device -> host, for the transfer contract

    def _host(self, array) -> np.ndarray:
        """The one way results reach the host: token ids, and the draft top-K's [B - 1, K] arrays."""
        out = np.asarray(array)
        self.host_bytes += out.nbytes
        return out

    def set_sampling(self, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        """Greedy requests call the plain entry points; others the `*_sampled` ones."""
        if temperature > 0:
            self._suffix = "_sampled"
            self._sampling = (np.array([temperature], np.float32), np.array([top_k], np.int64),
                              np.array([top_p], np.float32), np.array([seed], np.int64))
        else:
            self._suffix, self._sampling = "", ()

    def _pages(self, rows: int) -> np.ndarray:
        return np.zeros(max(1, -(-rows // self.kv_page)), np.int8)

    def _target(self, name: str, tokens: list[int], start: int, *before_pages):
        args = (np.array([tokens], np.int64), np.array([start], np.int64), *before_pages,
                self._pages(start + len(tokens)))
        return self.fn[name + self._suffix](*args, *self._sampling)

    def prefill(self, ids: list[int]):
        """Run the prompt from position 0. Returns (first new token, taps device array [1, P, N])."""
        chosen, taps = self._target("prefill", ids, 0)
        return int(self._host(chosen)[0, -1]), taps

    def decode(self, token: int, start: int) -> int:
        """One plain step: the token at `start`; returns the target's next token."""
        return int(self._host(self._target("decode", [token], start))[0, -1])

    def _pad(self, block: list[int]) -> list[int]:
        # padding rows write KV past the committed length, which rollback by length discards
        return block + [block[-1]] * (self.block_size - len(block))

    def verify(self, block: list[int], start: int):
        """Verify [anchor, drafts...] (1..block_size ids) at position `start`, padded to block_size rows.

        Returns:
            (the target's token after each of the len(block) rows, taps device array [1, B, N]).
        """
        n = len(block)
        chosen, taps = self._target("verify", self._pad(block), start)
        return [int(t) for t in self._host(chosen)[0, :n]], taps

    def verify_draft(self, block: list[int], start: int):
        """One round in one call (the `verify_draft` entry point): verify [anchor, drafts...]
        (1..block_size ids) at position `start`, padded to block_size rows, then draft the next block
        on the device after the bonus token of the device's own acceptance count.

        Returns:
            (the target's token after each of the len(block) rows, the next draft [B - 1] ids, the
            rows the device accepted (its accepted + 1), taps device array [1, B, N] for a redone
            `draft`).
        """
        n = len(block)
        packed, taps = self._target("verify_draft", self._pad(block), start, np.array([n - 1], np.int64))
        row = [int(t) for t in self._host(packed)[0]]
        B = self.block_size
        return row[:n], row[B:2 * B - 1], row[2 * B - 1], taps

    def has_verify_draft(self) -> bool:
        """Whether the module has the one-call round for the current sampling mode (artifacts
        compiled before it existed have not)."""
        return "verify_draft" + self._suffix in self.fn

    def step_exact(self, token: int, start: int, fused: bool = False) -> int:
        """A plain step through the verify graph (the `exact` mode): row 0 of a padded block.

        fused: through `verify_draft` (its draft unused), the graph that drafted decoding verifies
            with when it runs one call per round; bit equality holds within one compiled function.
        """
        chosen = self.verify_draft([token], start)[0] if fused else self.verify([token], start)[0]
        return chosen[0]

    def absorb(self, taps) -> None:
        """Project the prompt's taps (positions 0..P-1) into the drafter's context cache."""
        self.fn["absorb"](taps, np.array([0], np.int64))

    def draft(self, taps, ctx_start: int, n_valid: int, anchor: int, start: int) -> list[int]:
        """Absorb the first n_valid rows of `taps` at ctx_start, then draft after `anchor`.

        `taps` None (the first round after prefill) passes zero rows with n_valid = 0.
        """
        out = self.fn["draft"](*self._draft_args(taps, ctx_start, n_valid, anchor, start))
        return [int(t) for t in self._host(out)[0]]

    def _draft_args(self, taps, ctx_start: int, n_valid: int, anchor: int, start: int) -> tuple:
        taps = self._zero_taps if taps is None else taps
        return (taps, np.array([ctx_start], np.int64), np.array([n_valid], np.int64), np.array([anchor], np.int64),
                self._pages(start))

    def draft_topk(self, taps, ctx_start: int, n_valid: int, anchor: int, start: int, temperature: float):
        """`draft`, plus the drafter's top-K at each drafted position (the `draft_topk` entry point).

        Args:
            temperature: > 0; the log-probs are log_softmax(drafter logits / temperature).

        Returns:
            (draft ids [B - 1] list, top-K ids int32 ndarray [B - 1, K], log-probs float32 ndarray
            [B - 1, K]), K the compiled count; ids[:, 0] are the draft ids.
        """
        draft, ids, lps = self.fn["draft_topk"](*self._draft_args(taps, ctx_start, n_valid, anchor, start),
                                                np.array([temperature], np.float32))
        return [int(t) for t in self._host(draft)[0]], self._host(ids)[0], self._host(lps)[0]
