"""The server's Prometheus metrics (`GET /metrics`), on a registry of its own.

Names follow Prometheus conventions (`_total` counters, `_seconds` units) under the `dflash_`
prefix; the drafted and accepted counters are llama.cpp's `tokens_drafted_total` and
`tokens_drafted_accepted_total`. The worker thread records a request when it finishes;
prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (the /metrics route's content type)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServeMetrics:
    """The counters, gauges and histograms of one server.

    Args:
        block_size: the artifacts' verify block; the τ histogram has one bucket per τ = 1..block_size.

    Metrics (all names prefixed `dflash_`):
        requests_total{finish_reason}: finished requests, by "stop", "length", "cancelled".
        requests_rejected_total{reason}: refused requests: "bad_request" (4xx), "queue_full" (429),
            "unauthorized" (401), "unavailable" (503: loading or stopping), "error" (500).
        prompt_tokens_total, generation_tokens_total: tokens of finished requests' prompts and outputs.
        tokens_drafted_total, tokens_drafted_accepted_total: draft tokens verified and kept.
        acceptance_length: histogram of τ (accepted + 1) per speculative round.
        time_to_first_token_seconds: histogram from arrival (queue time included) to the first token.
        request_duration_seconds: histogram from arrival to the last token.
        queue_depth: requests waiting for a stream; requests_running: requests holding a stream;
        streams: streams the engine serves at once.
    """

    def __init__(self, block_size: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("dflash_requests_rejected", "refused requests", ["reason"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "new tokens of finished requests", registry=r)
        self.drafted = Counter("dflash_tokens_drafted", "draft tokens verified", registry=r)
        self.accepted = Counter("dflash_tokens_drafted_accepted", "draft tokens accepted", registry=r)
        self.tau = Histogram("dflash_acceptance_length", "acceptance length tau (accepted + 1) per round",
                             buckets=tuple(float(t) for t in range(1, max(block_size, 1) + 1)), registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "arrival to first token (queue time included)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.duration = Histogram("dflash_request_duration_seconds", "arrival to last token",
                                  buckets=TTFT_BUCKETS, registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "requests waiting for a stream", registry=r)
        self.running = Gauge("dflash_requests_running", "requests holding a stream", registry=r)
        self.streams = Gauge("dflash_streams", "streams served at once", registry=r)

    def finished(self, reason: str, prompt_n: int, result, duration_s: float) -> None:
        """Record a finished request: its finish reason, token counts, rounds' τ and duration.

        result: its GenerationResult (accepted per round, block_size); duration_s: arrival to end.
        """
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt_n)
        self.generation_tokens.inc(len(result.tokens))
        if result.accepted:
            self.drafted.inc(len(result.accepted) * (result.block_size - 1))
            self.accepted.inc(sum(result.accepted))
            for a in result.accepted:
                self.tau.observe(a + 1)
        self.duration.observe(duration_s)

    def text(self) -> bytes:
        """The metrics in Prometheus' text exposition format."""
        return generate_latest(self.registry)
