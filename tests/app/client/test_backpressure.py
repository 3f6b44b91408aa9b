"""Backpressure and deadlines through a real Redis and a real worker (the simulated device, whose
steps take a known time): a job that would wait past MAX_QUEUE_WAIT_S is refused at once with when to
come back, by the client (Overloaded) and the gateway (429, Retry-After); a deadline that cannot be
met is refused at submission, and one that passes while the job is queued ends it unrun."""

from __future__ import annotations

import time

import httpx
import pytest
from weightq.cli.processes import GatewayProcess
from weightq.client import Client, DeadlineUnreachable, JobExpired, Overloaded
from weightq.settings import Settings
from weightq.tasks.contract import TASK_NAME

pytestmark = pytest.mark.service  # real Redis servers and worker processes

# 40 ms a step: a 48-token job holds its slot ~2 s; a 512-token budget runs about 8 of them at once
SLOW = {
    "runner": "simulated", "sim_step_cost": "0.04,0,0", "max_batch_weight": 512, "max_total_tokens": 128,
    "concurrency": 16,
}  # fmt: skip
FLOOD = [{"prompt_token_ids": [5, 6, 7, 8], "max_new_tokens": 48, "ignore_eos": True} for _ in range(64)]


def client_with(url: str, **settings) -> Client:
    return Client(url, settings=Settings(redis_url=url, **settings))


def busy(stats: dict) -> bool:
    o = stats.get("outlook") or {}
    return o.get("running", 0) > 0 and stats.get("recent_step_s", 0) > 0


def test_a_flood_is_refused_past_the_bound_with_an_honest_retry_after(service):
    worker = service.worker(**SLOW)
    worker.wait_ready()
    flood = service.client.submit_many(FLOOD, background=False)  # class 5; MAX_QUEUE_WAIT_S unset: never refused
    worker.wait_stats(busy)
    strict = client_with(service.url, max_queue_wait_s=4.0)
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as refused:
        strict.submit(prompt_token_ids=[1, 2, 3], max_new_tokens=8)
    assert time.monotonic() - t0 < 5  # at once, not after a wait (no wall-clock bound on a busy CI)
    e = refused.value
    assert e.wait_s > 4.0 and e.retry_after_s >= 1
    assert "MAX_QUEUE_WAIT_S" in str(e)
    # the projection is of the right size: ~56 jobs ahead over ~8 slots of ~2 s each
    assert 6 <= e.wait_s <= 90, e.wait_s
    # an urgent class waits only for the next free slot (~2 s): it is let in
    urgent = strict.submit(prompt_token_ids=[1, 2, 3], max_new_tokens=8, priority=9)
    # a deadline the queue cannot meet is refused, naming the field
    with pytest.raises(DeadlineUnreachable) as late:
        service.client.submit(prompt_token_ids=[1, 2, 3], max_new_tokens=8, expires=0.5)
    assert late.value.field == "deadline"
    assert urgent.result(timeout=120)["usage"]["completion_tokens"] == 8
    assert strict.backpressure.error.samples() == 1  # its first token taught the margin how late it came
    for job in flood:
        assert job.result(timeout=300)["usage"]["completion_tokens"] == 48
    # drained: the same submission is accepted now
    strict.submit(prompt_token_ids=[1, 2, 3], max_new_tokens=8).result(timeout=120)


def test_a_deadline_that_passes_in_the_queue_ends_the_job_unrun(service):
    # no worker yet: nothing to project from, so it is accepted and waits in the queue
    job = service.client.submit(prompt_token_ids=[1, 2, 3], max_new_tokens=8, expires=1.0)
    on_time = service.client.submit(prompt_token_ids=[1, 2, 3], max_new_tokens=8, expires=600)
    # a Celery caller by name, with Celery's own `expires`: Celery drops it unrun, and its job ends
    service.client.app.send_task(TASK_NAME, args=[{"prompt": "by name"}], task_id="by-name-1", expires=1.0)
    time.sleep(1.5)
    service.worker(**SLOW).wait_ready()
    for expiring in (job, service.client.job("by-name-1")):
        with pytest.raises(JobExpired) as expired:
            expiring.result(timeout=120)
        assert expired.value.field == "deadline"
        assert not [e for e in expiring.events() if e.type == "token"]  # it never ran
    assert on_time.result(timeout=120)["usage"]["completion_tokens"] == 8


def test_the_gateway_answers_429_with_retry_after_and_exports_the_drain_time(service, tmp_path):
    worker = service.worker(**SLOW)
    gateway = GatewayProcess(service.url, tmp_path, max_queue_wait_s=1.0)
    worker.wait_ready()
    gateway.wait_ready()
    try:
        flood = service.client.submit_many(FLOOD, background=False)
        worker.wait_stats(busy)
        body = {"model": "builtin:tiny", "prompt": "hello", "max_tokens": 8}
        r = httpx.post(gateway.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert "MAX_QUEUE_WAIT_S" in r.json()["error"]["message"]
        # a stream resumed meanwhile asks for no job: it is served, not refused with the new ones
        resume = {"Last-Event-ID": f"{flood[0].id}/0-0"}
        url, streamed = gateway.base + "/v1/completions", body | {"stream": True}
        with httpx.stream("POST", url, json=streamed, headers=resume, timeout=60) as s:
            assert s.status_code == 200
            data = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and len(data) > 2
        metrics = httpx.get(gateway.base + "/metrics/cluster", timeout=30).text
        drain = [ln for ln in metrics.splitlines() if ln.startswith("weightq_projected_drain_seconds ")]
        assert drain and float(drain[0].split()[1]) > 1.0
        assert 'weightq_projected_wait_seconds{priority="9"}' in metrics
        assert "weightq_wait_margin_seconds 0.1" in metrics  # no first token seen yet: the prior, 0.1 of the bound
        r = httpx.post(gateway.base + "/v1/completions", json=body, headers={"X-Deadline-S": "nonsense"}, timeout=60)
        assert r.status_code == 400 and "X-Deadline-S" in r.text
    finally:
        gateway.stop()
