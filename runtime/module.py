"""One compiled module on one device: typed calls to its entry points for a single stream.

Entry points (export/aot.py): `prefill`, `verify`, `decode` (each also `*_sampled`), `absorb`,
`draft`. Every call passes `pages`, an int8 vector whose length bounds the KV cache rows that
attention reads (`kv_page` rows a page), so a step's cost follows the context length, not
`max_context`. Taps stay on the device: `prefill` and `verify` return them as device arrays and
`absorb` / `draft` take them back.
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
        """The one way results reach the host: small int64 token arrays only."""
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

    def _target(self, name: str, tokens: list[int], start: int):
        args = (np.array([tokens], np.int64), np.array([start], np.int64), self._pages(start + len(tokens)))
        return self.fn[name + self._suffix](*args, *self._sampling)

    def prefill(self, ids: list[int]):
        """Run the prompt from position 0. Returns (first new token, taps device array [1, P, N])."""
        chosen, taps = self._target("prefill", ids, 0)
        return int(self._host(chosen)[0, -1]), taps

    def decode(self, token: int, start: int) -> int:
        """One plain step: the token at `start`; returns the target's next token."""
        return int(self._host(self._target("decode", [token], start))[0, -1])

    def verify(self, block: list[int], start: int):
        """Verify [anchor, drafts...] at `start`, padded to block_size rows.

        Returns (chosen token ids for the real rows and one more, taps device array [1, B, N]).
        Padding rows write KV past the committed length, which rollback by length discards.
        """
        n = len(block)
        padded = block + [block[-1]] * (self.block_size - n)
        chosen, taps = self._target("verify", padded, start)
        return [int(t) for t in self._host(chosen)[0, :n]], taps

    def step_exact(self, token: int, start: int) -> int:
        """A plain step through the verify graph (the `exact` mode): row 0 of a padded block."""
        chosen, _ = self.verify([token], start)
        return chosen[0]

    def absorb(self, taps) -> None:
        """Project the prompt's taps (positions 0..P-1) into the drafter's context cache."""
        self.fn["absorb"](taps, np.array([0], np.int64))

    def draft(self, taps, ctx_start: int, n_valid: int, anchor: int, start: int) -> list[int]:
        """Absorb the first n_valid rows of `taps` at ctx_start, then draft after `anchor`.

        `taps` None (the first round after prefill) passes zero rows with n_valid = 0.
        """
        taps = self._zero_taps if taps is None else taps
        out = self.fn["draft"](taps, np.array([ctx_start], np.int64), np.array([n_valid], np.int64),
                               np.array([anchor], np.int64), self._pages(start))
        return [int(t) for t in self._host(out)[0]]
