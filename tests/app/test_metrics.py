"""What an operator alerts and scales on, against a real Redis and worker: the queue's depth per class
moves with the load, and latency from submission includes the time a job waited for a worker."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from weightq.gateway.core import Gateway
from weightq.settings import Settings

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def _value(text: str, series: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(series + " "))
    return float(line.rsplit(" ", 1)[1])


def test_queue_depth_moves_and_latency_from_submission_counts_the_wait(service):
    gw = Gateway(Settings(redis_url=service.url))

    def depth(cls: int) -> float:
        return _value(generate_latest(gw.cluster).decode(), f'weightq_queue_depth{{priority="{cls}",queue="weightq"}}')

    assert depth(2) == depth(8) == 0
    jobs = [service.client.submit(f"background {i}", max_new_tokens=4, priority=2) for i in range(5)]
    jobs += [service.client.submit(f"urgent {i}", max_new_tokens=4, priority=8) for i in range(3)]
    assert (depth(2), depth(8)) == (5, 3)  # no worker yet: they wait in Redis, by class
    gap = 1.0
    time.sleep(gap)  # every job waits at least this long before any worker exists
    worker = service.worker().wait_ready()
    for job in jobs:
        job.result(timeout=120)
    assert depth(2) == depth(8) == 0
    m = worker.wait_stats(lambda s: s["metrics"]["job_ttft"]["counts"] and sum(s["metrics"]["job_ttft"]["counts"]) == 8)
    metrics = m["metrics"]
    assert sum(metrics["ttft"]["counts"]) == sum(metrics["job_latency"]["counts"]) == 8
    # from submission = the wait in Redis + the engine's own; the wait was at least `gap` for each job
    assert metrics["job_ttft"]["sum"] >= metrics["ttft"]["sum"] + 8 * gap - 0.05
    assert metrics["job_latency"]["sum"] >= metrics["latency"]["sum"] + 8 * gap - 0.05
    cluster = generate_latest(gw.cluster).decode()
    assert _value(cluster, 'weightq_job_time_to_first_token_seconds_count{worker="w1@test"}') == 8
