"""The draft depth of shared rounds (runtime/depth.py) on the tiny pair compiled with --streams 4 for
the host (the session's `streams_artifacts`, whose module has verify_rows 2, 4 and 8).

Output unchanged by any depth: forced depths (every value for all streams, per stream mixed, with
plain steps between) give, request by request, the tokens of full depth and of plain decoding of
the eager target, greedy and seeded at T > 0, with the scripted drafter (every accepted count) and
with the compiled one. The planted control, an engine that also accepts the drafts past the
verified rows, must fail that check. Then the rule itself on made-up costs, and `dflash-iree
calibrate`: the cost file it writes, the rule it turns on, and every bad cost file refused in one
line with exit status 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pytest
from test_batch import BLOCK, REQUESTS, Oracle, engine, run_together, truths  # noqa: F401 (fixtures)

from dflash_iree.checkpoint import sha256_file
from dflash_iree.guard import DFlashWarning
from dflash_iree.manifest import DEPTH_COST_FILE
from dflash_iree.runtime.batch import BatchEngine
from dflash_iree.runtime.depth import FALLBACK, CostModel, DepthRule, ForcedDepth, StreamView, compiled_rows, expected_tau
from dflash_iree.runtime.engine import Engine

ROWS = [2, 4, 8]


class OverreachBatchEngine(BatchEngine):
    """The planted control: when every verified draft matched, it also keeps the drafts past the
    verified rows, as if the target had checked them."""

    @staticmethod
    def _verified(block, n, row, ready):
        if len(ready) <= n:
            return block[1:n + 1], row
        return list(ready), row[:n] + list(ready[n:]) + [row[n]]


@pytest.fixture(scope="module")
def full_depth(engine, truths) -> dict[bool, dict[str, list[int]]]:
    """proposer? -> request -> tokens at full depth (the rule off: every round `verify_draft`)."""
    return {p: run_together(BatchEngine(engine.with_seams(proposer=Oracle(truths)) if p else engine, depth=None))
            for p in (True, False)}


def mismatches(engine, truths, full_depth, rule, proposer=True, cls=BatchEngine) -> list[str]:
    """Every request whose tokens under `rule` differ from full depth or from plain decoding."""
    seamed = engine.with_seams(proposer=Oracle(truths)) if proposer else engine
    batch = cls(seamed, depth=rule)
    got = run_together(batch)
    out = []
    for i, (prompt, o, _) in enumerate(REQUESTS):
        truth = truths[tuple(prompt)][len(prompt):len(prompt) + o.max_new_tokens]
        if got[f"r{i}"] != full_depth[proposer][f"r{i}"]:
            out.append(f"request {i}: {got[f'r{i}'][:8]}... != full depth {full_depth[proposer][f'r{i}'][:8]}...")
        if got[f"r{i}"] != truth:
            out.append(f"request {i}: differs from plain decoding")
    return out


FORCED = {f"all-{d}": (lambda d: (lambda r, s: d))(d) for d in range(BLOCK)}
FORCED["mixed"] = lambda r, s: (r + 3 * s) % BLOCK
FORCED["mixed-other"] = lambda r, s: (5 * r + s * s) % BLOCK


def test_module_compiles_the_depth_rows(engine):
    assert compiled_rows(engine.artifacts.manifest) == ROWS


@pytest.mark.parametrize("name", list(FORCED))
def test_forced_depth_equals_full_depth_and_plain(engine, truths, full_depth, name):
    rule = ForcedDepth(ROWS, FORCED[name])
    assert mismatches(engine, truths, full_depth, rule) == []


def test_forced_depth_with_plain_steps_and_the_compiled_drafter(engine, truths, full_depth):
    """Mixed depths with a plain step of every stream every third round (the rule's fallback: the
    drafter's context kept by prefill + absorb), scripted and compiled drafter."""
    for proposer in (True, False):
        rule = ForcedDepth(ROWS, FORCED["mixed"], fallback=lambda r: r % 3 == 0)
        assert mismatches(engine, truths, full_depth, rule, proposer) == []
        batch = BatchEngine(engine, depth=ForcedDepth(ROWS, FORCED["mixed"], fallback=lambda r: r % 3 == 0))
        batch.generate_many([REQUESTS[0][0]], REQUESTS[0][1])
    assert mismatches(engine, truths, full_depth, ForcedDepth(ROWS, FORCED["mixed-other"]), proposer=False) == []


def test_planted_overreach_fails(engine, truths, full_depth):
    rule = ForcedDepth(ROWS, FORCED["mixed"])
    assert mismatches(engine, truths, full_depth, rule, cls=OverreachBatchEngine)


def test_rule_on_made_up_costs():
    """Confident drafts take the whole block, doubtful ones fewer rows, hopeless ones a plain step,
    then probes at 1, 2, 4 ... plain steps apart."""
    costs = CostModel({2: 1.2, 4: 1.5, 8: 2.0}, fallback_ms=1.0)
    rule = DepthRule(costs)
    sure, unsure, hopeless = [0.0] * 7, [-0.1, -2.0, -3.0, -3.0, -3.0, -3.0, -3.0], [-5.0] * 7
    assert expected_tau(sure, 7) == 8 and abs(expected_tau([-0.5, -0.5], 2) - (1 + 0.6065 + 0.3679)) < 1e-3
    plan = rule.plan([StreamView(0, 7, sure), StreamView(1, 7, hopeless)], 0)
    assert plan.rows == 8 and plan.depth == {0: 7, 1: 7}
    assert rule.plan([StreamView(0, 7, unsure), StreamView(1, 7, unsure)], 0).rows == 2
    assert rule.plan([StreamView(i, 7, hopeless) for i in range(4)], 0).rows is FALLBACK
    views_after = [StreamView(i, 0, None) for i in range(4)]  # a plain step leaves no draft
    seen = []
    for _ in range(6):
        plan = rule.plan(views_after, 0)
        seen.append(plan.rows)
        if plan.rows is not FALLBACK:  # a probe; its drafts are hopeless again
            assert plan.depth == {i: 0 for i in range(4)} and plan.rows == 2
            assert rule.plan([StreamView(i, 7, hopeless) for i in range(4)], 0).rows is FALLBACK
    assert seen == [FALLBACK, 2, FALLBACK, FALLBACK, 2, FALLBACK]


def test_flat_costs_turn_the_rule_off(monkeypatch):
    """The H200's measured curve (the whole block no dearer than fewer rows or a plain step): the
    rule could never choose otherwise, so the engine runs without it; the host's curve keeps it."""
    from types import SimpleNamespace

    from dflash_iree.runtime import depth

    h200 = CostModel({2: 1.232, 4: 1.2681, 8: 1.2203}, fallback_ms=7.0847)
    host = CostModel({2: 89.0, 4: 114.0, 8: 168.0}, fallback_ms=72.0)
    assert h200.full_depth_always() and not host.full_depth_always()
    assert not CostModel({2: 1.0, 4: 1.0, 8: 1.0}, fallback_ms=0.5).full_depth_always()  # plain is cheaper
    monkeypatch.setattr(depth, "compiled_rows", lambda manifest: [2, 4, 8])
    for costs, rule_off in ((h200, True), (host, False)):
        monkeypatch.setattr(depth.CostModel, "load", classmethod(lambda cls, folder, manifest, c=costs: c))
        engine = SimpleNamespace(artifacts=SimpleNamespace(folder="x", manifest=None))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rule = depth.rule_for(engine)
        assert (rule is None) == rule_off
        assert any("the draft depth rule is off" in str(w.message) for w in seen) == rule_off


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dflash_iree", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def calibrated(streams_artifacts, tmp_path_factory):
    """A copy of the S = 4 artifacts with `dflash-iree calibrate` run on it (3 repeats), its measured
    rows then replaced by a curve where rows cost what they compute (the demo pair's on the host):
    the tiny pair's own curve can come out flat, which turns the rule off (CostModel.full_depth_always,
    tested on its own), and these tests are about the rule on. The manifest lists the new file's
    sha256, as calibrate would."""
    folder = tmp_path_factory.mktemp("calibrated") / "host"
    shutil.copytree(streams_artifacts, folder)
    done = _cli("calibrate", "--artifacts", str(folder), "--repeats", "3")
    assert done.returncode == 0, done.stderr
    costs = json.loads((folder / DEPTH_COST_FILE).read_text())
    assert sorted(costs["rows_ms"]) == ["2", "4", "8"] and all(v > 0 for v in costs["rows_ms"].values())
    costs.update(rows_ms={"2": 89.0, "4": 114.0, "8": 168.0}, fallback_ms=72.0)
    (folder / DEPTH_COST_FILE).write_text(json.dumps(costs, indent=1) + "\n")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][DEPTH_COST_FILE] = sha256_file(folder / DEPTH_COST_FILE)
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return folder


def test_calibrate_writes_the_cost_file_and_turns_the_rule_on(calibrated, truths):
    manifest = json.loads((calibrated / "manifest.json").read_text())
    costs = json.loads((calibrated / DEPTH_COST_FILE).read_text())
    assert manifest["files"][DEPTH_COST_FILE] == sha256_file(calibrated / DEPTH_COST_FILE)
    assert sorted(costs["rows_ms"]) == ["2", "4", "8"] and costs["fallback_ms"] > 0 and costs["streams"] == 4
    e = Engine.load(str(calibrated))
    batch = BatchEngine(e)
    assert isinstance(batch.depth, DepthRule)
    got = batch.generate_many([p for p, _, _ in REQUESTS], [o for _, o, _ in REQUESTS])
    for (prompt, o, _), r in zip(REQUESTS, got):
        assert r.tokens == truths[tuple(prompt)][len(prompt):len(prompt) + o.max_new_tokens]
    assert sum(batch.round_rows.values()) > 0


def test_no_cost_file_is_full_depth_said_once(streams_artifacts):
    e = Engine.load(str(streams_artifacts))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from dflash_iree.runtime import depth

        depth._warned.discard(str(streams_artifacts))
        assert BatchEngine(e).depth is None and BatchEngine(e).depth is None
        assert BatchEngine(Engine.load(str(streams_artifacts))).depth is None
    said = [w for w in caught if issubclass(w.category, DFlashWarning) and DEPTH_COST_FILE in str(w.message)]
    assert len(said) == 1 and "dflash-iree calibrate --artifacts" in str(said[0].message)


def _relist(folder):
    m = json.loads((folder / "manifest.json").read_text())
    m["files"][DEPTH_COST_FILE] = sha256_file(folder / DEPTH_COST_FILE)
    (folder / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")


BAD_COSTS = [  # name, how the file is spoiled, relisted in the manifest?, words of the one line
    ("edited", lambda t: t.replace('"fallback_ms": ', '"fallback_ms": 1'), False, "sha256 differs"),
    ("not-json", lambda t: t[: len(t) // 2], True, "is not a JSON cost file"),
    ("negative", lambda t: json.dumps({**json.loads(t), "fallback_ms": -1}), True, "fallback_ms is -1"),
    ("rows", lambda t: json.dumps({**json.loads(t), "rows_ms": {"2": 1.0}}), True, "rows_ms has rows ['2']"),
    ("streams", lambda t: json.dumps({**json.loads(t), "streams": 2}), True, "streams 2, the module's is 4"),
    ("unlisted", lambda t: t, "drop", "is not listed in"),
]


@pytest.mark.parametrize("name,spoil,relist,words", BAD_COSTS, ids=[b[0] for b in BAD_COSTS])
def test_bad_cost_file_is_one_line_and_status_2(calibrated, tmp_path, name, spoil, relist, words):
    folder = tmp_path / "host"
    shutil.copytree(calibrated, folder)
    cost = folder / DEPTH_COST_FILE
    cost.write_text(spoil(cost.read_text()))
    if relist is True:
        _relist(folder)
    elif relist == "drop":
        m = json.loads((folder / "manifest.json").read_text())
        del m["files"][DEPTH_COST_FILE]
        (folder / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
    done = _cli("generate", "--artifacts", str(folder), "--prompt-ids", "7 300 12", "--max-new-tokens", "3")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert str(cost) in lines[0] and words in lines[0] and f"dflash-iree calibrate --artifacts {folder}" in lines[0]
    again = _cli("calibrate", "--artifacts", str(folder), "--repeats", "1")  # the fix it names works
    assert again.returncode == 0, again.stderr
    assert _cli("generate", "--artifacts", str(folder), "--prompt-ids", "7 300 12", "--max-new-tokens", "3").returncode == 0


def test_calibrate_refuses_a_one_stream_module(host_artifacts):
    before = sorted(p.name for p in host_artifacts.iterdir())
    done = _cli("calibrate", "--artifacts", str(host_artifacts), "--repeats", "1")
    assert done.returncode == 2 and "Traceback" not in done.stderr and "--streams 2 or more" in done.stderr
    assert sorted(p.name for p in host_artifacts.iterdir()) == before


def test_bench_parallel_reports_the_rule_on_and_off(calibrated, tmp_path):
    """With a cost file, `bench --parallel` runs plain, dflash (the rule on) and full (the rule off),
    all with the same tokens, and says how many rounds the rule gave each row count."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _, _ in REQUESTS[:4]))
    done = _cli("bench", "--artifacts", str(calibrated), "--prompts", str(prompts), "--max-new-tokens", "12", "--quiet",
                "--parallel", "4", "--json", str(tmp_path / "r.json"))
    assert done.returncode == 0, done.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    level = r["levels"]["4"]
    assert r["depth_rule"] and r["same_tokens"] and set(level) >= {"plain", "dflash", "full", "full_speedup"}
    assert sum(level["dflash"]["round_rows"].values()) > 0 and "depth rule: on" in done.stdout
