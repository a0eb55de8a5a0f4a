"""Calls into a loaded module for all of its S streams at once: the batch engine's steps
(runtime/batch.py), beside runtime/module.py's `CompiledPair`, which calls stream 0 alone.

Each stream keeps its own state in the arguments: `start` [S] is its cache write position, `n_draft`
[S] its drafted rows, and the sampling parameters are [S] (temperature 0: that stream is greedy, also
in a `*_sampled` call). The shared `pages` length covers the longest stream's rows; attention masks
each stream to its own positions, so a longer neighbour changes which rows are read, never which rows
a stream sees. An idle slot is given position 0, a block of zeros and no drafts: it writes only its
own slot (overwritten by the next prefill there), and its results are not read.

A joining request is prefilled alone into its slot: `prefill_stream` / `absorb_stream` of a module of
S > 1 streams (export/stream_entry_points.py), `prefill` / `absorb` of a one-stream module. A hybrid
target's prompt goes in pieces, chunks and then blocks of B (`verify_stream`), as
runtime/module.py's `CompiledPair.prefill` splits it.

A step with one stream running (`only`, its slot) calls the one-stream form of a module of S > 1
streams where it has one (`decode_stream`, `verify_draft_stream`, and `prefill_stream` +
`absorb_stream` for the plain step; each with `_sampled`): the same step on that slot alone, so it
costs what the one-stream module's call costs instead of computing all S slots. Its results come
back S-shaped, the one row filled (the other rows are not read), so the engine reads either form
alike.
"""

from __future__ import annotations

import numpy as np

from .module import CompiledPair, prefill_split

GREEDY = (0.0, 0, 1.0, 0)  # an idle or greedy slot's (temperature, top_k, top_p, seed)


class StreamCalls:
    """Typed calls over S streams of a CompiledPair's module (its functions, pinned staging and
    output buffers, and `host_bytes` count).

    Args:
        pair: the bound module (Artifacts.bind).
        streams: S, the manifest's `streams`.
        one_stream: call the one-stream form for a step given `only` (when the module has it; False:
            always the S-stream form, the benchmark's control).
    """

    def __init__(self, pair: CompiledPair, streams: int, one_stream: bool = True):
        self.pair, self.S, self.B = pair, streams, pair.block_size
        self.one_stream = one_stream and streams > 1 and "verify_draft_stream" in pair.fn
        self._sampling_key: tuple | None = None
        self._sampling_args: tuple = ()
        self._one_key: tuple | None = None
        self._one_args: tuple = ()
        self._slots: dict[int, object] = {}

    def _i64(self, values):
        return self.pair._stage.arg(np.array(values, np.int64))

    def sampling(self, rows: list[tuple]) -> tuple[str, tuple]:
        """The entry-point suffix and [S] sampling arguments for per-stream (temperature, top_k, top_p,
        seed) rows: "" and () when every stream is greedy."""
        if all(r[0] == 0 for r in rows):
            return "", ()
        key = tuple(rows)
        if key != self._sampling_key:  # one set of pinned buffers while the streams' parameters hold
            stage = self.pair._stage
            cols = list(zip(*rows))
            arrays = (np.array(cols[0], np.float32), np.array(cols[1], np.int64), np.array(cols[2], np.float32),
                      np.array(cols[3], np.int64))
            self._sampling_key, self._sampling_args = key, tuple(stage.arg(a, constant=True) for a in arrays)
        return "_sampled", self._sampling_args

    def _sampling_one(self, row: tuple) -> tuple[str, tuple]:
        """`sampling` for one stream's (temperature, top_k, top_p, seed): [1]-shaped arguments."""
        if row[0] == 0:
            return "", ()
        if row != self._one_key:
            dts = (np.float32, np.int64, np.float32, np.int64)
            self._one_key = row
            self._one_args = tuple(self.pair._stage.arg(np.array([v], dt), constant=True) for v, dt in zip(row, dts))
        return "_sampled", self._one_args

    def _one(self, only: int | None) -> bool:
        return only is not None and self.one_stream

    def _slot(self, stream: int):
        """The `stream` argument naming slot `stream`: int8 [stream + 1] (the slot is its shape, a host
        value of the call; export/stream_entry_points.py `slot_arg`), one pinned buffer per slot."""
        if stream not in self._slots:
            self._slots[stream] = self.pair._stage.arg(np.zeros(stream + 1, np.int8), constant=True)
        return self._slots[stream]

    def _where(self, only: int):
        """The `stream` argument of a one-stream step (tests/test_batch.py plants a wrong one)."""
        return self._slot(only)

    def prefill(self, stream: int, ids: list[int], sampling: tuple):
        """Run prompt `ids` from position 0 into slot `stream` alone (sampling: its (temperature,
        top_k, top_p, seed)). Returns (the first new token, taps device array [1, T, N]; a hybrid
        target's: a list of (taps, start) pieces, `_prefill_pieces`)."""
        if self.pair.prefill_chunk and self.S == 1:
            self.pair.set_sampling(*sampling)
            return self.pair.prefill(ids)
        if self.pair.prefill_chunk:
            return self._prefill_pieces(stream, ids, sampling)
        suffix, extra = self._sampling_one(sampling)
        chosen = self.pair._out(1, 1)
        tokens = self.pair._stage.arg(np.array([ids], np.int64), constant=True)
        where = (self._slot(stream),) if self.S > 1 else ()
        name = "prefill_stream" if self.S > 1 else "prefill"
        taps = self.pair.fn[name + suffix](tokens, *where, self._i64([0]), self.pair._pages(len(ids)), *extra, chosen)
        return int(self.pair._read(chosen)[0, 0]), taps

    def _prefill_pieces(self, stream: int, ids: list[int], sampling: tuple):
        """A hybrid target's prompt into slot `stream` alone, split as runtime/module.py
        `CompiledPair._prefill_pieces` splits it: whole chunks through `prefill_stream`, the rest
        through `verify_stream` in blocks of B, the last padded (its padding rows roll back by the
        next call's start). Returns (the first new token, [(taps, start)] pieces for `absorb`)."""
        suffix, extra = self._sampling_one(sampling)
        C, B, where, pieces = self.pair.prefill_chunk, self.B, self._slot(stream), []
        chunks, blocks = prefill_split(len(ids), C, B)
        for start in chunks:
            chosen, last = self.pair._out(1, 1), 0
            tokens = self.pair._stage.arg(np.array([ids[start:start + C]], np.int64), constant=True)
            pieces.append((self.pair.fn["prefill_stream" + suffix](tokens, where, self._i64([start]),
                                                                   self.pair._pages(start + C), *extra, chosen), start))
        for start in blocks:
            block = ids[start:start + B]
            chosen, last = self.pair._out(1, B), len(block) - 1
            pieces.append((self.pair.fn["verify_stream" + suffix](self._i64([self.pair._pad(block)]), where,
                                                                  self._i64([start]), self.pair._pages(start + B),
                                                                  *extra, chosen), start))
        return int(self.pair._read(chosen)[0, last]), pieces

    def absorb(self, stream: int, taps) -> None:
        """The prompt's taps (positions 0..T-1) into slot `stream` of the drafter's context cache."""
        if self.S == 1:
            self.pair.absorb(taps)
            return
        for piece, start in taps if isinstance(taps, list) else [(taps, 0)]:
            self.pair.fn["absorb_stream"](piece, self._slot(stream), self._i64([start]))

    def decode(self, anchors: list[int], starts: list[int], sampling: list[tuple],
               only: int | None = None) -> list[int]:
        """One plain step of every stream: anchors[s] at position starts[s]; the target's next tokens [S]
        (only: the one running stream's slot; the other rows then are 0)."""
        if self._one(only):
            suffix, extra = self._sampling_one(sampling[only])
            chosen = self.pair._out(1, 1)
            self.pair.fn["decode_stream" + suffix](self._i64([[anchors[only]]]), self._where(only),
                                                   self._i64([starts[only]]), self.pair._pages(starts[only] + 1),
                                                   *extra, chosen)
            out = [0] * self.S
            out[only] = int(self.pair._read(chosen)[0, 0])
            return out
        suffix, extra = self.sampling(sampling)
        chosen = self.pair._out(self.S, 1)
        self.pair.fn["decode" + suffix](self._i64([[a] for a in anchors]), self._i64(starts),
                                        self.pair._pages(max(starts) + 1), *extra, chosen)
        return [int(t) for t in self.pair._read(chosen)[:, 0]]

    def verify_draft(self, blocks: list[list[int]], starts: list[int], n_draft: list[int], sampling: list[tuple],
                     only: int | None = None):
        """One round of every stream in one call: verify blocks[s] (block_size ids) at starts[s], the
        device's acceptance count over n_draft[s] drafts, and the next draft after the bonus token.
        only: the one running stream's slot (the other rows of the results then are 0).

        Returns:
            (chosen int64 [S, B], next drafts int64 [S, B - 1], the device's accepted rows [S]).
        """
        B = self.B
        if self._one(only):
            suffix, extra = self._sampling_one(sampling[only])
            packed = self.pair._out(1, 2 * B)
            self.pair.fn["verify_draft_stream" + suffix](
                self._i64([blocks[only]]), self._where(only), self._i64([starts[only]]), self._i64([n_draft[only]]),
                self.pair._pages(starts[only] + B), *extra, packed)
            row = np.zeros((self.S, 2 * B), np.int64)
            row[only] = self.pair._read(packed)[0]
        else:
            suffix, extra = self.sampling(sampling)
            packed = self.pair._out(self.S, 2 * B)
            self.pair.fn["verify_draft" + suffix](self._i64(blocks), self._i64(starts), self._i64(n_draft),
                                                  self.pair._pages(max(starts) + B), *extra, packed)
            row = self.pair._read(packed)
        return row[:, :B], row[:, B:2 * B - 1], row[:, 2 * B - 1]

    def verify_rows(self, R: int, blocks: list[list[int]], starts: list[int], n_draft: list[int], sampling: list[tuple]):
        """`verify_draft` over R rows (`verify_rows{R}`; blocks[s]: R ids, n_draft[s] <= R - 1), which also
        writes the next draft's confidence.

        Returns:
            (chosen int64 [S, R], next drafts int64 [S, B - 1], the device's accepted rows [S], the
            drafter's top-1 log-probs float32 [S, B - 1] at the next draft's positions).
        """
        suffix, extra = self.sampling(sampling)
        B = self.B
        packed = self.pair._out(self.S, R + B)
        confidence = self.pair._out(self.S, B - 1, dtype=np.float32)
        self.pair.fn[f"verify_rows{R}" + suffix](self._i64(blocks), self._i64(starts), self._i64(n_draft),
                                                 self.pair._pages(max(starts) + R), *extra, packed, confidence)
        row = self.pair._read(packed)
        return row[:, :R], row[:, R:R + B - 1], row[:, R + B - 1], self.pair._read(confidence)

    def plain_step(self, anchors: list[int], starts: list[int], sampling: list[tuple],
                   only: int | None = None) -> list[int]:
        """One plain step of every stream that keeps the drafter's context: `prefill` of one row per
        stream (anchors[s] at starts[s]), then `absorb` of its taps, so that a later drafted round
        finds every committed position in the context cache (`decode` returns no taps). only: the
        one running stream's slot (`prefill_stream` + `absorb_stream`; the other rows then are 0)."""
        if self._one(only):
            suffix, extra = self._sampling_one(sampling[only])
            chosen = self.pair._out(1, 1)
            where, start = self._where(only), self._i64([starts[only]])
            taps = self.pair.fn["prefill_stream" + suffix](self._i64([[anchors[only]]]), where, start,
                                                           self.pair._pages(starts[only] + 1), *extra, chosen)
            self.pair.fn["absorb_stream"](taps, where, start)
            out = [0] * self.S
            out[only] = int(self.pair._read(chosen)[0, 0])
            return out
        suffix, extra = self.sampling(sampling)
        chosen = self.pair._out(self.S, 1)
        starts_arg = self._i64(starts)
        taps = self.pair.fn["prefill" + suffix](self._i64([[a] for a in anchors]), starts_arg,
                                                self.pair._pages(max(starts) + 1), *extra, chosen)
        self.pair.fn["absorb"](taps, starts_arg)
        return [int(t) for t in self.pair._read(chosen)[:, 0]]
