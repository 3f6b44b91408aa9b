"""The token plane on a Redis of its own (STREAMS_REDIS_URL): Celery's queue, unacked messages and
results stay on the broker's Redis, every weightq:* key (streams, jobs, leases, heartbeats) lives on
the other, and jobs submitted through the client and the gateway stream and finish, and resume after
a worker's SIGKILL, exactly as on one Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from weightq.cli.processes import GatewayProcess
from weightq.tasks.contract import LEASES, QUEUED, STREAM_TICK, job_key, stream_key

from tests.app.worker.test_crash_resume import check_one_generation
from tests.servers import PlaneStack, embedded_redis, queued_messages, take_queued
from tests.sse_client import openai_text, read_sse

pytestmark = pytest.mark.service  # real Redis servers and worker processes


@pytest.fixture(scope="module")
def data_url(tmp_path_factory):
    yield from embedded_redis(tmp_path_factory, "data-redis")


@pytest.fixture
def plane(redis_url, data_url, tmp_path):
    """The broker's Redis, the streams' Redis, a client of both and a factory of workers."""
    stack = PlaneStack(redis_url, [data_url], tmp_path)
    yield stack
    stack.close()


def test_streams_and_job_state_live_on_their_own_redis(plane, data_url, tmp_path):
    broker, data = plane.broker, plane.shards[0]
    early = [plane.client.submit(f"split {i}", max_new_tokens=24, request_id=f"e{i}") for i in range(3)]
    # Queued before any worker: the messages wait on the broker, the jobs are recorded with the streams.
    assert len(queued_messages(broker)) == 3
    assert not queued_messages(data)
    assert all(data.hget(job_key(j.id), "state") == "queued" for j in early)
    plane.worker("split@test").wait_ready()
    gateway = GatewayProcess(plane.url, tmp_path, streams_redis_url=data_url).wait_ready()
    try:
        assert httpx.get(gateway.base + "/health", timeout=10).json()["workers"] == 1
        streamed = {}
        body = {"prompt": "split over http", "max_tokens": 32, "stream": True, "ignore_eos": True}
        read_sse(gateway.base, "/v1/completions", body, streamed)
        plain = httpx.post(gateway.base + "/v1/completions", json={"prompt": "plain", "max_tokens": 8}, timeout=120)
    finally:
        gateway.stop()
    assert streamed["status"] == 200 and plain.status_code == 200, (streamed, plain.text)
    http_job = streamed["events"][0][1].split("/")[0]
    http_result = plane.client.job(http_job).result(timeout=30)
    assert openai_text(streamed["events"]) == http_result["text"]
    for job in early:
        text = "".join(job.stream(timeout=120))
        assert text == job.result(timeout=10)["text"]
        check_one_generation(data, job.id, job.result(timeout=10))
    assert plane.client.submit("cancel me", max_new_tokens=4000, ignore_eos=True).cancel() in ("queued", "running")

    # Where each key lives: every weightq:* key with the streams, Celery's alone on the broker.
    data_keys, broker_keys = set(data.keys("*")), set(broker.keys("*"))
    assert {stream_key(j.id) for j in early} | {job_key(http_job), STREAM_TICK, LEASES} <= data_keys
    assert not [k for k in broker_keys if k.startswith("weightq:")], broker_keys
    assert not [k for k in data_keys if not k.startswith("weightq:")], data_keys
    assert any(k.startswith("_kombu.binding.") for k in broker_keys), broker_keys


def test_a_killed_workers_jobs_resume_elsewhere_with_the_plane_split(plane):
    """The reaper finds the dead worker by its lease and connections on the streams' Redis, charges its
    jobs there and puts its messages back on the broker's: they resume within seconds (the visibility
    timeout is ten minutes), as one generation each."""
    kill_one_and_check_resume(plane, [f"k{i}" for i in range(4)], lambda owners: owners["k0"])
    assert not plane.broker.hlen("unacked"), plane.broker.hkeys("unacked")


def kill_one_and_check_resume(plane: PlaneStack, ids: list[str], choose: Callable[[dict[str, str]], str]) -> str:
    """Two workers run sampled jobs `ids`; once each has streamed, the worker `choose` names (given
    each job's owner) is SIGKILLed. Every job ends as one generation, its stream read whole equal to
    its result, and those the dead worker ran resume on the survivor after what they had streamed,
    within seconds: the reaper, not the ten-minute visibility timeout. Returns the dead worker's name."""
    workers = {w.name: w for w in (plane.worker("ka@test"), plane.worker("kb@test"))}
    for w in workers.values():
        w.wait_ready()
    jobs = [
        plane.client.submit(f"kill {i}", max_new_tokens=1200, temperature=1.0, ignore_eos=True, request_id=j)
        for i, j in enumerate(ids)
    ]
    texts: dict[str, list[str]] = {job.id: [] for job in jobs}
    readers = [threading.Thread(target=lambda j=job: texts[j.id].extend(j.stream(timeout=240))) for job in jobs]
    for t in readers:
        t.start()
    for job in jobs:  # each has streamed
        deadline = time.monotonic() + 120
        while plane.shard(job.id).xlen(stream_key(job.id)) < 3:
            assert time.monotonic() < deadline, plane.shard(job.id).hgetall(job_key(job.id))
            time.sleep(0.05)
    owners = {job.id: plane.shard(job.id).hget(job_key(job.id), "owner").split("/")[0] for job in jobs}
    victim = choose(owners)
    (survivor,) = set(workers) - {victim}
    running = {j for j, o in owners.items() if o == victim and plane.shard(j).hget(job_key(j), "state") == "running"}
    workers[victim].kill()
    t0 = time.monotonic()
    results = {job.id: job.result(timeout=240) for job in jobs}
    for t in readers:
        t.join(60)
    assert time.monotonic() - t0 < 200  # the reaper, not the 600 s visibility timeout
    assert running, "no job was running on the killed worker"
    for job_id, result in results.items():
        got = check_one_generation(plane.shard(job_id), job_id, result)
        assert "".join(texts[job_id]) == result["text"]
        if job_id in running:
            assert result["worker"] == survivor
            resumed_from = [int(f["from"]) for f in got if f["type"] == "attempt"]
            assert resumed_from[0] == 0 and resumed_from[-1] > 0, (job_id, resumed_from)
    assert "is dead" in workers[survivor].log()
    return victim


def test_a_job_whose_message_the_broker_lost_is_sent_again_from_the_streams_redis(plane):
    """The message gone from the broker (a broker crash between BRPOP and kombu's bookkeeping), the job
    still queued on the streams' Redis: the recovery sweep finds it in neither the broker's lists nor
    its unacked messages, twice, and sends it again from the request kept in the job hash."""
    job = plane.client.submit("lost on the broker", max_new_tokens=5, request_id="lost-split")
    assert take_queued(plane.broker) is not None
    plane.worker("lost@test", lost_job_grace_s=1, recover_interval_s=1).wait_ready()
    result = job.result(timeout=60)
    assert result["usage"]["completion_tokens"] == 5 and result["attempt"] == 1
    assert plane.shards[0].zscore(QUEUED, "lost-split") is None
