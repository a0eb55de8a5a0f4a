"""solo == together, token for token, on the tiny pair compiled with --streams 4 for the host (one
shared session compile): every request run while others join and leave at other rounds (other
lengths, greedy, seeded at other temperatures, plain) gives the tokens it gives alone, and those of
plain decoding of the eager target. A scripted drafter plants wrong tokens so that rounds accept
0..block_size-1 drafts and roll back on the device; the planted control, a batch engine that leaks
stream 0's length into stream 1, must fail the same check. A round with one stream running calls
the module's one-stream form (`verify_draft_stream`, `decode_stream`; runtime/stream_calls.py), so
the runs above switch forms mid-request as requests join and leave; that form alone equals the
S-stream form alone and plain decoding, and a planted one-stream call told another slot fails.
Also the engine protocol: events, cancel, capacity and bad input.
"""

from __future__ import annotations

import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.export.load import load_pair
from dflash_iree.export.reference import SamplingConfig, generate_plain
from dflash_iree.runtime.batch import BatchEngine
from dflash_iree.runtime.engine import Engine
from dflash_iree.runtime.options import GenerateOptions as G
from dflash_iree.runtime.stream_calls import StreamCalls

BLOCK, VOCAB = 8, 512
# prompt (none a prefix of another), options, the step it is added at (when a slot is free)
REQUESTS = [
    ([7, 300, 12, 99, 5], G(max_new_tokens=45), 0),
    (list(range(40, 73)), G(max_new_tokens=30, temperature=1.0, seed=3), 0),
    ([200], G(max_new_tokens=12, speculative=False), 1),
    ([9, 9, 8, 1], G(max_new_tokens=38, temperature=0.7, top_k=20, top_p=0.9, seed=11), 3),
    ([400, 3, 3], G(max_new_tokens=20, temperature=1.4, seed=5, speculative=False), 4),
    ([11, 22, 33, 44, 55, 66], G(max_new_tokens=26, temperature=0.5, seed=8), 6),
]


class Oracle:
    """A scripted drafter for every request at once: drafts the true continuation of whichever
    request's prompt the tokens start with, one token made wrong at index PLAN[r] of the request's
    r-th round position (BLOCK - 1: none wrong), so that solo and together draft alike and every
    accepted count occurs."""

    PLAN = (0, 3, 7, 1, 6, 2, 5, 4)

    def __init__(self, truths: dict[tuple, list[int]]):
        self.truths = truths
        self.rounds: dict[tuple, dict[int, int]] = {}  # prompt -> round position -> its index

    def begin(self, taps):
        pass

    def propose(self, tokens, new_taps, ctx_start):
        prompt, full = next((p, t) for p, t in self.truths.items() if tuple(tokens[:len(p)]) == p)
        n = len(tokens)
        draft = [full[i] if i < len(full) else 0 for i in range(n, n + BLOCK - 1)]
        rounds = self.rounds.setdefault(prompt, {})
        wrong = self.PLAN[rounds.setdefault(n, len(rounds)) % len(self.PLAN)]
        if wrong < BLOCK - 1:
            draft[wrong] = (draft[wrong] + 1) % VOCAB
        return draft


class LeakyBatchEngine(BatchEngine):
    """The planted control: stream 1 writes and attends at stream 0's length while both run."""

    def _round_starts(self, streams):
        starts = super()._round_starts(streams)
        if all(s is not None and not s.req.done for s in streams[:2]):
            starts[1] = starts[0]
        return starts


class WrongSlotCalls(StreamCalls):
    """The planted control of the one-stream form: its calls name the next slot, not the stream's."""

    def _where(self, only):
        return super()._where((only + 1) % self.S)


class WrongSlotBatchEngine(BatchEngine):
    def __init__(self, engine, **kw):
        super().__init__(engine, **kw)
        self.calls = WrongSlotCalls(engine.module, self.capacity)


@pytest.fixture(scope="module")
def engine(streams_artifacts):
    return Engine.load(str(streams_artifacts))


@pytest.fixture(scope="module")
def truths(target_dir, drafter_dir) -> dict[tuple, list[int]]:
    """prompt -> prompt + plain decoding of the eager target (BLOCK tokens past each budget)."""
    target, _ = load_pair(target_dir, drafter_dir, 256)
    out = {}
    for prompt, o, _ in REQUESTS:
        s = SamplingConfig(o.temperature, o.top_k, o.top_p, o.seed)
        out[tuple(prompt)] = list(prompt) + generate_plain(target, prompt, o.max_new_tokens + BLOCK, s).tokens
    return out


def run_together(batch: BatchEngine, requests=REQUESTS) -> dict[str, list[int]]:
    """`requests` through the protocol, each added at its step (or the first after with a free slot)."""
    waiting = [(f"r{i}", p, o, at) for i, (p, o, at) in enumerate(requests)]
    got: dict[str, list[int]] = {}
    results = {}
    step = 0
    while waiting or batch.active:
        while waiting and waiting[0][3] <= step and batch.active < batch.capacity:
            rid, p, o, _ = waiting.pop(0)
            batch.add(rid, p, o)
        for ev in batch.step():
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                results[ev.request_id] = ev
        step += 1
    for rid, ev in results.items():
        assert ev.result.tokens == got[rid] and ev.finish_reason == "length"
    return got


def failures(engine, truths, cls=BatchEngine, proposer=True, requests=REQUESTS) -> list[str]:
    """Every way a request's tokens together differ from alone or from plain decoding."""
    seamed = engine.with_seams(proposer=Oracle(truths)) if proposer else engine
    together = run_together(cls(seamed), requests)
    solo_engine = BatchEngine(seamed)
    out = []
    for i, (prompt, o, _) in enumerate(requests):
        solo = solo_engine.generate_many([prompt], o)[0].tokens
        truth = truths[tuple(prompt)][len(prompt):len(prompt) + o.max_new_tokens]
        if together[f"r{i}"] != solo:
            out.append(f"request {i}: together {together[f'r{i}'][:8]}... != solo {solo[:8]}...")
        if solo != truth:
            out.append(f"request {i}: solo differs from plain decoding")
    return out


def test_solo_equals_together_equals_plain(engine, truths):
    assert failures(engine, truths) == []


def test_solo_equals_together_with_the_compiled_drafter(engine, truths):
    assert failures(engine, truths, proposer=False) == []


def test_planted_length_leak_fails(engine, truths):
    assert failures(engine, truths, cls=LeakyBatchEngine)


def counting(monkeypatch, engine) -> dict[str, int]:
    """Entry-point name -> calls from here on (the module's functions wrapped for this test)."""
    counts: dict[str, int] = {}
    for name, fn in list(engine.module.fn.items()):
        def wrapped(*args, _name=name, _fn=fn):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args)
        monkeypatch.setitem(engine.module.fn, name, wrapped)
    return counts


def test_together_switches_between_the_forms(engine, truths, monkeypatch):
    """REQUESTS together run rounds of both forms (one stream alone at the start and the end), with
    the tokens of plain decoding (test_solo_equals_together_equals_plain checks them)."""
    counts = counting(monkeypatch, engine)
    run_together(BatchEngine(engine.with_seams(proposer=Oracle(truths))))
    for form in ("verify_draft", "verify_draft_stream"):  # greedy or sampled: any sampled stream makes a round so
        assert counts.get(form, 0) + counts.get(form + "_sampled", 0) > 0, form


@pytest.mark.parametrize("proposer", [True, False])
def test_one_stream_form_equals_the_stream_form_alone(engine, truths, monkeypatch, proposer):
    """Each request alone, greedy and seeded, drafted and plain: the one-stream form (no S-stream
    round called) == the S-stream form == plain decoding; planted, the one-stream calls told the next
    slot: not the tokens of plain decoding."""
    seamed = engine.with_seams(proposer=Oracle(truths)) if proposer else engine
    counts = counting(monkeypatch, engine)
    one, every, wrong = BatchEngine(seamed), BatchEngine(seamed, one_stream=False), WrongSlotBatchEngine(seamed)
    bad = 0
    for prompt, o, _ in REQUESTS:
        truth = truths[tuple(prompt)][len(prompt):len(prompt) + o.max_new_tokens]
        before = dict(counts)
        got = one.generate_many([prompt], o)[0].tokens
        stream_calls = {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}
        assert not {"verify_draft", "verify_draft_sampled", "decode", "decode_sampled"} & set(stream_calls)
        assert got == truth
        assert every.generate_many([prompt], o)[0].tokens == truth
        bad += wrong.generate_many([prompt], o)[0].tokens != truth
    assert counts.get("decode_stream", 0) and counts.get("decode_stream_sampled", 0)
    assert counts.get("verify_draft_stream", 0) and counts.get("verify_draft_stream_sampled", 0)
    assert bad == len(REQUESTS)


def test_planted_wrong_slot_fails_together(engine, truths):
    assert failures(engine, truths, cls=WrongSlotBatchEngine)


def test_scripted_rounds_accept_every_count(engine, truths):
    """The scripted drafts make rounds of every accepted count 0..BLOCK-1 (the device's rollback at
    each), in one request alone and the same counts with others running."""
    seamed = engine.with_seams(proposer=Oracle(truths))
    prompt, o, _ = REQUESTS[0]
    alone = BatchEngine(seamed).generate_many([prompt], o)[0]
    together = BatchEngine(seamed).generate_many([p for p, _, _ in REQUESTS[:4]], [x for _, x, _ in REQUESTS[:4]])[0]
    assert set(alone.accepted) == set(range(BLOCK)) and together.accepted == alone.accepted


def test_cancel_capacity_and_bad_input(engine):
    batch = BatchEngine(engine)
    assert batch.capacity == 4 and batch.active == 0
    with pytest.raises(DFlashError, match=r"^concurrency .*requests decoded at once"):
        batch.generate_many([[1]], G(), concurrency=0)
    for i in range(4):
        batch.add(f"q{i}", [1 + i, 2], G(max_new_tokens=50))
    with pytest.raises(DFlashError, match=r"^all 4 streams are busy"):
        batch.add("q4", [1], G())
    batch.step()
    batch.cancel("q2")
    events = {ev.request_id: ev for ev in batch.step()}
    assert events["q2"].finished and events["q2"].finish_reason == "cancelled" and batch.active == 3
    with pytest.raises(DFlashError, match=r"^request_id 'q1' is already running"):
        batch.add("q1", [1], G())
    with pytest.raises(DFlashError, match=r"prompt token id 512 \(position 1\) is outside the vocabulary"):
        batch.add("bad", [1, 512], G())
    with pytest.raises(DFlashError, match=r"exceeds max_context 256"):
        batch.add("long", [1] * 200, G(max_new_tokens=100))
    batch.add("q5", [3, 4], G(max_new_tokens=3, stop=[]))
    while batch.active:
        for ev in batch.step():
            assert not ev.finished or ev.finish_reason == "length"
    assert batch.active == 0


def test_one_stream_module(host_artifacts):
    """The batch engine on a one-stream module: requests one after another, as Engine.generate gives them."""
    e = Engine.load(str(host_artifacts))
    batch = BatchEngine(e)
    prompts = [[7, 300, 12], [5, 6], [200]]
    opts = [G(max_new_tokens=20), G(max_new_tokens=9, temperature=0.8, seed=2), G(max_new_tokens=7, speculative=False)]
    got = batch.generate_many(prompts, opts)
    assert batch.capacity == 1
    assert [r.tokens for r in got] == [e.generate(p, options=o).tokens for p, o in zip(prompts, opts)]


def test_engine_generate_on_a_streams_module(engine, truths):
    """Engine.generate / stream on the S = 4 module run the request alone through the batch engine."""
    prompt, o, _ = REQUESTS[1]
    want = truths[tuple(prompt)][len(prompt):len(prompt) + o.max_new_tokens]
    assert engine.generate(prompt, options=o).tokens == want
    run = engine.stream(prompt, options=o)
    while True:
        try:
            next(run)
        except StopIteration as end:
            assert end.value.tokens == want
            break
    with pytest.raises(DFlashError, match=r"^draft_top_k is not served by the batch engine"):
        engine.generate(prompt, draft_top_k=2)


def test_bench_parallel(streams_artifacts, tmp_path):
    """`dflash-iree bench --parallel 1,4`: a table and JSON per stream count and arm, same tokens; a count
    above the module's streams refused in one line with status 2."""
    import json
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _, _ in REQUESTS[:5]))
    cli = [sys.executable, "-m", "dflash_iree", "bench", "--artifacts", str(streams_artifacts), "--prompts", str(prompts),
           "--max-new-tokens", "12", "--quiet"]
    done = subprocess.run(cli + ["--parallel", "1,4", "--json", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["same_tokens"] and set(r["levels"]) == {"1", "4"} and "aggregate tok/s" in done.stdout
    assert r["levels"]["4"]["dflash"]["tau_mean"] >= 1 and r["levels"]["4"]["plain"]["ttft_ms"] > 0
    bad = subprocess.run(cli + ["--parallel", "1,5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--parallel '1,5': use stream counts 1..4" in bad.stderr
