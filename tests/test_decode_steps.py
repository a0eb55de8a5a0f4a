"""Plain decoding k steps to a call (issue #24): the `decode_steps` entry point (export/entry_points.py)
and `CompiledPair.decode_ahead`'s use of it give the tokens of one `decode` call a step, greedy and
seeded, through a stop mid-call and the request after it.

Planted control: a module whose `decode_steps` feeds every step the call's input token instead of
the previous step's (the chain on the device broken) must part from decode.
"""

from __future__ import annotations

import os

import pytest
from test_exactness import PROMPTS, SAMPLINGS

from dflash_iree.errors import DFlashError
from dflash_iree.runtime.engine import Engine

K = 4


def _compile(out, target_dir, drafter_dir, **kw):
    from dflash_iree.export.compile import Progress, compile_artifacts

    compile_artifacts("host", target_dir, drafter_dir, out, max_context=256, log=Progress(open(os.devnull, "w")),
                      decode_steps=K, **kw)
    return out


@pytest.fixture(scope="module")
def steps_engine(tmp_path_factory, target_dir, drafter_dir):
    return Engine.load(_compile(tmp_path_factory.mktemp("steps") / "host", target_dir, drafter_dir))


def _decode_tokens(m, ids, n):
    """(decode_ahead's n tokens, n synchronous `decode` calls' tokens) after prefilling ids."""
    first, _ = m.prefill(ids)
    sync, token = [], first
    for i in range(n):
        token = m.decode(token, len(ids) + i)
        sync.append(token)
    return list(m.decode_ahead(first, len(ids), n)), sync


def test_manifest_records_k(steps_engine):
    m = steps_engine.artifacts.manifest
    assert m.shapes["decode_steps"] == K
    e = next(e for e in m.entry_points if e["name"] == "decode_steps")
    assert [a["shape"] for a in e["args"] if a["name"] in ("chosen", "last")] == [[1, K], [1, 1]]
    assert steps_engine.module.decode_steps == K
    assert "decode_steps_sampled" not in {e["name"] for e in m.entry_points}  # greedy only


@pytest.mark.parametrize("name", ["greedy", "t1-seed3"])
def test_k_steps_a_call_equal_decode(steps_engine, name):
    """23 tokens: five calls of K steps, then three `decode` calls; and a consumer that stops mid-call
    leaves the next request unaffected."""
    s = SAMPLINGS[name]
    m = steps_engine.module
    m.set_sampling(s.temperature, s.top_k, s.top_p, s.seed)
    ahead, sync = _decode_tokens(m, PROMPTS[0], 5 * K + 3)
    assert ahead == sync
    first, _ = m.prefill(PROMPTS[0])
    gen = m.decode_ahead(first, len(PROMPTS[0]), 5 * K + 3)
    assert [next(gen) for _ in range(K + 1)] == sync[:K + 1]  # stopped inside the second call
    gen.close()
    after, want = _decode_tokens(m, PROMPTS[1], 2 * K)
    assert after == want


def test_generate_equals_the_build_without(steps_engine, host_artifacts):
    """Plain generate (greedy, seeded, with a stop id met mid-call) gives the tokens of the same
    pair compiled without `decode_steps`, and of `exact` mode."""
    plain = Engine.load(host_artifacts)
    for p in PROMPTS[:2]:
        want = plain.generate(p, 30).tokens
        assert steps_engine.generate(p, 30).tokens == want == steps_engine.generate(p, 30, exact=True).tokens
        stop = want[K + 2]  # met inside the second call
        assert steps_engine.generate(p, 30, stop=[stop]).tokens == plain.generate(p, 30, stop=[stop]).tokens
        assert (steps_engine.generate(p, 30, temperature=1.0, seed=7).tokens
                == plain.generate(p, 30, temperature=1.0, seed=7).tokens)


def test_planted_broken_chain_parts(tmp_path, target_dir, drafter_dir, monkeypatch):
    """Planted: every step of the call decodes the call's input token (no chain on the device)."""
    from dflash_iree.export import entry_points as ep

    def broken(m, tokens, start, pages, sampling, chosen, last=None):
        import torch

        out = [ep._step(m, tokens, start + i, pages, sampling)[0] for i in range(chosen.shape[1])]
        chosen.copy_(torch.cat(out, dim=1))
        if last is not None:
            last.copy_(out[-1])

    monkeypatch.setattr(ep, "_decode_steps_into", broken)
    e = Engine.load(_compile(tmp_path / "host", target_dir, drafter_dir, use_cache=False))
    ahead, sync = _decode_tokens(e.module, PROMPTS[0], 2 * K)
    assert ahead[:1] == sync[:1] and ahead != sync


@pytest.mark.parametrize("kw,match", [({"decode_steps": 17}, r"--decode-steps 17 is out of range: use 2\.\.16"),
                                      ({"decode_steps": 4, "streams": 2}, r"--decode-steps 4: .* one stream")])
def test_refused(target_dir, drafter_dir, kw, match):
    from dflash_iree.export.compile import plan

    with pytest.raises(DFlashError, match=match):
        plan(target_dir, drafter_dir, **kw)
