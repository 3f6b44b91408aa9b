"""Prometheus metrics of the workers' engines and of the queue.

Each worker keeps its latency histograms and finish counts here and ships a snapshot with its
heartbeat (Redis hash `weightq:workers`). Every series is exported once: a gateway's `/metrics` holds
only its own (HTTP) series, and `/metrics/cluster` (the same answer from any gateway: scrape it as
one target) renders every live worker from the heartbeats, labelled by worker name, with the queue's
depth per class and the dead letters. A worker's own METRICS_PORT renders that worker alone (scrape
those instead of `/metrics/cluster`, never both).

Latency is measured twice: by the engine, from when it received the request
(`weightq_time_to_first_token_seconds`, `weightq_request_latency_seconds`), and from the job's
submission, queue time included, as its caller waits (`weightq_job_...`: the submission stamp is the
client's clock, the finish the worker's, so hosts need synchronised clocks).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from weightq.tasks import heartbeat
from weightq.tasks.contract import HEARTBEATS
from weightq.tasks.heartbeat import Heartbeat
from weightq.tasks.limits import MAX_PRIORITY
from weightq.tasks.results import Finished
from weightq.transport import waiting_by_priority

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
COMPLETED = ("length", "stop", "eos")  # finish reasons whose latency a caller waited out


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
        self.latency = Histogram(LATENCY_BUCKETS)
        self.job_ttft = Histogram(LATENCY_BUCKETS)
        self.job_latency = Histogram(LATENCY_BUCKETS)
        self.finished: Counter[str] = Counter()
        self._submitted: dict[str, float] = {}  # job id -> its submission (unix s), until it finishes

    def submitted(self, job_id: str, at: float) -> None:
        """The job's submission stamp (its job hash's queued_at), for the latencies from submission."""
        with self._lock:
            self._submitted[job_id] = at

    def observe(self, ev: Finished, emitted: float | None = None) -> None:
        """A finish, emitted at `emitted` (unix s; default now)."""
        emitted = time.time() if emitted is None else emitted
        with self._lock:
            self.finished[ev.reason] += 1
            at = self._submitted.pop(ev.request_id, None)
            job_s = None if at is None else max(0.0, emitted - at)  # clocks of two hosts
            if ev.completion_tokens:
                self.ttft.observe(ev.ttft_s)
                if job_s is not None:
                    self.job_ttft.observe(max(0.0, job_s - (ev.total_s - ev.ttft_s)))
            if ev.completion_tokens > 1:
                self.tpot.observe((ev.total_s - ev.ttft_s) / (ev.completion_tokens - 1))
            if ev.reason in COMPLETED:
                self.latency.observe(ev.total_s)
                if job_s is not None:
                    self.job_latency.observe(job_s)

    def snapshot(self) -> dict:
        with self._lock:
            return {name: getattr(self, name).to_json() for name, _, _ in HISTOGRAMS} | {
                "finished_by_reason": dict(self.finished)
            }


HISTOGRAMS = (
    ("ttft", "weightq_time_to_first_token_seconds", "Engine: from receiving the request to its first token"),
    ("tpot", "weightq_time_per_output_token_seconds", "Mean time between output tokens, per request"),
    ("latency", "weightq_request_latency_seconds", "Engine: from receiving the request to its last token"),
    ("job_ttft", "weightq_job_time_to_first_token_seconds", "From the job's submission (queue time included)"
     " to its first token"),
    ("job_latency", "weightq_job_latency_seconds", "From the job's submission (queue time included) to its"
     " last token"),
)  # fmt: skip


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
    ("stolen", "weightq_jobs_stolen", "Prefix affinity: jobs taken from other workers' own queues"),
    ("idle_queued_s", "weightq_idle_while_queued_seconds", "Seconds it held no job while one it takes waited"),
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
        for key, name, doc in HISTOGRAMS:
            h = HistogramMetricFamily(name, doc, labels=["worker"])
            for w, s in workers.items():
                data = s.get("metrics", {}).get(key)
                if data:
                    h.add_metric([w], _cumulative(data), data["sum"])
            yield h


class QueueCollector:
    """Jobs waiting in the broker, per queue and priority class: `source` gives {(queue, class): n}."""

    def __init__(self, source: Callable[[], dict[tuple[str, int], int]]) -> None:
        self.source = source

    def collect(self) -> Iterator:
        depth = GaugeMetricFamily(
            "weightq_queue_depth", "Jobs waiting in Redis for a worker, by queue and priority class",
            labels=["queue", "priority"],
        )  # fmt: skip
        for (queue, cls), n in sorted(self.source().items()):
            depth.add_metric([queue, str(cls)], n)
        yield depth


class BacklogCollector:
    """The projected waits (app/client/backlog.py) of the queue: what an autoscaler should scale on
    (README, "Autoscaling"), since a queue's length says nothing of how long its jobs take."""

    def __init__(self, source: Callable[[], Any], margin: Callable[[], float] | None = None) -> None:
        self.source = source  # () -> a backlog.Projection
        self.margin = margin  # () -> seconds backpressure keeps below MAX_QUEUE_WAIT_S

    def collect(self) -> Iterator:
        try:
            proj = self.source()
        except Exception:  # Redis unreachable: no sample rather than a failed scrape
            return
        drain = GaugeMetricFamily(
            "weightq_projected_drain_seconds",
            "Projected seconds until every job queued now has a worker (0: none waits; +Inf: jobs wait, no worker)",
        )
        drain.add_metric([], proj.drain_s())
        yield drain
        backlog = GaugeMetricFamily(
            "weightq_backlog_worker_seconds",
            "The running and queued jobs' work in seconds of one worker: scale workers on it (KEDA AverageValue)",
        )
        backlog.add_metric([], proj.backlog_s)
        yield backlog
        wait = GaugeMetricFamily(
            "weightq_projected_wait_seconds", "Projected wait for a worker of a job submitted now, by class",
            labels=["priority"],
        )  # fmt: skip
        for cls in range(MAX_PRIORITY + 1):
            w = proj.wait(cls)
            if w is not None:
                wait.add_metric([str(cls)], w)
        yield wait
        if self.margin is not None:
            margin = GaugeMetricFamily(
                "weightq_wait_margin_seconds",
                "How late first tokens came against their projected waits (p99): kept below MAX_QUEUE_WAIT_S",
            )
            margin.add_metric([], self.margin())
            yield margin


def _cumulative(data: dict) -> list[tuple[str, float]]:
    out, total = [], 0
    for bound, n in zip([*data["buckets"], float("inf")], data["counts"], strict=True):
        total += n
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out


def read_live_workers(client: Any, now: float | None = None) -> dict[str, Heartbeat]:
    """The fresh heartbeats, by worker name, read from the token plane's home (`client`)."""
    return heartbeat.live(client.hgetall(HEARTBEATS), now)


def queue_depths(client, queues: Iterable[str], own: dict[str, str] | None = None) -> dict[tuple[str, int], int]:
    """{(queue, priority class): messages waiting} from the broker's lists (one per class), in one
    round trip. Delivered messages (a worker's prefetch) are not waiting: they are its jobs. `own`
    maps workers' own queues (prefix affinity) to the queue they serve: their jobs count there."""
    own = own or {}
    names = sorted(set(queues) | set(own))
    out: Counter[tuple[str, int]] = Counter()
    for queue, by_priority in zip(names, waiting_by_priority(client, names), strict=True):
        for i, n in enumerate(by_priority):  # its lists and its staged sets (FAIR_QUEUE)
            out[(own.get(queue, queue), MAX_PRIORITY - i)] += n
    return dict(out)
