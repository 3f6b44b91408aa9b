"""Prometheus metrics of the workers' engines.

Each worker keeps its latency histograms and finish counts here and ships a snapshot with its
heartbeat (Redis hash `weightq:workers`), so whoever serves /metrics (the gateway, or a worker's own
METRICS_PORT) renders every worker from the same data, labelled by worker name.
"""

from __future__ import annotations

import json
import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from weightq.tasks.results import Finished

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
STALE_S = 15.0  # a heartbeat older than this belongs to a worker that is gone


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def to_json(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": round(self.sum, 6)}


class EngineMetrics:
    """What the engine's own counters lack: latency distributions and finishes by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.finished: Counter[str] = Counter()

    def observe(self, ev: Finished) -> None:
        with self._lock:
            self.finished[ev.reason] += 1
            if ev.completion_tokens:
                self.ttft.observe(ev.ttft_s)
            if ev.completion_tokens > 1:
                self.tpot.observe((ev.total_s - ev.ttft_s) / (ev.completion_tokens - 1))

    def snapshot(self) -> dict:
        with self._lock:
            return {"ttft": self.ttft.to_json(), "tpot": self.tpot.to_json(), "finished_by_reason": dict(self.finished)}


GAUGES = (
    ("waiting", "weightq_requests_waiting", "Requests queued in the engine, not yet admitted"),
    ("running", "weightq_requests_running", "Requests in the running batch"),
    ("active_jobs", "weightq_jobs_active", "Celery jobs the worker holds (waiting + running)"),
    ("batch_weight", "weightq_batch_weight", "KV tokens the running batch holds now"),
    ("max_batch_weight", "weightq_batch_weight_budget", "max_batch_weight: KV tokens the batch may ever hold"),
    ("kv_blocks_used", "weightq_kv_blocks_used", "KV cache blocks in use"),
    ("kv_blocks_total", "weightq_kv_blocks_total", "KV cache blocks in the pool"),
    ("decode_tok_s", "weightq_decode_tokens_per_second", "Recent decode throughput"),
    ("prefix_hit_rate", "weightq_prefix_cache_hit_rate", "Share of admitted prompt tokens found in the prefix cache"),
    ("prefix_cached_blocks", "weightq_prefix_cached_blocks", "Cached prompt blocks no request holds (reclaimable)"),
    ("prefix_shared_blocks", "weightq_prefix_shared_blocks", "Cached prompt blocks running requests hold"),
)
COUNTERS = (
    ("prefill_tokens", "weightq_prefill_tokens", "Prompt tokens prefilled"),
    ("decode_tokens", "weightq_decode_tokens", "Tokens generated"),
    ("steps", "weightq_engine_steps", "Engine steps run"),
    ("prefix_cached_tokens", "weightq_prefix_cached_tokens", "Prompt tokens found in the prefix cache"),
)


class WorkerCollector:
    """A prometheus_client collector over {worker name: heartbeat stats}."""

    def __init__(self, source: Callable[[], dict[str, dict]]) -> None:
        self.source = source

    def collect(self) -> Iterator:
        workers = self.source()
        up = GaugeMetricFamily("weightq_workers", "Workers with a fresh heartbeat")
        up.add_metric([], len(workers))
        yield up
        for family, specs in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for key, name, doc in specs:
                m = family(name, doc, labels=["worker"])
                for w, s in workers.items():
                    if key in s:
                        m.add_metric([w], s[key])
                yield m
        fin = CounterMetricFamily(
            "weightq_requests_finished", "Finished requests by reason", labels=["worker", "reason"]
        )
        for w, s in workers.items():
            for reason, n in s.get("metrics", {}).get("finished_by_reason", {}).items():
                fin.add_metric([w, reason], n)
        yield fin
        for key, name, doc in (
            ("ttft", "weightq_time_to_first_token_seconds", "Submission to first token"),
            ("tpot", "weightq_time_per_output_token_seconds", "Mean time between output tokens, per request"),
        ):
            h = HistogramMetricFamily(name, doc, labels=["worker"])
            for w, s in workers.items():
                data = s.get("metrics", {}).get(key)
                if data:
                    h.add_metric([w], _cumulative(data), data["sum"])
            yield h


def _cumulative(data: dict) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*data["buckets"], float("inf")], data["counts"], strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out


def live_workers(raw: dict, now: float | None = None) -> dict[str, dict]:
    """Heartbeats (HGETALL of weightq:workers) that are fresh, by worker name."""
    now = time.time() if now is None else now
    out = {}
    for k, v in raw.items():
        try:
            stats = json.loads(v)
        except ValueError:
            continue
        if now - stats.get("ts", 0) <= STALE_S:
            out[k.decode() if isinstance(k, bytes) else k] = stats
    return out
