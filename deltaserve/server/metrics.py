"""Prometheus metrics of one server: the engine's queues, pools and token counters, and request latencies.

Each app owns its own registry (two servers in one process do not share counters). Engine numbers are
read from `Engine.stats()` at scrape time; latencies are observed by the HTTP side as requests run.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "deltaserve"
# A 135M model answers in milliseconds, a 27B one with a 100K prompt in a minute: cover both.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class EngineCollector(Collector):
    """Gauges and counters from one `Engine.stats()` snapshot per scrape; nothing while the model loads."""

    def __init__(self, stats: Callable[[], object | None]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        if s is None:
            return
        gauges = {
            "requests_waiting": ("requests admitted to the queue, waiting for pages or a slot", s.waiting),
            "requests_running": ("requests prefilling or decoding", s.running),
            "kv_pages_used": ("KV cache pages held by requests", s.kv_pages_used),
            "kv_pages_free": ("KV cache pages free", s.kv_pages_total - s.kv_pages_used),
            "kv_pages_reserved": ("KV pages that admitted requests reserved (used or not yet)", s.kv_pages_reserved),
            "kv_pages_total": ("KV cache pages in the pool", s.kv_pages_total),
            "state_slots_used": ("GDN state slots held by requests", s.state_slots_used),
            "state_slots_free": ("GDN state slots free", s.state_slots_total - s.state_slots_used),
            "state_slots_total": ("GDN state slots in the pool", s.state_slots_total),
            "prefix_cache_pages": ("KV pages the prefix cache holds (those no request shares count as free)",
                                   s.prefix_cache_pages),
            "checkpoints_used": ("GDN state checkpoints the prefix cache holds", s.checkpoints_used),
            "checkpoints_total": ("GDN state checkpoint slots in the pool", s.checkpoints_total),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield CounterMetricFamily(f"{PREFIX}_prompt_tokens", "prompt tokens prefilled", value=s.prompt_tokens_total)
        yield CounterMetricFamily(f"{PREFIX}_generation_tokens", "tokens decoded",
                                  value=s.generation_tokens_total)
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_hit_tokens", "prompt tokens taken from the prefix cache",
                                  value=s.prefix_cache_hit_tokens_total)
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_evicted_pages", "cached KV pages evicted for room",
                                  value=s.prefix_cache_evicted_pages_total)
        yield CounterMetricFamily(f"{PREFIX}_checkpoints_evicted", "GDN state checkpoints evicted for room",
                                  value=s.checkpoints_evicted_total)
        yield CounterMetricFamily(f"{PREFIX}_speculative_draft_tokens", "draft tokens verified (--speculative)",
                                  value=s.speculative_drafted_total)
        yield CounterMetricFamily(f"{PREFIX}_speculative_accepted_tokens", "draft tokens the model agreed with",
                                  value=s.speculative_accepted_total)
        yield CounterMetricFamily(f"{PREFIX}_speculative_verify_steps", "decode steps of a request that verified "
                                  "drafts", value=s.speculative_verify_steps_total)
        yield _by_reason("requests_finished", "requests finished, by finish reason", s.finished)
        yield _by_reason("requests_refused", "requests the engine refused, by reason", s.refused)


def _by_reason(name: str, doc: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    return family


class ServerMetrics:
    """The registry of one server and the instruments the HTTP side updates."""

    def __init__(self, stats: Callable[[], object | None]):
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "from request received to the first generated token",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.request_duration = Histogram(
            f"{PREFIX}_request_duration_seconds", "from request received to its last token (end to end)",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.requests = Counter(f"{PREFIX}_http_requests", "generation requests received, by endpoint",
                                ["endpoint"], registry=self.registry)
        self.errors = Counter(f"{PREFIX}_http_errors", "error responses, by status and OpenAI error type",
                              ["status", "type"], registry=self.registry)
        self.disconnects = Counter(f"{PREFIX}_client_disconnects", "requests aborted because the client left",
                                   registry=self.registry)
        self.registry.register(EngineCollector(stats))
        # process_start_time_seconds: a load tester tells a restart from a slow answer by it
        ProcessCollector(registry=self.registry)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
