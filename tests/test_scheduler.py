"""The server's scheduler (runtime/scheduler.py) over a scripted engine of the serving protocol with
two streams: continuous admission up to capacity, every event to its own request, cancellation of
a waiting and of a running request, and a planted control that routes events by position."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.runtime.options import GenerateOptions
from dflash_iree.runtime.scheduler import Rejected, Scheduler, Submission
from dflash_iree.runtime.serve_metrics import ServeMetrics
from dflash_iree.runtime.batch import StreamEvent


def script(prompt: list[int], n: int) -> list[int]:
    """The scripted engine's tokens for a request: a function of its prompt alone."""
    return [(sum(prompt) * 7 + i) % 97 for i in range(n)]


class ScriptedEngine:
    """The serving protocol (runtime/solo.py) with `capacity` streams, one token per stream per step;
    events come in reverse order of admission, so that routing by position would be wrong."""

    block_size, max_context = 4, 256

    def __init__(self, capacity: int = 2):
        self.capacity, self.slots, self.max_active, self.joined_mid_run = capacity, {}, 0, False

    @property
    def active(self) -> int:
        return len(self.slots)

    def encode_prompt(self, prompt, enable_thinking=False):
        if not prompt:
            raise DFlashError("the prompt is empty; give at least one token")
        return list(prompt)

    def add(self, rid, ids, options):
        if len(self.slots) >= self.capacity:
            raise DFlashError("the engine is full")
        self.joined_mid_run |= any(s["done"] > 0 for s in self.slots.values())
        self.slots[rid] = {"tokens": script(ids, options.max_new_tokens), "done": 0, "cancelled": False}
        self.max_active = max(self.max_active, len(self.slots))

    def cancel(self, rid):
        if rid in self.slots:
            self.slots[rid]["cancelled"] = True

    def step(self):
        events = []
        for rid, s in reversed(list(self.slots.items())):
            if s["cancelled"]:
                del self.slots[rid]
                events.append(StreamEvent(rid, [], "", True, "cancelled", None))
                continue
            s["done"] += 1
            tok = s["tokens"][s["done"] - 1:s["done"]]
            finished = s["done"] == len(s["tokens"])
            if finished:
                del self.slots[rid]
            events.append(StreamEvent(rid, tok, "", finished, "length" if finished else None, None))
        return events


class Misrouting(Scheduler):
    """Planted control: hands each event to the running request at the same position."""

    def _step(self, running):
        events = self.engine.step()
        for sub, ev in zip(list(running.values()), events):
            if ev.finished:
                running.pop(sub.request_id, None)
            self._deliver(sub, dataclasses.replace(ev, request_id=sub.request_id))


def run(jobs, scheduler_cls=Scheduler, cancel=(), timeout: float = 10.0):
    """Serve `jobs` [(prompt ids, n)] at once; returns (per request (tokens, finish_reason), engine)."""
    engine = ScriptedEngine()
    sched = scheduler_cls(lambda: engine, ServeMetrics(4), max_queue=16)
    sched.start()

    async def one(i, ids, n):
        sub = Submission(f"r{i}", ids, GenerateOptions(max_new_tokens=n), n)
        sched.submit(sub)
        if i in cancel:
            sched.cancel(sub.request_id)
        tokens = []
        while True:
            ev = await sub.queue.get()
            if isinstance(ev, Rejected):
                return ev.message, None
            tokens += ev.token_ids
            if ev.finished:
                return tokens, ev.finish_reason

    async def main():
        while not sched.ready:
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs))), timeout)

    try:
        return asyncio.run(main()), engine
    finally:
        sched.stop(5)


JOBS = [([1, 2], 5), ([3], 9), ([4, 4], 2), ([9], 7), ([2, 7, 1], 4)]


def check(scheduler_cls=Scheduler) -> ScriptedEngine:
    got, engine = run(JOBS, scheduler_cls)
    assert got == [(script(ids, n), "length") for ids, n in JOBS]
    return engine


def test_each_request_gets_its_own_tokens_with_continuous_admission():
    engine = check()
    assert engine.max_active == 2 and engine.joined_mid_run and engine.active == 0


def test_planted_control_misrouted_events_are_caught():
    with pytest.raises((AssertionError, asyncio.TimeoutError)):
        check(Misrouting)


def test_cancel_and_bad_prompt():
    """A request cancelled at once ends "cancelled" (from the queue or its stream); an empty prompt is
    refused with the engine's line; the others are untouched."""
    jobs = [([1], 30), ([2], 30), ([3], 30), ([], 3), ([5], 6)]
    got, engine = run(jobs, cancel=(2,))
    assert got[0] == (script([1], 30), "length") and got[1] == (script([2], 30), "length")
    assert got[2][1] == "cancelled" and got[3] == ("the prompt is empty; give at least one token", None)
    assert got[4] == (script([5], 6), "length") and engine.active == 0
