"""Faults with real processes: Redis restarts, a poison job. Nothing accepted is lost or doubled."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from app.client import Client, JobFailed
from app.redis_server import EmbeddedRedis
from app.settings import Settings
from app.streams import job_key, stream_key
from tests.service import GatewayProcess, WorkerProcess


def end_entries(url: str, job_id: str) -> list[dict]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [f for _, f in r.xrange(stream_key(job_id)) if f["type"] in ("end", "error")]


def test_redis_crash_and_restart_mid_run_loses_nothing(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis")  # the embedded default: appendfsync always
    url = server.start()
    worker = WorkerProcess(
        url, "rr@test", tmp_path, max_batch_weight=4096, concurrency=64, visibility_timeout_s=10,
        lost_job_grace_s=3, recover_interval_s=2,
    )  # fmt: skip
    gateway = GatewayProcess(url, tmp_path)
    try:
        worker.wait_ready()
        gateway.wait_ready()
        client = Client(url, settings=Settings(redis_url=url))
        jobs = [client.submit(f"restart {i}", max_new_tokens=64, ignore_eos=True) for i in range(40)]
        jobs[0].result(timeout=60)  # some done, some running, some queued
        server.proc.kill()  # a crash, not a shutdown
        server.proc.wait()
        time.sleep(2)
        restarted = EmbeddedRedis(tmp_path / "redis", port=server.port)
        restarted.start()
        try:
            results = [job.result(timeout=180) for job in jobs]
            assert all(r["usage"]["completion_tokens"] == 64 for r in results)
            ends = {job.id: len(end_entries(url, job.id)) for job in jobs}
            attempts = [r.get("attempt") for r in results]
            assert set(ends.values()) == {1}, (ends, attempts, worker.log()[-4000:])
            # The gateway and the worker reconnected by themselves.
            r = httpx.post(gateway.base + "/v1/completions", json={"prompt": "after", "max_tokens": 4}, timeout=60)
            assert r.status_code == 200, r.text
            assert worker.proc.poll() is None
        finally:
            gateway.stop()
            worker.stop()
            restarted.stop()
    finally:
        worker.kill()
        server.stop()


def test_a_job_whose_message_was_lost_is_sent_again(service):
    """A Redis crash between kombu's BRPOP and its bookkeeping loses the message: simulated here by
    taking the message off the queue by hand. The job is still 'queued' in its hash; a worker's
    recovery sweep finds it in neither the queue nor the unacked set (twice) and sends it again."""
    r = redis.Redis.from_url(service.url)
    job = service.client.submit("lost and found", max_new_tokens=5, request_id="lost-1")
    assert r.rpop("weightq") is not None and r.llen("weightq") == 0  # the message is gone
    service.worker(lost_job_grace_s=1, recover_interval_s=1).wait_ready()
    result = job.result(timeout=60)
    assert result["usage"]["completion_tokens"] == 5 and result["attempt"] == 1
    assert len(end_entries(service.url, "lost-1")) == 1
    assert r.zscore("weightq:queued", "lost-1") is None


def test_a_poison_job_is_dead_lettered_after_max_attempts(service):
    """A job that kills its worker every time it starts is started MAX_ATTEMPTS times, then refused
    with a clear error, recorded in weightq:dead and failed in Celery; the next worker serves on."""
    settings = dict(max_attempts=2, visibility_timeout_s=3, restore_interval_s=1, lease_renew_s=1)
    r = redis.Redis.from_url(service.url, decode_responses=True)
    poison = service.client.submit("poison", max_new_tokens=1000, ignore_eos=True, request_id="poison")
    for attempt in (1, 2):
        worker = service.worker(f"victim{attempt}@test", **settings).wait_ready()
        deadline = time.monotonic() + 60
        while r.hget("weightq:job:poison", "attempt") != str(attempt):
            assert time.monotonic() < deadline, r.hgetall("weightq:job:poison")
            time.sleep(0.02)
        worker.kill()  # the job "crashes" its worker
    survivor = service.worker("survivor@test", **settings).wait_ready()
    with pytest.raises(JobFailed, match="dead-lettered"):
        poison.result(timeout=60)
    dead = [json.loads(x) for x in r.lrange("weightq:dead", 0, -1)]
    assert [d["id"] for d in dead] == ["poison"] and dead[0]["attempts"] == 2
    assert json.loads(dead[0]["request"])["prompt"] == "poison"
    assert service.client.app.AsyncResult("poison").get(propagate=False, timeout=30) is not None
    assert service.client.app.AsyncResult("poison").state == "FAILURE"
    assert service.client.submit("next", max_new_tokens=3).result(timeout=60)["worker"] == "survivor@test"
    assert survivor.stats()["kv_blocks_used"] == 0


def test_a_job_cancelled_while_its_worker_died_ends_cleanly_on_redelivery(service):
    """The client cancelled (flag set) while the job ran on a worker that then died before acting on
    it: the redelivered message must end the job as cancelled, with an end entry, not leave it running."""
    r = redis.Redis.from_url(service.url, decode_responses=True)
    job = service.client.submit("orphaned cancel", max_new_tokens=5, request_id="oc-1")
    r.hset(job_key("oc-1"), mapping={"state": "running", "cancel": "1", "attempt": "1"})  # as the dead worker left it
    service.worker().wait_ready()
    assert job.result(timeout=60)["finish_reason"] == "cancelled"
    assert r.hget(job_key("oc-1"), "state") == "cancelled"
    assert len(end_entries(service.url, "oc-1")) == 1
