"""The server's Prometheus metrics (`prometheus_client`), served as text at GET /metrics.

Counted as requests finish (on the event loop): requests by endpoint and finish reason, prompt
tokens, prompt tokens whose KV a slot already held (prefix reuse), generated tokens. Timed per
token: time to first token (submission to the first token's event) and inter-token latency
(between two token events of one request; a step's tokens reach the loop together, so this is
the step time as a client sees it). Read at each scrape: requests running and waiting for a slot
(the queue depth), and through a pool the bank's hits and misses with their hit rate (one small
device read of its counters per scrape).

Each app has its own registry, so several apps in one process (tests) do not share counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds: a CPU test model answers in milliseconds, a large model's first token of a long
# prompt takes seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.5, 5)


class Metrics:
    """The collectors of one app; `engine` is read at scrape time for the gauges."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cupool_requests", "HTTP generation requests finished, by "
                                "endpoint and finish reason", ["endpoint", "finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("cupool_prompt_tokens", "prompt tokens of finished "
                                     "requests", registry=r)
        self.cached_tokens = Counter("cupool_cached_prompt_tokens", "prompt tokens whose KV a "
                                     "slot already held (not prefilled again)", registry=r)
        self.generation_tokens = Counter("cupool_generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram("cupool_time_to_first_token_seconds", "from submission to the "
                              "first token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("cupool_inter_token_latency_seconds", "between two tokens of one "
                             "request", buckets=ITL_BUCKETS, registry=r)
        self.rejected = Counter("cupool_rejected_requests", "requests refused before running, "
                                "by reason", ["reason"], registry=r)
        r.register(_EngineCollector(engine))

    def finished(self, endpoint: str, reason: str, prompt: int, cached: int,
                 generated: int) -> None:
        self.requests.labels(endpoint, reason).inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read when scraped: running and waiting requests, and the bank's counters."""

    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        st = self.engine.stats()
        g = GaugeMetricFamily("cupool_requests_running", "sequences in the engine's slots")
        g.add_metric([], st["running"])
        yield g
        g = GaugeMetricFamily("cupool_requests_waiting", "requests queued for a slot (the "
                              "queue depth)")
        g.add_metric([], st["waiting"])
        yield g
        g = GaugeMetricFamily("cupool_slots", "sequences the engine decodes together")
        g.add_metric([], st["slots"])
        yield g
        pool = getattr(self.engine, "pool", None)
        if pool is None:
            return
        hits = misses = 0
        table = pool.stats()
        for d in table:
            hits, misses = hits + d["hits"], misses + d["misses"]
        c = CounterMetricFamily("cupool_bank_lookups", "expert lookups of the planner, by "
                                "outcome (hit: the row was in the bank)", labels=["outcome"])
        c.add_metric(["hit"], hits)
        c.add_metric(["miss"], misses)
        yield c
        g = GaugeMetricFamily("cupool_bank_hit_rate", "hits / lookups since the server "
                              "started (NaN before the first; 1 by construction while the plan "
                              "step is skipped: every expert has a bank row)")
        g.add_metric([], pool.hit_rate(table))
        yield g
        g = GaugeMetricFamily("cupool_bank_plan_skipped", "1 while the decode step skips the "
                              "plan step (every expert has a bank row; no lookups are counted)")
        g.add_metric([], int(pool.plan_skipped))
        yield g
