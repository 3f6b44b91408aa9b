"""Jobs through Redis and real Celery worker processes: streaming, errors, cancellation, crashes."""

from __future__ import annotations

import json
import random
import time

import pytest
import redis
from weightq.client import JobFailed
from weightq.tasks.contract import job_key, stream_key, token_parts
from weightq.tasks.request import RequestError

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def stream_entries(url: str, job_id: str) -> list[dict]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [fields for _, fields in r.xrange(stream_key(job_id))]


@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:tiny-t5"])
def test_100_jobs_stream_and_match_the_in_process_engine(service, tiny_loaded, model):
    """The decoder-only model on the paged runner, and a seq2seq model (T5) on the padded runner."""
    from weightq.batcher import BatcherConfig
    from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    w = service.worker(model=model).wait_ready()
    assert w.stats()["runner"] == ("padded" if model.endswith("t5") else "paged")
    rng = random.Random(4)
    specs = [(f"job {i}: the scheduler " + "admits " * rng.randint(0, 30), rng.randint(1, 24)) for i in range(100)]
    # Half one by one, half in one submit_many (the gateway's group commit): the same jobs either way.
    jobs = [service.client.submit(p, max_new_tokens=n, request_id=f"j{i}") for i, (p, n) in enumerate(specs[:50])]
    jobs += service.client.submit_many(
        [{"prompt": p, "max_new_tokens": n, "request_id": f"j{i}"} for i, (p, n) in enumerate(specs) if i >= 50]
    )
    config = EngineConfig(model=model, batcher=BatcherConfig(max_batch_weight=8192))
    local = Engine(config, loaded=tiny_loaded if model == "builtin:tiny" else None).generate(
        [
            GenerationRequest(f"j{i}", prompt=p, params=SamplingParams(max_new_tokens=n))
            for i, (p, n) in enumerate(specs)
        ]
    )
    for job, want in zip(jobs, local, strict=True):
        text = "".join(job.stream(timeout=60))
        result = job.result(timeout=60)
        assert text == result["text"]
        assert result["token_ids"] == list(want.token_ids), job.id
        assert result["finish_reason"] in ("length", "eos")
        assert result["usage"]["completion_tokens"] == len(result["token_ids"])
        assert result["attempt"] == 1
        entries = stream_entries(service.url, job.id)
        assert entries[0] == {"type": "attempt", "attempt": "1", "from": "0"} and entries[-1]["type"] == "end"


def test_submit_many_refuses_a_bad_request_before_writing_any(service):
    good = {"prompt": "fine", "max_new_tokens": 4, "request_id": "many-ok"}
    with pytest.raises(RequestError) as e:
        service.client.submit_many([good, {"prompt": "hi", "temperatur": 0.5, "request_id": "many-bad"}])
    assert e.value.field == "temperatur"
    r = redis.Redis.from_url(service.url)
    assert not r.exists(job_key("many-ok")) and r.llen(service.client.settings.queues.queue) == 0


def test_bad_requests_fail_clearly_and_the_worker_keeps_serving(service):
    w = service.worker(max_input_length=64, max_total_tokens=128).wait_ready()
    app = service.client.app
    bad = {
        "unknown": ({"prompt": "hi", "temperatur": 0.5}, "temperatur"),
        "negative": ({"prompt": "hi", "max_new_tokens": -5}, "max_new_tokens"),
        "too-long": ({"prompt_token_ids": [7] * 100}, "prompt"),
        "over-total": ({"prompt_token_ids": [7] * 60, "max_new_tokens": 100}, "max_new_tokens"),
        "not-object": (["a", "list"], "request"),
    }
    for job_id, (payload, _) in bad.items():
        app.send_task("weightq.generate", args=[payload], task_id=job_id)
    # A pickled message: refused by the JSON-only worker, never executed.
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        producer.publish(
            b"\x80\x04\x95not json at all",
            routing_key="weightq",
            serializer=None,
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers={"task": "weightq.generate", "id": "pickled"},
        )
    for job_id, (_, field) in bad.items():
        # Celery's result first: a plain Celery caller's job has no record until its worker takes it,
        # so weightq's client would call it unknown before then
        assert app.AsyncResult(job_id).get(timeout=60, propagate=False) is not None
        assert app.AsyncResult(job_id).state == "FAILURE"
        with pytest.raises(JobFailed) as e:
            service.client.job(job_id).result(timeout=60)
        assert e.value.field == field, (job_id, str(e.value))
    good = service.client.submit("still serving", max_new_tokens=4)
    assert good.result(timeout=60)["usage"]["completion_tokens"] >= 1
    assert w.proc.poll() is None
    assert "Refusing to deserialize untrusted content of type pickle" in w.log()
    w.wait_stats(lambda s: s["kv_blocks_used"] == 0)


def test_cancel_running_and_queued_jobs(service):
    queued = service.client.submit("never starts", max_new_tokens=50)
    assert queued.cancel() == "queued"  # no worker yet: it ends at once
    assert queued.result(timeout=10)["finish_reason"] == "cancelled"
    w = service.worker().wait_ready()
    running = service.client.submit("a long one", max_new_tokens=2000, ignore_eos=True)
    events = running.events(timeout=60)
    tokens = 0
    for ev in events:
        tokens += ev.type == "token"
        if tokens >= 5:
            break
    assert running.cancel() == "running"
    result = running.result(timeout=30)
    assert result["finish_reason"] == "cancelled" and 5 <= result["usage"]["completion_tokens"] < 2000
    after = service.client.submit("next", max_new_tokens=3).result(timeout=60)
    assert after["finish_reason"] in ("length", "eos")
    w.wait_stats(lambda s: s["kv_blocks_used"] == 0)
    assert service.client.app.AsyncResult(queued.id).state in ("PENDING", "REVOKED", "SUCCESS")


FAST_RECOVERY = dict(visibility_timeout_s=6, lease_renew_s=1, restore_interval_s=1)


def test_sigkill_mid_generation_loses_nothing(service):
    room = dict(FAST_RECOVERY, max_batch_weight=20480)  # all 20 run at once (worst case 20 x ~910)
    first = service.worker("w1@test", **room).wait_ready()
    n = 900  # long enough that none finishes before the kill
    jobs = [
        service.client.submit(f"crash test {i}", max_new_tokens=n, ignore_eos=True, request_id=f"k{i}")
        for i in range(20)
    ]
    for job in jobs:  # every job has produced tokens on the first worker
        next(ev for ev in job.events(timeout=60) if ev.type == "token")
    first.kill()
    service.worker("w2@test", **room).wait_ready()
    for job in jobs:
        result = job.result(timeout=120)
        assert result["finish_reason"] == "length" and result["usage"]["completion_tokens"] == n
        assert result["worker"] == "w2@test" and result["attempt"] == 2
        entries = stream_entries(service.url, job.id)
        assert [e["type"] for e in entries].count("end") == 1 and entries[-1]["type"] == "end"
        markers = [i for i, e in enumerate(entries) if e["type"] == "attempt"]
        assert len(markers) == 2
        tokens = [p for e in entries if e["type"] == "token" for p in token_parts(e)]
        assert [int(e["i"]) for e in tokens] == list(range(n))  # resumed: each index once, in order
        first_run = [p for e in entries[: markers[1]] if e["type"] == "token" for p in token_parts(e)]
        assert 0 < len(first_run) == int(entries[markers[1]]["from"])  # the second run resumed after them
        assert "".join(e["text"] for e in tokens) == result["text"]
        assert [int(e["id"]) for e in tokens] == result["token_ids"]
        assert "".join(job.stream(timeout=10)) == result["text"]
    r = redis.Redis.from_url(service.url)
    assert r.zcard("unacked_index") == 0 and r.hlen("unacked") == 0


def test_a_healthy_generation_longer_than_the_visibility_timeout_runs_once(service):
    # 2,000 tokens take ~5 s on a quiet 2-core machine: more than a visibility timeout of 2 s.
    quick = dict(FAST_RECOVERY, visibility_timeout_s=2, lease_renew_s=0.2)  # ~10 renewals per timeout
    service.worker("w1@test", **quick).wait_ready()
    service.worker("w2@test", **quick).wait_ready()
    job = service.client.submit("slow and steady", max_new_tokens=2000, ignore_eos=True)
    t0 = time.monotonic()
    result = job.result(timeout=180)
    assert time.monotonic() - t0 > 1.5 * quick["visibility_timeout_s"], "the job must outlive the visibility timeout"
    assert result["attempt"] == 1
    assert [e["type"] for e in stream_entries(service.url, job.id)].count("attempt") == 1


def test_two_workers_share_one_queue(service):
    cfg = dict(max_batch_weight=2048, max_total_tokens=256)
    service.worker("w1@test", **cfg).wait_ready()
    service.worker("w2@test", **cfg).wait_ready()
    jobs = [service.client.submit(f"share {i}", max_new_tokens=120, ignore_eos=True) for i in range(40)]
    counts: dict[str, int] = {}
    for job in jobs:
        worker = job.result(timeout=180)["worker"]
        counts[worker] = counts.get(worker, 0) + 1
    assert set(counts) == {"w1@test", "w2@test"}
    assert min(counts.values()) >= 5, counts  # both take a share (unevenly if one is starved of CPU)


def test_worker_refuses_a_pool_that_cannot_host_the_engine(redis_url, tmp_path):
    import os
    import subprocess
    import sys

    out = subprocess.run(  # the installed name, from a directory that is not the repository
        [sys.executable, "-m", "celery", "-A", "weightq", "worker", "-P", "solo"],
        cwd=tmp_path,
        env=dict(os.environ, REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "needs the threads pool" in out.stdout + out.stderr


def test_flower_shows_the_worker_and_engine_stats(service, tmp_path):
    import base64
    import os
    import subprocess
    import sys
    import urllib.request

    from weightq.cli.processes import ROOT
    from weightq.cli.redis_server import free_port

    worker = service.worker().wait_ready()
    service.client.submit("for flower", max_new_tokens=5).result(timeout=60)
    port = free_port()
    flower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "app",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            "--basic-auth=weightq:secret",
            "--inspect_timeout=10000",  # ms: a busy worker answers Flower's inspect late
        ],
        cwd=ROOT,
        env=dict(os.environ, REDIS_URL=service.url),
        stdout=open(tmp_path / "flower.log", "w"),  # noqa: SIM115 (the child keeps its copy)
        stderr=subprocess.STDOUT,
    )
    auth = {"Authorization": "Basic " + base64.b64encode(b"weightq:secret").decode()}
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                url = f"http://127.0.0.1:{port}/api/workers?refresh=1"
                with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=60) as resp:
                    workers = json.loads(resp.read())
                if "w1@test" in workers and "weightq" in workers["w1@test"].get("stats", {}):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "flower.log").read_text()[-3000:]
            time.sleep(0.5)
        stats = workers["w1@test"]["stats"]["weightq"]
        for key in ("running", "waiting", "batch_weight", "max_batch_weight", "kv_blocks_used", "decode_tok_s"):
            assert key in stats
        # The worker started without task events (TASK_EVENTS=0): Flower turns them on (every 5 s), and
        # from then on each job is in its per-task view, through to its success.
        deadline, job, task = time.monotonic() + 120, None, {}
        while task.get("state") != "SUCCESS":
            if job is None or not task:  # not seen: events not on yet, send another
                job = service.client.submit("seen by flower", max_new_tokens=3)
                job.result(timeout=60)
            url = f"http://127.0.0.1:{port}/api/task/info/{job.id}"
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=60) as resp:
                    task = json.loads(resp.read())
            except OSError:  # 404: Flower has no events of this job
                task = {}
            assert time.monotonic() < deadline, worker.log()[-3000:] + (tmp_path / "flower.log").read_text()[-3000:]
            time.sleep(0.5)
        assert task["worker"] == "w1@test" and task["name"] == "weightq.generate"
    finally:
        flower.terminate()
        flower.wait(10)


def test_warm_shutdown_requeues_unfinished_jobs_and_never_hangs(service):
    cfg = dict(FAST_RECOVERY, max_batch_weight=16384, shutdown_grace_s=1)
    first = service.worker("w1@test", **cfg).wait_ready()
    jobs = [service.client.submit(f"shutdown {i}", max_new_tokens=800, ignore_eos=True) for i in range(10)]
    for job in jobs:
        next(ev for ev in job.events(timeout=60) if ev.type == "token")
    assert first.stop(timeout=120) == 0  # SIGTERM: exits cleanly (the jobs finish on w2, attempt 2)
    service.worker("w2@test", **cfg).wait_ready()
    for job in jobs:
        result = job.result(timeout=120)
        assert result["usage"]["completion_tokens"] == 800 and result["worker"] == "w2@test"
        assert result["attempt"] == 2
        assert "".join(job.stream(timeout=10)) == result["text"]


def test_a_client_cancel_during_the_shutdown_grace_ends_the_job_once(service):
    import os
    import signal

    cfg = dict(FAST_RECOVERY, shutdown_grace_s=20)
    first = service.worker("w1@test", **cfg).wait_ready()
    job = service.client.submit("cancel me while my worker stops", max_new_tokens=1500, ignore_eos=True)
    next(ev for ev in job.events(timeout=60) if ev.type == "token")
    os.killpg(first.proc.pid, signal.SIGTERM)  # warm shutdown: the job may run on for the grace period
    deadline = time.monotonic() + 60
    while "warm shutdown" not in first.log().lower():  # Celery has begun its warm shutdown
        assert time.monotonic() < deadline, first.log()[-3000:]
        time.sleep(0.1)
    assert job.cancel() == "running"  # the client gives up meanwhile: a cancel, not a requeue
    assert job.result(timeout=60)["finish_reason"] == "cancelled"
    assert first.proc.wait(60) == 0
    second = service.worker("w2@test", **cfg).wait_ready()
    # a job sent after it is served after anything requeued (FIFO), so by its end a requeue would show
    assert service.client.submit("after", max_new_tokens=3).result(timeout=120)["worker"] == "w2@test"
    second.wait_stats(lambda s: s["active_jobs"] == 0 and s["running"] == 0)
    entries = [f for _, f in service.client.redis.xrange(stream_key(job.id))]
    ends = [e for e in entries if e[b"type"] in (b"end", b"error")]
    assert len(ends) == 1, ends
    assert service.client.redis.hget(job_key(job.id), "state") == b"cancelled"


def test_a_cancel_whose_publish_was_lost_still_ends_the_job_at_shutdown(service):
    """The engine never hears of it (only the job's cancel flag is set, as if its pub/sub message was
    lost): at the end of the grace period the job ends cancelled, with its tokens, instead of going back."""
    import os
    import signal

    cfg = dict(FAST_RECOVERY, shutdown_grace_s=2)
    first = service.worker("w1@test", **cfg).wait_ready()
    job = service.client.submit("cancel me quietly", max_new_tokens=1500, ignore_eos=True)
    next(ev for ev in job.events(timeout=60) if ev.type == "token")
    service.client.redis.hset(job_key(job.id), "cancel", "1")  # the flag alone: no publish
    os.killpg(first.proc.pid, signal.SIGTERM)
    result = job.result(timeout=60)
    assert result["finish_reason"] == "cancelled" and 0 < result["usage"]["completion_tokens"] < 1500
    assert first.proc.wait(60) == 0
    assert service.client.redis.hget(job_key(job.id), "state") == b"cancelled"
    second = service.worker("w2@test", **cfg).wait_ready()
    assert service.client.submit("after", max_new_tokens=3).result(timeout=120)["worker"] == "w2@test"
    second.wait_stats(lambda s: s["active_jobs"] == 0 and s["running"] == 0)
    ends = [f for _, f in service.client.redis.xrange(stream_key(job.id)) if f[b"type"] in (b"end", b"error")]
    assert len(ends) == 1, ends


def test_celerys_per_task_lines_are_off_unless_task_logs_asks(service):
    """Two INFO lines a job cost a short job's worker a sixth of its CPU (bench.jobcost): opt-in."""
    for n, task_logs in enumerate((0, 1)):
        w = service.worker(f"logs{n}@test", task_logs=task_logs).wait_ready()
        job = service.client.submit("log lines", max_new_tokens=2, request_id=f"logs-{n}")
        assert job.result(timeout=60)["finish_reason"] in ("length", "eos")
        w.stop()
        log = w.log()
        assert "weightq engine ready" in log  # weightq's own INFO lines stay
        lines = [f"[logs-{n}] received", f"[logs-{n}] succeeded in"]
        assert [line in log for line in lines] == [bool(task_logs)] * 2, log[-2000:]
