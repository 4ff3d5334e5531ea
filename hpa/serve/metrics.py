"""Prometheus metrics of ``hpa serve``."""

from __future__ import annotations

KL_BUCKETS = (-0.5, -0.1, -0.05, 0.0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, float("inf"))
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


class Metrics:
    """Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("hpa_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("hpa_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.completion_tokens = Counter("hpa_completion_tokens", "completion tokens returned", registry=r)
        self.latency = Histogram("hpa_request_latency_seconds", "time from request to last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.regenerations = Counter("hpa_guard_regenerations", "responses the KL guard sampled again",
                                     registry=r)
        self.kl = Histogram("hpa_response_kl", "KL to the reference of returned responses (k1, per token)",
                            buckets=KL_BUCKETS, registry=r)
        self.in_flight = Gauge("hpa_requests_in_flight", "requests accepted and not finished", registry=r)
        self.batch_rows = Histogram("hpa_batch_rows", "responses sampled per engine call",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, float("inf")), registry=r)
