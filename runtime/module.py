"""One compiled module on one device: typed calls to its entry points for a single stream.

Entry points (export/entry_points.py): `prefill`, `verify`, `decode`, `verify_draft`, `draft` (each also
`*_sampled`: the target samples with keyed noise, the drafter drafts with the same noise), `absorb`,
and `draft_topk` (also `draft_topk_sampled`) when the artifacts were compiled with
`--draft-top-k K` (K >= 1). Every call passes `pages`, an int8 vector whose length bounds the KV cache rows that attention reads
(`kv_page` rows a page), so a step's cost follows the context length, not `max_context`. Taps stay
on the device: `prefill` and `verify` return them as device arrays and `absorb` / `draft` take
them back. A hybrid target's `prefill` takes a static chunk (the manifest's `shapes.prefill_chunk`):
`CompiledPair.prefill` then runs the prompt in pieces (export/hybrid.py).

Host transfer contract: everything the host reads, a call writes into pinned host buffers the
runtime passes as its last arguments (the manifest's `writes`), and the host reads them through
`CompiledPair._read`, which counts the bytes in `host_bytes`. What they hold: the target's chosen
tokens (int64, one per block row), the draft ids (int64 [B - 1]), from `verify_draft` both in one
int64 [2B] row with the device's accepted-row count, and, from `draft_topk` only, the draft's top-K
ids (int32 [B - 1, K]) and log-probs (float32 [B - 1, K]): 8 * (B - 1) * K more bytes a round.
Never logits, taps or caches (tests/test_runtime.py checks the count).

Host-side cost of a call (docs/architecture.md, "Host time of a step"): arguments are written into
pinned host buffers the device reads directly, and outputs are written by the call into pinned
buffers the host reads in place, both reused from call to call (`Staging`, runtime/staging.py), instead of iree.runtime's
default of a new device buffer and a synchronous upload per argument, and of a queued copy the host
waits for per result (docs/architecture.md, "Results written into the caller's buffers"). Plain
decoding also runs one step ahead of the host (`decode_ahead`): each step's `$async` entry point is
queued with the previous step's output buffer as its token and a fence on that step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from operator import is_

import numpy as np

from dflash_iree.errors import DFlashError
from dflash_iree.generation import draft_seed
from dflash_iree.manifest import numpy_dtype

from .staging import Staging


class EntryCall:
    """An entry point of a loaded module: its iree.runtime.FunctionInvoker, called the same way,
    which first checks the buffers the call writes (its last arguments, the manifest's `writes`)
    against the manifest's signature, where IREE would fail inside `hal.buffer.assert` without
    naming the argument, or (a buffer larger than needed) not at all. The checked buffers are
    remembered, so a call with the same ones again costs an identity compare.

    Args:
        invoker: the iree.runtime.FunctionInvoker.
        entry: the entry point's manifest entry (`name`, `args` with name, shape, dtype; `writes`).
    """

    def __init__(self, invoker, entry: dict):
        import iree.runtime as rt

        self.name, self._invoke, self._device_array = entry["name"], invoker, rt.DeviceArray
        self._names = [a["name"] for a in entry["args"]]
        self._first = len(self._names) - len(entry.get("writes", []))  # the written arguments come last
        self._writes = [(a["name"], tuple(a["shape"]), numpy_dtype(a["dtype"])) for a in entry["args"][self._first:]]
        self._checked: tuple = ()

    def __call__(self, *args):
        """Call the entry point with `args` (its arguments in manifest order); returns its results.

        Raises:
            DFlashError: not as many arguments as the entry point takes, or a written argument that
                is not a device array of the manifest's shape and dtype (naming the entry point, the
                argument, expected and got).
        """
        outs = args[self._first:]
        if len(args) != len(self._names) or len(outs) != len(self._checked) or not all(map(is_, outs, self._checked)):
            self._check(args)
            self._checked = outs
        return self._invoke(*args)

    def _check(self, args: tuple) -> None:
        if len(args) != len(self._names):
            raise DFlashError(f"entry point {self.name}: {len(args)} arguments passed, it takes {len(self._names)}: "
                              f"{', '.join(self._names)} (the last {len(self._writes)} written by the call, the "
                              "manifest's 'writes')")
        for a, (name, shape, dtype) in zip(args[self._first:], self._writes):
            where = f"entry point {self.name}, argument '{name}' (written by the call, manifest 'writes')"
            if not isinstance(a, self._device_array):
                raise DFlashError(f"{where}: got a {type(a).__name__}; pass a device array, e.g. "
                                  f"iree.runtime.asdevicearray(device, <{dtype} array of shape {list(shape)}>), and read it "
                                  "after the call: anything else is copied in and what the call writes is lost")
            got = tuple(a.shape)
            fits = len(got) == len(shape) and all(isinstance(w, str) or w == g for w, g in zip(shape, got))
            if a.dtype != dtype or not fits:
                raise DFlashError(f"{where}: expected {dtype} {list(shape)}, got {a.dtype} {list(got)}")


def prefill_split(n: int, chunk: int, block: int) -> tuple[range, range]:
    """How a hybrid target's prompt of n tokens is run (export/hybrid.py): the starts of its whole
    chunks of `chunk` rows (`prefill`), then of the blocks of `block` rows after them (`verify`; the
    last may be short and is padded)."""
    whole = n // chunk * chunk
    return range(0, whole, chunk), range(whole, n, block)


class CompiledPair:
    """Calls into a loaded module for stream 0.

    Args:
        device: the iree.runtime HalDevice.
        functions: entry-point name -> EntryCall (or an iree.runtime.FunctionInvoker, unchecked).
        block_size, kv_page, tap_width: from the manifest.
        tap_dtype: numpy dtype of the taps (for the zero rows passed to the first `draft`).
        context, vm_module: the iree.runtime VmContext and VmModule behind `functions`, for the
            `$async` entry points of `decode_ahead` (None: `decode_ahead` decodes synchronously).
        top_k: the manifest's `draft_top_k`, K of `draft_topk` (0: none).
        prefill_chunk: the manifest's `shapes.prefill_chunk`: `prefill`'s static rows (a hybrid
            target, export/hybrid.py); 0: prefill takes the whole prompt.
        decode_steps: k of the `decode_steps` entry point (k plain steps a call; 0: none), the
            manifest's `shapes.decode_steps`.
    """

    def __init__(self, device, functions: dict, block_size: int, kv_page: int, tap_width: int, tap_dtype,
                 context=None, vm_module=None, top_k: int = 0, prefill_chunk: int = 0, decode_steps: int = 0):
        self.device, self.fn, self.top_k = device, functions, top_k
        self.prefill_chunk, self.decode_steps = prefill_chunk, decode_steps
        self._context, self._vm_module = context, vm_module
        self.block_size, self.kv_page = block_size, kv_page
        self._zero_taps = np.zeros((1, block_size, tap_width), tap_dtype)
        self._sampling: tuple = ()
        self._suffix = ""
        self._draft_sampling: tuple = ()  # what `draft` / `draft_topk` draft with (set_sampling)
        self._draft_suffix = ""
        self.host_bytes = 0  # bytes the host reads of the device's outputs, for the transfer contract
        self._stage = Staging(device)
        self._pages_args: dict[int, object] = {}

    def _read(self, out) -> np.ndarray:
        """The one way outputs reach the host: a pinned buffer a finished call wrote (token ids, and
        the draft top-K's [B - 1, K] arrays)."""
        value = self._stage.value(out)
        self.host_bytes += value.nbytes
        return value

    def _out(self, *shape, dtype=np.int64, slot: int = 0):
        return self._stage.out(shape, dtype, slot)

    def set_sampling(self, temperature: float, top_k: int, top_p: float, seed: int, draft_noise: str = "coupled") -> None:
        """Greedy requests call the plain entry points; others the `*_sampled` ones, whose drafts use
        the target's keyed noise (coupled drafting).

        draft_noise: what the separate `draft` / `draft_topk` calls draft with at temperature > 0
            (dflash_iree.generation.DRAFT_NOISES): "coupled", or the benchmark's controls "greedy"
            (the plain `draft`) and "other" (another seed). Artifacts compiled before
            `draft_sampled` existed draft greedily.
        """
        if temperature > 0:
            self._suffix = "_sampled"
            args = (np.array([temperature], np.float32), np.array([top_k], np.int64), np.array([top_p], np.float32))
            self._sampling = tuple(self._stage.arg(a, constant=True) for a in (*args, np.array([seed], np.int64)))
            self._draft_suffix, self._draft_sampling = "", ()
            d_seed = draft_seed(seed, draft_noise)
            if d_seed is not None and "draft_sampled" in self.fn:
                self._draft_suffix = "_sampled"
                self._draft_sampling = self._sampling[:3] + (self._stage.arg(np.array([d_seed], np.int64),
                                                                            constant=True),)
        else:
            self._suffix, self._sampling = "", ()
            self._draft_suffix, self._draft_sampling = "", ()

    def _pages(self, rows: int):
        """The `pages` argument for `rows` cache rows: its length is what counts (zeros, one pinned
        buffer per length)."""
        n = max(1, -(-rows // self.kv_page))
        if n not in self._pages_args:
            self._pages_args[n] = self._stage.arg(np.zeros(n, np.int8), constant=True)
        return self._pages_args[n]

    def _i64(self, values) -> object:
        return self._stage.arg(np.array(values, np.int64))

    def _target(self, name: str, tokens: list[int], start: int, *before_pages, writes: tuple = ()):
        # a prompt's length varies from request to request: its own buffer, not a ring per length
        ids = self._stage.arg(np.array([tokens], np.int64), constant=len(tokens) > self.block_size)
        args = (ids, self._i64([start]), *before_pages, self._pages(start + len(tokens)))
        return self.fn[name + self._suffix](*args, *self._sampling, *writes)

    def prefill(self, ids: list[int]):
        """Run the prompt from position 0. Returns (first new token, the prompt's taps for `absorb`:
        a device array [1, P, N], or with a static `prefill_chunk` a list of (taps, start) pieces)."""
        if self.prefill_chunk:
            return self._prefill_pieces(ids)
        chosen = self._out(1, 1)
        taps = self._target("prefill", ids, 0, writes=(chosen,))
        return int(self._read(chosen)[0, -1]), taps

    def _prefill_pieces(self, ids: list[int]):
        """A hybrid target's prefill (export/hybrid.py): the whole chunks of `prefill_chunk` rows
        through `prefill`, the rest through `verify` in blocks of block_size, the last one padded;
        its padding rows are rolled back as rejected drafts are, by the next call's start."""
        C, pieces, first = self.prefill_chunk, [], None
        chosen = self._out(1, 1)
        chunks, blocks = prefill_split(len(ids), C, self.block_size)
        for start in chunks:
            pieces.append((self._target("prefill", ids[start:start + C], start, writes=(chosen,)), start))
            first = chosen
        for start in blocks:
            tokens, taps = self.verify(ids[start:start + self.block_size], start)
            pieces.append((taps, start))
            first = tokens[-1]
        return (int(self._read(first)[0, -1]) if first is chosen else first), pieces

    def decode(self, token: int, start: int) -> int:
        """One plain step: the token at `start`; returns the target's next token."""
        chosen = self._out(1, 1)
        self._target("decode", [token], start, writes=(chosen,))
        return int(self._read(chosen)[0, -1])

    def decode_ahead(self, token: int, start: int, n: int) -> Iterator[int]:
        """Plain decoding of `n` tokens after `token` (at position `start`), the device one call ahead.

        With a `decode_steps` entry point of k steps (greedy only), a greedy request's first
        n // k * k tokens come k to a call, the rest one to a `decode` call. Call c is queued before
        call c - 1's tokens reach the host; its input token is the pinned buffer call c - 1 wrote its
        last token into. The tokens are
        those of n `decode` calls (each step is decode's graph; tests/test_decode_steps.py). On the
        pinned CUDA HAL an invocation returns only when its work is done, so the gain of running
        ahead is the cheaper argument and result handling, not overlap, and the gain of k steps a
        call is k - 1 fewer invocations (docs/architecture.md, "Where a step's time goes"). One
        request at a time: no other call may run on this pair while the generator is open.

        Args:
            token: the last committed token, at position `start` (int, tokens).
            n: steps to run, >= 0.

        Yields:
            the n next tokens (int), in order. A consumer that stops early (a stop token) leaves
            at most two calls run past the last token it took: their KV rows lie past the
            committed length, which rollback by length discards. Closing the generator waits for
            the device.
        """
        fn = self._async_function("decode" + self._suffix)
        if fn is None:
            for i in range(n):
                token = self.decode(token, start + i)
                yield token
            return
        import iree.runtime as rt

        k = self.decode_steps
        fn_k = self._async_function("decode_steps") if k > 1 and not self._suffix else None  # greedy only
        sizes = [k] * (n // k) + [1] * (n % k) if fn_k is not None else [1] * n
        first = list(itertools.accumulate(sizes[:-1], initial=start))  # call c's first position
        calls = self.device.create_semaphore(0)
        tokens = self._i64([[token]])
        issued = 0

        def issue(c: int):
            # call c writes slot c % 2 and reads slot (c - 1) % 2 (call 0: the staged token); the
            # host has read call c - 2's tokens, which were in slot c % 2, before it queues call c
            nonlocal tokens, issued
            size, pos = sizes[c], first[c]
            last = self._out(1, 1, slot=c % 2)
            writes = (last,) if size == 1 else (self._out(1, size, slot=c % 2), last)
            args = rt.VmVariantList(5 + len(writes) + len(self._sampling))  # + 2 fences
            for a in (tokens, self._i64([pos]), self._pages(pos + size), *self._sampling, *writes):
                args.push_ref(a._buffer_view)
            args.push_ref(rt.HalFence.create_at(calls, c))
            args.push_ref(rt.HalFence.create_at(calls, c + 1))
            self._context.invoke(fn if size == 1 else fn_k, args, rt.VmVariantList(0))
            issued, tokens = c + 1, last

        try:
            if sizes:
                issue(0)
            for c, size in enumerate(sizes):
                if c + 1 < len(sizes):
                    issue(c + 1)
                rt.HalFence.create_at(calls, c + 1).wait()
                yield from (int(t) for t in self._read(self._out(1, size, slot=c % 2))[0])
        finally:  # nothing of this chain may still run when the next call writes the caches
            rt.HalFence.create_at(calls, issued).wait()

    def _async_function(self, name: str):
        """The VmFunction of entry point `name`'s `$async` form, or None without a context."""
        if self._vm_module is None:
            return None
        return self._vm_module.lookup_function(name + "$async")

    def _pad(self, block: list[int]) -> list[int]:
        # padding rows write KV past the committed length, which rollback by length discards
        return block + [block[-1]] * (self.block_size - len(block))

    def verify(self, block: list[int], start: int):
        """Verify [anchor, drafts...] (1..block_size ids) at position `start`, padded to block_size rows.

        Returns:
            (the target's token after each of the len(block) rows, taps device array [1, B, N]).
        """
        n = len(block)
        chosen = self._out(1, self.block_size)
        taps = self._target("verify", self._pad(block), start, writes=(chosen,))
        return [int(t) for t in self._read(chosen)[0, :n]], taps

    def verify_draft(self, block: list[int], start: int):
        """One round in one call (the `verify_draft` entry point): verify [anchor, drafts...]
        (1..block_size ids) at position `start`, padded to block_size rows, then draft the next block
        on the device after the bonus token of the device's own acceptance count.

        Returns:
            (the target's token after each of the len(block) rows, the next draft [B - 1] ids, the
            rows the device accepted (its accepted + 1), taps device array [1, B, N] for a redone
            `draft`).
        """
        n, B = len(block), self.block_size
        packed = self._out(1, 2 * B)
        taps = self._target("verify_draft", self._pad(block), start, self._i64([n - 1]), writes=(packed,))
        row = [int(t) for t in self._read(packed)[0]]
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
        """Project the prompt's taps (positions 0..P-1; `prefill`'s result) into the drafter's context
        cache. A hybrid's pieces each go at their start; the padding rows of the last land past
        the prompt, where the drafter does not look (it reads positions before its anchor) and the
        next rounds overwrite them."""
        for piece, start in taps if isinstance(taps, list) else [(taps, 0)]:
            self.fn["absorb"](piece, self._i64([start]))

    def draft(self, taps, ctx_start: int, n_valid: int, anchor: int, start: int) -> list[int]:
        """Absorb the first n_valid rows of `taps` at ctx_start, then draft after `anchor`.

        `taps` None (the first round after prefill) passes zero rows with n_valid = 0.
        """
        draft = self._out(1, self.block_size - 1)
        self.fn["draft" + self._draft_suffix](*self._draft_args(taps, ctx_start, n_valid, anchor, start),
                                              *self._draft_sampling, draft)
        return [int(t) for t in self._read(draft)[0]]

    def _draft_args(self, taps, ctx_start: int, n_valid: int, anchor: int, start: int) -> tuple:
        taps = self._zero_taps if taps is None else taps
        return (taps, self._i64([ctx_start]), self._i64([n_valid]), self._i64([anchor]), self._pages(start))

    def draft_topk(self, taps, ctx_start: int, n_valid: int, anchor: int, start: int, temperature: float):
        """`draft`, plus the drafter's top-K at each drafted position (the `draft_topk` entry point).

        Args:
            temperature: > 0; the log-probs are log_softmax(drafter logits / temperature) (a sampled
                request's: `draft_topk_sampled` takes the temperature of set_sampling).

        Returns:
            (draft ids [B - 1] list, top-K ids int32 ndarray [B - 1, K], log-probs float32 ndarray
            [B - 1, K]), K the compiled count; ids[:, 0] are the draft ids of a greedy draft.
        """
        if self.top_k < 1:
            raise DFlashError("these artifacts have no draft_topk entry point (compiled with --draft-top-k 0); "
                              "recompile with --draft-top-k K, K in 1..64")
        outs = (self._out(1, self.block_size - 1), self._out(1, self.block_size - 1, self.top_k, dtype=np.int32),
                self._out(1, self.block_size - 1, self.top_k, dtype=np.float32))
        args = self._draft_args(taps, ctx_start, n_valid, anchor, start)
        if self._draft_suffix:
            self.fn["draft_topk_sampled"](*args, *self._draft_sampling, *outs)
        else:
            self.fn["draft_topk"](*args, self._stage.arg(np.array([temperature], np.float32)), *outs)
        draft, ids, lps = (self._read(o) for o in outs)
        return [int(t) for t in draft[0]], ids[0], lps[0]
