"""`dflash-iree serve --parallel 4` on the 4-stream module (the session's `streams_artifacts`): 8
requests at once, 4 in a round and 4 queued, joining as others leave; each equals the same request
run alone on that module (runtime/batch.py BatchEngine behind the server)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from serving import Server, metric, wait_for_metric

from dflash_iree.runtime.engine import Engine


def test_eight_requests_on_four_streams_equal_each_alone(streams_artifacts, target_dir, drafter_dir):
    jobs = [([3 + i, 100 + i, 7], 6 + 4 * i, {"temperature": 0.7 * (i % 2), "seed": i, "speculative": i % 3 != 0})
            for i in range(8)]
    server = Server("--artifacts", streams_artifacts, "--target", target_dir, "--drafter", drafter_dir,
                    "--parallel", 4, "--max-queue", 16)
    try:
        assert metric(httpx.get(server.url + "/metrics").text, "dflash_streams") == 4

        def run(job):
            ids, n, sampling = job
            r = httpx.post(server.url + "/v1/completions", timeout=300,
                           json={"prompt": ids, "max_tokens": n, "return_token_ids": True, **sampling})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(run, jobs))
        wait_for_metric(server.url, "dflash_requests_running", 0)
    finally:
        assert server.stop() == 0, server.stderr
    alone = Engine.load(str(streams_artifacts), target=str(target_dir), drafter=str(drafter_dir))
    for (ids, n, sampling), tokens in zip(jobs, got):
        assert tokens == alone.generate(ids, n, **sampling).tokens
