"""A worker crash costs the user nothing: jobs resume from their streamed tokens on another worker
within seconds (not kombu's visibility timeout, set to ten minutes here), every reader sees each
index once and the text it streamed is the result's; a paused worker's jobs stay put, and one taken
for dead cannot write into a job that resumed elsewhere; a poison job is dead-lettered alone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import redis
from weightq.cli.processes import GatewayProcess
from weightq.client import JobFailed
from weightq.engine.sampling.grammar import available
from weightq.tasks.contract import LEASES, emitted_tokens, engine_jobs_key, held_key, job_key, stream_key, token_parts
from weightq.transport import restore_unacked

from tests.servers import queued_messages
from tests.sse_client import openai_text, read_sse

pytestmark = pytest.mark.service  # real Redis servers and worker processes

SLOW_RESTORE = dict(visibility_timeout_s=600, max_batch_weight=32768, concurrency=32)
N = 1200  # tokens per job: none finishes while the second worker starts


def entries(r: redis.Redis, job_id: str) -> list[dict]:
    return [f for _, f in r.xrange(stream_key(job_id))]


def check_one_generation(r: redis.Redis, job_id: str, result: dict) -> list[dict]:
    """Each index once, in order; the tokens' texts, ids and log-probabilities are the result's."""
    got = entries(r, job_id)
    tokens = [p for f in got if f["type"] == "token" for p in token_parts(f)]
    assert [int(f["i"]) for f in tokens] == list(range(len(result["token_ids"]))), job_id
    emitted = emitted_tokens(got)
    assert emitted.token_ids == result["token_ids"], job_id
    assert "".join(emitted.texts) == result["text"], job_id
    if "logprobs" in result:
        assert [json.loads(x) for x in emitted.logprobs] == result["logprobs"], job_id
    assert [f["type"] for f in got].count("end") == 1 and got[-1]["type"] == "end", job_id
    return got


def where(r: redis.Redis, job_ids: list[str]) -> dict:
    """Unfinished jobs' hashes and where their messages are (a failing test's message)."""
    held = {i: r.smembers(held_key(i)) for i in r.hkeys(LEASES)}
    unacked = {t: json.loads(m)[0]["headers"]["id"] for t, m in r.hgetall("unacked").items()}
    queued = [json.loads(m)["headers"]["id"] for m in queued_messages(r)]
    return {
        j: (r.hgetall(job_key(j)) | {"request": ""}, [t for t, i in unacked.items() if i == j], queued.count(j))
        for j in job_ids
        if r.hget(job_key(j), "state") != "done"
    } | {"held": held}


def held_tag_of(r: redis.Redis, instance: str, job_id: str) -> str:
    for tag in r.smembers(held_key(instance)):
        raw = r.hget("unacked", tag)
        if raw is not None and json.loads(raw)[0]["headers"]["id"] == job_id:
            return tag
    raise AssertionError(f"no message of {job_id} held by {instance}")


@pytest.fixture
def gateway(service, tmp_path):
    g = GatewayProcess(service.url, tmp_path)
    try:
        yield g.wait_ready()
    finally:
        g.stop()


def test_a_paused_worker_keeps_its_jobs_and_a_killed_ones_resume_elsewhere_as_one_generation(service, gateway):
    r = redis.Redis.from_url(service.url, decode_responses=True)
    a = service.worker("a@test", **SLOW_RESTORE).wait_ready()
    kinds = {
        "greedy": dict(temperature=0),
        "seeded": dict(temperature=1.0, seed=5, top_p=0.9, frequency_penalty=0.3),
        "unseeded": dict(temperature=1.0),
        "logprobs": dict(temperature=1.0, logprobs=2),
        "stop": dict(temperature=1.0, stop=["zq"]),
    }
    jobs = {
        name: service.client.submit(f"resume {name}", max_new_tokens=N, ignore_eos=True, request_id=name, **params)
        for name, params in kinds.items()
    }
    if available():
        guided = {"regex": "[a-z ]{1500,1600}"}  # several hundred tokens
        jobs["guided"] = service.client.submit(
            "resume guided", max_new_tokens=N, temperature=1.0, guided=guided, request_id="guided"
        )
    streams: dict[str, dict] = {"openai": {}, "tgi": {}}
    body = {"prompt": "resume over http", "max_tokens": N, "temperature": 1.0, "stream": True, "ignore_eos": True}
    tgi = {"inputs": "resume tgi", "parameters": {"max_new_tokens": N, "do_sample": True, "temperature": 1.0}}
    readers = [
        threading.Thread(target=read_sse, args=(gateway.base, "/v1/completions", body, streams["openai"])),
        threading.Thread(target=read_sse, args=(gateway.base, "/generate_stream", tgi, streams["tgi"])),
    ]
    for t in readers:
        t.start()
    texts = {name: [] for name in jobs}
    for name, job in jobs.items():  # every job streams on worker a
        texts[name].append(next(job.stream(timeout=120)))
    b = service.worker("b@test", **SLOW_RESTORE).wait_ready()
    (instance,) = [i for i, host in r.hgetall(LEASES).items() if host == "a@test"]

    # A long pause (GC, a stalled step, SIGSTOP): the lease lapses but the connections stay: nothing moves.
    os.killpg(a.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(3 * service.client.settings.worker.lease_ttl_s)
        attempts = {name: r.hget(job_key(name), "attempt") for name in jobs}
    finally:
        os.killpg(a.proc.pid, signal.SIGCONT)
    assert set(attempts.values()) == {"1"}, attempts
    assert "is dead" not in b.log()

    # Taken for dead while paused (as kombu's visibility timeout would): the job resumes on b, and a
    # cannot write into it once it wakes up.
    os.killpg(a.proc.pid, signal.SIGSTOP)
    try:
        restore_unacked(r, [held_tag_of(r, instance, "seeded")])
        deadline = time.monotonic() + 60
        while r.hget(job_key("seeded"), "attempt") != "2":
            assert time.monotonic() < deadline, r.hgetall(job_key("seeded"))
            time.sleep(0.05)
    finally:
        os.killpg(a.proc.pid, signal.SIGCONT)
    time.sleep(1)

    running = {name for name in jobs if r.hget(job_key(name), "state") == "running"}
    assert len(running) >= len(jobs) - 1, running
    a.kill()  # SIGKILL: the rest resume on b, found dead by b's reaper
    t0 = time.monotonic()
    results = {name: job.result(timeout=240) for name, job in jobs.items()}
    for t in readers:
        t.join(240)
    assert time.monotonic() - t0 < 200  # nothing waited for the 600 s visibility timeout
    for name, result in results.items():
        got = check_one_generation(r, name, result)
        assert "".join(jobs[name].stream(timeout=10)) == result["text"]
        if name in running:
            assert result["worker"] == "b@test", (name, result["attempt"])
            resumed_from = [int(f["from"]) for f in got if f["type"] == "attempt"]
            assert resumed_from[0] == 0 and resumed_from[-1] > 0, (name, resumed_from)
    assert "resumed on another worker" in a.log()  # the fence stopped a's run of the seeded job

    # Through the gateway: the SSE streams (OpenAI and TGI) as they went through the pause and the kill.
    events = streams["openai"]["events"]
    job_id = events[0][1].split("/")[0]
    result = service.client.job(job_id).result(timeout=10)
    check_one_generation(r, job_id, result)
    assert openai_text(events) == result["text"]
    *tgi_events, (_, _, last) = streams["tgi"]["events"]
    tgi_job = tgi_events[0][1].split("/")[0]
    tgi_text = "".join(e["token"]["text"] for _, _, e in tgi_events if not e["token"]["special"])
    assert last["generated_text"] == tgi_text == service.client.job(tgi_job).result(timeout=10)["text"]
    # A client reconnecting with Last-Event-ID picks up exactly where it left off.
    cut = len(events) // 2
    again: dict = {}
    read_sse(gateway.base, "/v1/completions", body, again, {"Last-Event-ID": events[cut - 1][1]})
    assert openai_text(events[:cut]) + openai_text(again["events"]) == result["text"]


def test_a_poison_job_among_healthy_ones_is_dead_lettered_alone(service):
    """A job that kills its worker whenever it runs, among 16 healthy ones: three crashes. Each crash is
    charged to the jobs inside the engine; after two, a job runs alone, and only the job that crashes
    its worker alone is dead-lettered. The healthy jobs all finish, as one generation each."""
    r = redis.Redis.from_url(service.url, decode_responses=True)
    cfg = dict(SLOW_RESTORE, max_attempts=3)
    healthy = [
        service.client.submit(f"healthy {i}", max_new_tokens=150, temperature=1.0, ignore_eos=True, request_id=f"h{i}")
        for i in range(16)
    ]
    service.client.submit("poison", max_new_tokens=150, temperature=1.0, ignore_eos=True, request_id="p")
    crashes = 0
    worker = service.worker("v0@test", **cfg).wait_ready()
    deadline = time.monotonic() + 300
    while crashes < 3:
        assert time.monotonic() < deadline, r.hgetall(job_key("p"))
        owner = r.hget(job_key("p"), "owner") or ""
        inside = owner.startswith(worker.name) and r.hget(job_key("p"), "state") == "running"
        if inside and r.sismember(engine_jobs_key(owner), "p"):
            next_worker = service.worker(f"v{crashes + 1}@test", **cfg)
            worker.kill()  # the poison job crashes its worker
            crashes += 1
            worker = next_worker.wait_ready()
        time.sleep(0.05)
    try:
        results = [job.result(timeout=300) for job in healthy]
    except TimeoutError:
        raise AssertionError(where(r, [j.id for j in healthy])) from None
    assert all(res["usage"]["completion_tokens"] == 150 for res in results)
    for job, res in zip(healthy, results, strict=True):
        check_one_generation(r, job.id, res)
    with pytest.raises(JobFailed, match="dead-lettered"):
        service.client.job("p").result(timeout=300)
    dead = [json.loads(x) for x in r.lrange("weightq:dead", 0, -1)]
    assert [d["id"] for d in dead] == ["p"] and dead[0]["attempts"] == 3
    assert r.hget(job_key("p"), "state") == "done" and "dead-lettered" in r.hget(job_key("p"), "error")
