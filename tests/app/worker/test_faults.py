"""Faults with real processes: Redis restarts, worker restarts under load, a poison job. Nothing accepted
is lost or doubled."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import redis
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client, JobFailed
from weightq.settings import Settings
from weightq.tasks.contract import held_key, job_key, stream_key

from tests.servers import queued_messages, take_queued

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def end_entries(url: str, job_id: str) -> list[dict]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [f for _, f in r.xrange(stream_key(job_id)) if f["type"] in ("end", "error")]


def test_redis_crash_and_restart_mid_run_loses_nothing(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis")  # the embedded default: appendfsync always
    url = server.start()
    worker = WorkerProcess(
        url, "rr@test", tmp_path, max_batch_weight=4096, concurrency=64, visibility_timeout_s=10, lease_renew_s=1,
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
    assert take_queued(r) is not None and not queued_messages(r)  # the message is gone
    service.worker(lost_job_grace_s=1, recover_interval_s=1).wait_ready()
    result = job.result(timeout=60)
    assert result["usage"]["completion_tokens"] == 5 and result["attempt"] == 1
    assert len(end_entries(service.url, "lost-1")) == 1
    assert r.zscore("weightq:queued", "lost-1") is None


def test_a_resumed_job_whose_message_was_lost_is_sent_again(service):
    """A dead worker's reaper sent the job back, and the worker that took the message died before
    recording it: the job is 'running' (its dead run's), listed in weightq:resuming, and its message
    is nowhere. A worker's sweep finds it so twice and sends it again; it resumes."""
    from weightq.tasks.contract import RESUMING

    r = redis.Redis.from_url(service.url, decode_responses=True)
    service.client.submit("lost on the way back", max_new_tokens=5, request_id="lr-1")
    assert take_queued(r) is not None  # the message is gone
    r.hset(job_key("lr-1"), mapping={"state": "running", "attempt": 1, "run": "r1", "charged": "r1", "owner": "x/1"})
    r.sadd(RESUMING, "lr-1")
    service.worker(recover_interval_s=1).wait_ready()
    result = service.client.job("lr-1").result(timeout=60)
    assert result["usage"]["completion_tokens"] == 5 and result["attempt"] == 2
    assert not r.sismember(RESUMING, "lr-1") and r.hget(job_key("lr-1"), "crashes") is None  # released, not charged


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
    survivor.wait_stats(lambda s: s["kv_blocks_used"] == 0)


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


def test_worker_restarts_under_load_sigterm_then_sigkill(service):
    """200 jobs, queued or running, through a warm shutdown (SIGTERM) of one worker and a SIGKILL of
    the next: every job finishes exactly once (state done, the tokens asked for, one end entry)."""
    fast = dict(visibility_timeout_s=6, lease_renew_s=1, restore_interval_s=1, shutdown_grace_s=0.5, concurrency=128)
    fast["engine_process"] = "on"  # the warm shutdown and the SIGKILL with the engine in a process of its own
    r = redis.Redis.from_url(service.url, decode_responses=True)
    asked = {f"L{i}": 16 + i % 4 * 16 for i in range(200)}

    def states() -> list[str | None]:
        pipe = r.pipeline(transaction=False)
        for job_id in asked:
            pipe.hget(job_key(job_id), "state")
        return pipe.execute()

    def wait_done(n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (done := states().count("done")) < n:
            if time.monotonic() > deadline:
                held = [m.decode() for m in queued_messages(redis.Redis.from_url(service.url))] + r.hvals("unacked")
                left = {
                    j: (r.hgetall(job_key(j)) | {"request": "", "result": ""}, sum(f'"{j}"' in m for m in held))
                    for j, state in zip(asked, states(), strict=True)
                    if state != "done"
                }
                raise AssertionError(f"{done} of {n} jobs done; not done (hash, messages): {left}")
            time.sleep(0.05)

    first = service.worker("t1@test", **fast).wait_ready()
    later = list(asked)[120:]  # sent once t2 serves, so that t1 cannot have finished everything
    for job_id, n in asked.items():
        if job_id not in later:
            service.client.submit(f"load {job_id}", max_new_tokens=n, ignore_eos=True, request_id=job_id)
    wait_done(30, 300)
    assert first.stop(timeout=60) == 0  # warm: running jobs go back to the queue
    second = service.worker("t2@test", **fast).wait_ready()
    for job_id in later:
        service.client.submit(f"load {job_id}", max_new_tokens=asked[job_id], ignore_eos=True, request_id=job_id)
    deadline = time.monotonic() + 300
    while not any(r.hget(job_key(j), "owner").startswith("t2@") for j in later if r.hget(job_key(j), "owner")):
        assert time.monotonic() < deadline, "t2 never ran a job"
        time.sleep(0.01)
    second.kill()  # its running and reserved jobs resume on t3
    service.worker("t3@test", **fast).wait_ready()
    wait_done(200, 300)

    by_id = dict(zip(asked, states(), strict=True))
    assert set(by_id.values()) == {"done"}, {k: v for k, v in by_id.items() if v != "done"}
    for job_id, n in asked.items():
        job = r.hgetall(job_key(job_id))
        assert "error" not in job, (job_id, job["error"])
        ends = end_entries(service.url, job_id)
        assert [e["type"] for e in ends] == ["end"], (job_id, ends, job)
        result = json.loads(ends[0]["result"])
        assert result == json.loads(job["result"]) and result["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == n, (job_id, result["usage"])
    assert r.llen("weightq:dead") == 0
    attempts = [int(r.hget(job_key(job_id), "attempt")) for job_id in asked]
    assert max(attempts) >= 2  # the restarts hit jobs that were running


def test_a_dead_engine_process_takes_its_worker_down_and_its_jobs_run_again(service):
    """ENGINE_PROCESS=on: the engine child dies (OOM killer, a crash in a kernel). Its worker must not
    fail the jobs inside (they did nothing wrong) nor live on without an engine: it exits at once, and
    another worker runs its jobs again after the visibility timeout."""
    fast = dict(visibility_timeout_s=5, lease_renew_s=1, restore_interval_s=1, engine_process="on")
    doomed = service.worker("doomed@test", **fast).wait_ready()
    jobs = [service.client.submit(f"doomed {i}", max_new_tokens=400, ignore_eos=True) for i in range(4)]
    next(ev for ev in jobs[0].events(timeout=120) if ev.type == "token")
    engine_pid = doomed.wait_stats(lambda s: "engine_pid" in s)["engine_pid"]
    os.kill(engine_pid, signal.SIGKILL)
    assert doomed.proc.wait(30) == 70, doomed.log()[-3000:]
    assert "engine process died" in doomed.log()
    service.worker("heir@test", **fast).wait_ready()
    results = [job.result(timeout=240) for job in jobs]
    assert [r["usage"]["completion_tokens"] for r in results] == [400] * 4
    assert all(len(end_entries(service.url, job.id)) == 1 for job in jobs)


def test_a_retried_begin_is_not_another_attempt(service):
    """A BEGIN whose reply was lost (or whose write replicas did not confirm) is sent again: the same
    run must not count twice, or retries alone would dead-letter a healthy job."""
    from weightq.tasks.contract import BEGIN, DEAD, LEASES, QUEUED, RESUMING, STARTED_HW

    r = redis.Redis.from_url(service.url)
    begin = r.register_script(BEGIN)
    service.client.submit("once", max_new_tokens=4)  # no worker: the job stays queued
    job_id = r.zrange(QUEUED, 0, 0)[0].decode()

    def run(run_id: str) -> list:
        keys = [job_key(job_id), stream_key(job_id), QUEUED, STARTED_HW, DEAD, held_key("w/1"), RESUMING, LEASES]
        args = [1000, 60, 60, 3, time.time(), "w@test", job_id, "{}", run_id, 5, "w/1", "t"]
        attempt, message, _, crashes, resumed_from = begin(keys=keys, args=args)
        return [attempt, message, crashes, resumed_from]

    r.hset(LEASES, "w/1", "w@test")  # the worker instance is registered: no reaper has seen it die
    assert [run("run-a") for _ in range(5)] == [[1, b"", 0, 0]] * 5  # attempt, message, crashes, resumed from
    # A redelivery is a new attempt; its run ended uncharged while its worker was still registered (kombu's
    # visibility timeout, before any reaper): a crash. Once a reaper has handled the worker, never.
    assert run("run-b") == [2, b"", 1, 0]
    r.hdel(LEASES, "w/1")
    assert run("run-c") == [3, b"", 1, 0]
    types = [f[b"type"] for _, f in r.xrange(stream_key(job_id))]
    assert types == [b"attempt"] * 3
