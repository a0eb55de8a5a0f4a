"""`dflash-iree serve`'s limits: --api-key, a full queue (429 with Retry-After), SIGTERM exiting 0
(with every request answered when the shutdown timeout runs out), unknown routes and methods in
OpenAI's error shape, and the CLI's refusals (--parallel over the artifacts' streams, --max-queue 0,
a negative --shutdown-timeout, a taken port)."""

from __future__ import annotations

import socket
import threading

import httpx
import openai
import pytest
from badinput import assert_refused, cli, dflash
from serving import Server, chat_target, wait_for_metric

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(host_artifacts, tmp_path_factory, target_dir):
    target = chat_target(tmp_path_factory.mktemp("serve-limits") / "chat", target_dir)
    s = Server("--artifacts", host_artifacts, "--target", target, "--max-queue", 1, "--api-key", KEY)
    yield s
    s.stop()


def test_api_key_guards_every_route_but_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    lower = {"Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    assert httpx.get(server.url + "/v1/models", headers=lower).status_code == 200
    for path in ("/v1/models", "/metrics"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and "--api-key" in r.json()["error"]["message"]
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 401
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="chat", prompt=[1, 2], max_tokens=3).usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_routes_and_methods_answer_in_openai_error_shape(server):
    r = httpx.get(server.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "no such route" in r.json()["error"]["message"], r.text
    r = httpx.get(server.url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "POST" in r.json()["error"]["message"] and r.headers["Allow"] == "POST", r.text


def test_full_queue_answers_429_with_retry_after(server):
    """--max-queue 1: with one request decoding and one waiting, the rest of a burst get 429; the
    admitted ones still complete."""
    barrier = threading.Barrier(12)

    def send(_):
        barrier.wait()
        return httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120,
                          json={"prompt": [4, 5, 6], "max_tokens": 240, "temperature": 0})

    threads = [None] * 12
    results = [None] * 12

    def run(i):
        results[i] = send(i)

    for i in range(12):
        threads[i] = threading.Thread(target=run, args=(i,))
        threads[i].start()
    for t in threads:
        t.join(180)
    codes = sorted(r.status_code for r in results)
    assert 429 in codes and codes.count(200) >= 2 and set(codes) <= {200, 429}, codes
    for r in results:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "1" and "--max-queue 1" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 240
    wait_for_metric(server.url, "dflash_requests_running", 0, headers=AUTH)


def test_sigterm_exits_0_after_the_running_request(server):
    """SIGTERM during a stream: the stream is finished (graceful shutdown), then exit status 0."""
    with httpx.stream("POST", server.url + "/v1/completions", headers=AUTH, timeout=120,
                      json={"prompt": [8, 9], "max_tokens": 200, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        server.proc.send_signal(15)
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]", rest[-3:]
    assert server.proc.wait(60) == 0, server.stderr


def test_sigterm_past_the_shutdown_timeout_answers_every_request(host_artifacts, tmp_path, target_dir):
    """--shutdown-timeout 0: SIGTERM cancels at once what runs or waits, and each request is still
    answered: a whole one 200 (it had finished) or 503, a stream [DONE] after its last chunk, with
    an error event first when it was cut; no traceback, exit status 0. (uvicorn's own timeout, which
    this replaces, answered 500 and cut the streams.)"""
    s = Server("--artifacts", host_artifacts, "--target", chat_target(tmp_path / "chat", target_dir),
               "--shutdown-timeout", 0)
    whole = [None] * 3

    def send(i):
        try:
            whole[i] = httpx.post(s.url + "/v1/completions", timeout=120,
                                  json={"prompt": [3, 4, i], "max_tokens": 240, "temperature": 0})
        except httpx.HTTPError as e:
            whole[i] = e

    try:
        with httpx.stream("POST", s.url + "/v1/completions", timeout=120,
                          json={"prompt": [8, 9], "max_tokens": 240, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            wait_for_metric(s.url, "dflash_queue_depth", 2)  # one stream: the stream (or one) runs, two wait
            s.proc.send_signal(15)
            rest = [line for line in lines if line]
        for t in threads:
            t.join(120)
    finally:
        rc = s.stop()
    assert rest[-1] == "data: [DONE]", rest[-3:]
    if '"cancelled"' in rest[-3]:
        assert '"error"' in rest[-2] and "send it again" in rest[-2], rest[-3:]
    codes = [w.status_code if isinstance(w, httpx.Response) else repr(w) for w in whole]
    assert set(codes) <= {200, 503} and 503 in codes, codes
    for w in whole:
        if w.status_code == 503:
            assert "send it again" in w.json()["error"]["message"]
    assert rc == 0 and "Traceback" not in s.stderr and "Cancel" not in s.stderr, s.stderr


def test_cli_refusals(capsys, host_artifacts):
    rc, _, err = cli(capsys, "serve", "--artifacts", host_artifacts, "--parallel", 2)
    assert_refused(rc, err, "--parallel 2 is more than the 1 stream", "dflash-iree compile --streams 2")
    assert err.count("\n") == 1
    rc, _, err = cli(capsys, "serve", "--artifacts", host_artifacts, "--parallel", 0)
    assert_refused(rc, err, "--parallel 0 is out of range")
    rc, _, err = cli(capsys, "serve", "--artifacts", host_artifacts, "--max-queue", 0)
    assert_refused(rc, err, "--max-queue 0 is out of range")
    rc, _, err = cli(capsys, "serve", "--artifacts", host_artifacts, "--shutdown-timeout", -1)
    assert_refused(rc, err, "--shutdown-timeout -1 is out of range: use a number of seconds >= 0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc, _, err = cli(capsys, "serve", "--artifacts", host_artifacts, "--port", port)
    assert_refused(rc, err, f"--port {port}: cannot listen there", "choose another --port")


def test_engine_that_fails_to_load_stops_the_server_with_one_line(host_artifacts, tmp_path):
    """The weights load after the socket is bound (/health says 503 meanwhile); a failure there
    still ends the command with status 2 and the one-line reason."""
    r = dflash("serve", "--artifacts", host_artifacts, "--target", tmp_path, "--port", 0, timeout=120)
    assert_refused(r.returncode, r.stderr, f"{tmp_path}: no model.safetensors")
