"""`dflash-iree serve` against a real server process on 127.0.0.1, with the openai client and httpx:
completions and chat, whole and streamed, equal to Engine.generate token for token; 8 concurrent
requests on the one-stream module; every malformed request refused while another completes;
a client leaving mid-stream; /metrics. One server for the module (tests/serving.py)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving import Server, chat_target, metric, wait_for_metric

from dflash_iree.runtime.engine import Engine

MODEL = "chat"  # the target folder's name: the default model id


@pytest.fixture(scope="module")
def target(tmp_path_factory, target_dir):
    return chat_target(tmp_path_factory.mktemp("serve") / MODEL, target_dir)


@pytest.fixture(scope="module")
def server(host_artifacts, target):
    s = Server("--artifacts", host_artifacts, "--target", target, "--max-queue", 16)
    yield s
    assert s.stop() == 0, s.stderr


@pytest.fixture(scope="module")
def engine(host_artifacts, target):
    return Engine.load(str(host_artifacts), target=str(target))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=timeout)


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [MODEL]
    text = httpx.get(server.url + "/metrics").text
    for name in ("dflash_queue_depth", "dflash_requests_running", "dflash_streams"):
        assert metric(text, name) is not None, name
    assert metric(text, "dflash_streams") == 1


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7, "top_p": 0.9}])
def test_completion_equals_generate(server, client, engine, sampling):
    """Text and token-id prompts, whole and streamed: the tokens and text of Engine.generate."""
    opts = {"temperature": sampling["temperature"], "seed": sampling.get("seed", 0), "top_p": sampling.get("top_p", 1.0)}
    want = engine.generate("def f(x):", 24, **opts)
    got = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=24, extra_body={"return_token_ids": True},
                                    **sampling)
    assert got.choices[0].token_ids == want.tokens and got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 24 and got.usage.prompt_tokens == len(engine.encode_prompt("def f(x):"))
    t = got.model_extra["timings"]
    assert t["predicted_n"] == 24 and t["draft_n"] == t["rounds"] * 7 and sum(t["acceptance_histogram"]) == t["rounds"]
    assert t["draft_n_accepted"] == sum(want.accepted) and t["tau"] == pytest.approx(want.tau_mean)

    ids = [7, 300, 12, 5]
    want_ids = engine.generate(ids, 30, **opts).tokens
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=30, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}, **sampling))
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == want_ids
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].model_extra["timings"]["predicted_n"] == 30


def test_chat_equals_generate(client, engine):
    messages = [{"role": "user", "content": "say hi"}]
    want = engine.generate(messages, 20)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(engine.encode_prompt(messages)) and got.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_stop_string_cuts_as_generate(client, engine):
    full = engine.generate("def f(x):", 40).text
    stop = full[10:13]
    want = engine.generate("def f(x):", 40, stop=[stop])
    got = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=40, temperature=0, stop=[stop])
    assert got.choices[0].text == want.text and stop not in got.choices[0].text
    assert got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=40, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_eight_concurrent_requests_queue_on_one_stream(server, engine):
    """8 requests at once on the 1-stream module: 7 wait, every one equals its request run alone
    (greedy and seeded, drafted and, for every third, plain decoding)."""
    jobs = [([3 + i, 100 + i, 7], 10 + 5 * i, {"temperature": 0.7 * (i % 2), "seed": i, "speculative": i % 3 != 0})
            for i in range(8)]

    def run(job):
        ids, n, sampling = job
        r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": n, "return_token_ids": True, **sampling})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(run, jobs))
    for (ids, n, sampling), tokens in zip(jobs, got):
        assert tokens == engine.generate(ids, n, **sampling).tokens
    wait_for_metric(server.url, "dflash_requests_running", 0)
    wait_for_metric(server.url, "dflash_queue_depth", 0)


MALFORMED = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", [1, 2], 400, "JSON object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens 0 is out of range"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens -3"),
    ("/v1/completions", {"prompt": list(range(1, 300)), "max_tokens": 8}, 400, "max_context 256"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop must be a string"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "empty string"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n is not supported"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, 400, "logprobs is not supported"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty is not supported"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 1}, 400, "frequency_penalty is not supported"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "unknown field frobnicate"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "2 prompts"),
    ("/v1/completions", {"prompt": [9999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "num_speculative_tokens": 99}, 400, "num_speculative_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0]"),
]


def test_malformed_requests_leave_a_running_stream_untouched(server, engine):
    ids = [11, 22, 33]
    want = engine.generate(ids, 150).tokens
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": ids, "max_tokens": 150, "temperature": 0, "stream": True,
                            "return_token_ids": True}) as running:
        lines = running.iter_lines()
        got = []
        for path, body, status, needle in MALFORMED:
            r = post(server, path, body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}, (body, err)
            if needle in ("temperature", "top_p", "num_speculative_tokens"):  # the field at fault is named
                assert err["param"] == needle, (body, err)
            if len(got) < 3:  # interleave reading the stream with the refusals
                got += _tokens(next(lines) for _ in range(2))
        got += _tokens(lines)
    assert got == want


def _tokens(lines) -> list[int]:
    out = []
    for line in lines:
        if line.startswith("data: {"):
            out += json.loads(line[6:])["choices"][0]["token_ids"]
    return out


def test_disconnect_mid_stream_cancels_at_the_next_round(server, engine):
    text = httpx.get(server.url + "/metrics").text
    cancelled = metric(text, "dflash_requests_total", {"finish_reason": "cancelled"}) or 0
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": [5, 6], "max_tokens": 200, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one event, then leave
    wait_for_metric(server.url, "dflash_requests_total", cancelled + 1, labels={"finish_reason": "cancelled"})
    # a whole (not streamed) request whose client gives up waiting is cancelled too
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 240}, timeout=0.05)
    wait_for_metric(server.url, "dflash_requests_total", cancelled + 2, labels={"finish_reason": "cancelled"})
    wait_for_metric(server.url, "dflash_requests_running", 0)
    r = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 12, "temperature": 0,
                                         "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == engine.generate([5, 6], 12).tokens


def test_metrics_count_tokens_and_rounds(server):
    before = httpx.get(server.url + "/metrics").text
    r = post(server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0}).json()
    time.sleep(0.05)
    after = httpx.get(server.url + "/metrics").text

    def delta(name, labels=None):
        return (metric(after, name, labels) or 0) - (metric(before, name, labels) or 0)

    t = r["timings"]
    assert delta("dflash_generation_tokens_total") == 16 and delta("dflash_prompt_tokens_total") == 3
    assert delta("dflash_tokens_drafted_total") == t["draft_n"]
    assert delta("dflash_tokens_drafted_accepted_total") == t["draft_n_accepted"]
    assert delta("dflash_acceptance_length_count") == t["rounds"]
    assert delta("dflash_requests_total", {"finish_reason": "length"}) == 1
    assert delta("dflash_time_to_first_token_seconds_count") == 1
