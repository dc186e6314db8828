"""Prometheus metrics of the server (GET /metrics): request and token counters, time to first token, per-request
decode speed, and engine gauges (queue depth, running jobs, KV-cache pages) read from Engine.stats() at scrape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)

__all__ = ["CONTENT_TYPE", "Metrics"]

disable_created_metrics()  # no *_created series: they only add noise to scrapes


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, Any] | None]):
        self._stats = stats

    def collect(self):
        s = self._stats() or {}
        loaded = bool(s)

        def g(name: str, doc: str, value: float):
            m = GaugeMetricFamily(f"exl2cpp_{name}", doc)
            m.add_metric([], value)
            return m

        yield g("model_loaded", "1 when a model is loaded and serving", 1.0 if loaded else 0.0)
        yield g("queue_depth", "jobs waiting for admission", s.get("jobs_queued", 0))
        yield g("jobs_running", "jobs holding cache pages", s.get("jobs_active", 0))
        yield g("cache_pages_total", "KV-cache pages", s.get("pages_total", 0))
        yield g(
            "cache_pages_in_use",
            "pages held by running jobs",
            s.get("pages_used", 0) - s.get("pages_evictable", 0),
        )
        yield g(
            "cache_pages_shared", "pages referenced by two or more jobs", s.get("pages_shared", 0)
        )
        yield g("cache_pages_cached", "pages in the prefix cache", s.get("pages_cached", 0))
        yield g("cache_pages_free", "free pages", s.get("pages_free", 0))
        yield g(
            "prefix_tokens_reused",
            "prompt tokens taken from shared pages (engine lifetime)",
            s.get("tokens_reused", 0),
        )
        yield g(
            "preemptions",
            "jobs sent back to the queue to free cache pages (engine lifetime)",
            s.get("preemptions", 0),
        )
        for key, what in (("spec_proposed", "verified"), ("spec_accepted", "accepted")):
            yield g(key, f"speculative decoding: draft tokens {what} (engine lifetime)", s.get(key, 0))


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any] | None]):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes etc.
        self.requests = Counter(
            "exl2cpp_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.cancelled = Counter(
            "exl2cpp_requests_cancelled", "generations cancelled by a client disconnect", registry=r
        )
        self.prompt_tokens = Counter("exl2cpp_prompt_tokens", "prompt tokens submitted", registry=r)
        self.generation_tokens = Counter(
            "exl2cpp_generation_tokens", "tokens generated", registry=r
        )
        self.ttft = Histogram(
            "exl2cpp_time_to_first_token_seconds",
            "request arrival to first generated token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tps = Histogram(
            "exl2cpp_tokens_per_second",
            "decode speed per request (after the first token)",
            buckets=_TPS_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "exl2cpp_request_duration_seconds",
            "whole generation request",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "exl2cpp_requests_in_flight", "generation requests being served", registry=r
        )
        r.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
