"""The server's queue and its worker thread: the one thread that loads and drives the engine.

Requests arrive from the HTTP event loop (`Scheduler.submit`) into a bounded queue; the worker
admits them at step boundaries while the engine has a free stream (continuous admission), runs
`engine.step()`, and hands each StreamEvent back to the request's asyncio queue on its event
loop. The engine is touched only here, through the protocol of runtime/solo.py (capacity, active,
encode_prompt, add, cancel, step), so the one-stream SoloEngine and the multi-stream BatchEngine
serve alike.

What a request's asyncio queue receives: StreamEvents, ending with a finished one, or one
`Rejected` (bad input found by the engine: the handler answers 4xx; or an engine fault: 500).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash_iree.acceptance import check_fits
from dflash_iree.errors import DFlashError

from .options import GenerateOptions
from .batch import StreamEvent

log = logging.getLogger("dflash_iree.serve")


class QueueFull(Exception):
    """`--max-queue` requests are already waiting (the server answers 429 with Retry-After)."""


class Unavailable(Exception):
    """The engine is loading, failed, or the server is stopping (the server answers 503)."""


@dataclass
class Rejected:
    """A request the worker refused: `message` (one line), `status` 400 (bad input) or 500 (fault)."""

    message: str
    status: int = 400


@dataclass
class Submission:
    """One request on its way through the queue.

    request_id: unique id (the response's id).
    prompt: text, token ids, or chat messages, encoded by the worker (engine.encode_prompt).
    options: the GenerateOptions (max_new_tokens replaced when `max_tokens` is None).
    max_tokens: the budget, or None: all the room the context leaves after the prompt and a block.
    enable_thinking: passed to the chat template.
    queue: the asyncio.Queue of its event loop that receives StreamEvents / Rejected.
    loop: that event loop.
    t_arrival, t_admit, t_first: time.perf_counter() at submit, at engine.add, at the first token.
    prompt_ids: set by the worker once encoded.
    """

    request_id: str
    prompt: object
    options: GenerateOptions
    max_tokens: int | None
    enable_thinking: bool = False
    queue: asyncio.Queue | None = None
    loop: asyncio.AbstractEventLoop | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first: float = 0.0
    prompt_ids: list[int] = field(default_factory=list)


class Scheduler:
    """The queue and the worker thread that owns the engine.

    Args:
        load: builds the engine (called in the worker thread; may raise DFlashError).
        metrics: the ServeMetrics to record into.
        max_queue: requests that may wait for a stream at once (>= 1); more get QueueFull.
        on_load_error: called with the one-line message when `load` fails (the server then exits).
        parallel: streams used at once, at most the engine's capacity (None: its capacity).
    """

    def __init__(self, load: Callable[[], object], metrics, max_queue: int,
                 on_load_error: Callable[[str], None] = lambda message: None, parallel: int | None = None):
        self._load, self.metrics, self.max_queue, self._on_load_error = load, metrics, max_queue, on_load_error
        self.parallel = parallel
        self._cond = threading.Condition()
        self._intake: list[Submission] = []
        self._cancels: set[str] = set()
        self._queued = 0  # submitted, not yet admitted nor refused (intake + waiting)
        self._stopping = False
        self.ready = False
        self.error: str | None = None  # why the engine cannot serve (load failure, fault)
        self.engine = None
        self._thread = threading.Thread(target=self._run, name="dflash-serve-worker", daemon=True)

    def start(self) -> None:
        """Start the worker thread, which loads the engine and then serves."""
        self._thread.start()

    def cancel_all(self) -> None:
        """Refuse new requests (Unavailable) and cancel whatever still runs or waits: each request
        gets its finished event (finish_reason "cancelled") and the worker ends; returns at once."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """`cancel_all`, then wait up to `timeout` seconds for the worker to end."""
        self.cancel_all()
        self._thread.join(timeout)

    def submit(self, sub: Submission) -> None:
        """Queue a request; events go to sub.queue on the running event loop.

        Raises:
            Unavailable: the engine is not loaded (or failed), or the server is stopping.
            QueueFull: max_queue requests are waiting already.
        """
        sub.loop, sub.queue = asyncio.get_running_loop(), asyncio.Queue()
        with self._cond:
            if self._stopping or not self.ready or self.error:
                raise Unavailable(self.error or ("the server is stopping" if self._stopping else
                                                 "the model is still loading; retry shortly"))
            if self._queued >= self.max_queue:
                raise QueueFull(f"{self._queued} request{'s are' if self._queued != 1 else ' is'} waiting "
                                f"(--max-queue {self.max_queue}); retry later")
            self._queued += 1
            self._intake.append(sub)
            self.metrics.queue_depth.set(self._queued)
            self._cond.notify()

    def cancel(self, request_id: str) -> None:
        """Cancel a request (its client left): dropped from the queue, or freed at the next step."""
        with self._cond:
            self._cancels.add(request_id)
            self._cond.notify()

    # -- the worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._load()
        except DFlashError as e:
            self.error = str(e)
            self._on_load_error(self.error)
            return
        except Exception as e:  # a bug or a device fault: the traceback goes to the log
            log.error("loading the engine failed:\n%s", traceback.format_exc())
            self.error = f"loading the engine failed: {e}"
            self._on_load_error(self.error)
            return
        slots = min(self.engine.capacity, self.parallel or self.engine.capacity)
        self.metrics.streams.set(slots)
        self.ready = True
        waiting: collections.deque[Submission] = collections.deque()
        running: dict[str, Submission] = {}
        while True:
            with self._cond:
                while not (self._intake or self._cancels or self._stopping or waiting or self._busy()):
                    self._cond.wait()
                new, self._intake = self._intake, []
                cancels, self._cancels = self._cancels, set()
                stopping = self._stopping
            for sub in new:
                if self._prepare(sub):
                    waiting.append(sub)
            if stopping:
                cancels |= {s.request_id for s in waiting} | set(running)
            for rid in cancels:
                sub = next((s for s in waiting if s.request_id == rid), None)
                if sub is not None:
                    waiting.remove(sub)
                    self._dequeued()
                    self.metrics.requests.labels("cancelled").inc()
                    self._deliver(sub, StreamEvent(rid, [], "", True, "cancelled", None))
                elif rid in running:
                    self.engine.cancel(rid)
            while waiting and self.error:  # after a fault nothing more is admitted
                self._dequeued()
                self._deliver(waiting.popleft(), Rejected(self.error, 503))
            while waiting and self.engine.active < slots:
                sub = waiting.popleft()
                self._dequeued()
                try:
                    self.engine.add(sub.request_id, sub.prompt_ids, sub.options)
                except DFlashError as e:
                    self._deliver(sub, Rejected(str(e)))
                    continue
                sub.t_admit = time.perf_counter()
                running[sub.request_id] = sub
            if self._busy():
                self._step(running)
            self.metrics.running.set(len(running))
            if stopping and not self._busy() and not waiting:
                return

    def _busy(self) -> bool:
        """Whether a step has work: requests admitted, and no fault has stopped the engine."""
        return bool(self.engine.active) and not self.error

    def _prepare(self, sub: Submission) -> bool:
        """Encode the prompt and check that it fits, so that a bad request is refused at once
        rather than when a stream frees; False (and the refusal delivered) when it is refused."""
        e = self.engine
        try:
            sub.prompt_ids = e.encode_prompt(sub.prompt, sub.enable_thinking)
            n = sub.options.max_new_tokens if sub.max_tokens is not None else \
                e.max_context - len(sub.prompt_ids) - e.block_size
            if n < 1:
                raise DFlashError(f"the prompt is {len(sub.prompt_ids)} tokens; with a block of {e.block_size} it "
                                  f"leaves no room in the context of {e.max_context} tokens: shorten the prompt")
            if sub.max_tokens is None:
                sub.options = dataclasses.replace(sub.options, max_new_tokens=n)
            check_fits(len(sub.prompt_ids), n, e.block_size, e.max_context)
        except DFlashError as err:
            self._dequeued()
            self._deliver(sub, Rejected(str(err)))
            return False
        return True

    def _step(self, running: dict[str, Submission]) -> None:
        """One engine step; each event to its request. A fault (not bad input) fails every running
        request with a 500 and leaves the server unhealthy: the engine's state is not to be trusted."""
        try:
            events = self.engine.step()
        except Exception as e:
            log.error("engine step failed:\n%s", traceback.format_exc())
            self.error = f"the engine failed ({type(e).__name__}: {e}); restart the server"
            for sub in running.values():
                self._deliver(sub, Rejected(self.error, 500))
            running.clear()
            return
        now = time.perf_counter()
        for ev in events:
            sub = running.get(ev.request_id)
            if sub is None:
                continue
            if ev.token_ids and not sub.t_first:
                sub.t_first = now
                self.metrics.ttft.observe(now - sub.t_arrival)
            if ev.finished:
                del running[ev.request_id]
                if ev.result is not None:
                    self.metrics.finished(ev.finish_reason, len(sub.prompt_ids), ev.result, now - sub.t_arrival)
            self._deliver(sub, ev)

    def _dequeued(self) -> None:
        with self._cond:
            self._queued -= 1
            self.metrics.queue_depth.set(self._queued)

    @staticmethod
    def _deliver(sub: Submission, item) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass
