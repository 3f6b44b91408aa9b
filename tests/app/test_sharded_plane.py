"""The token plane over two Redis shards (STREAMS_REDIS_URL="a,b"): each job's keys, and the shard's
own index keys, live on the shard its id hashes to; the pool's keys on the first. Jobs submitted
through the client and the gateway stream, finish, cancel and resume after a worker's SIGKILL exactly
as on one Redis, and a job whose message the broker lost is sent again from its shard."""

from __future__ import annotations

import time

import httpx
import pytest
import redis
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.client import Client
from weightq.settings import Settings
from weightq.tasks.contract import HEARTBEATS, LEASES, QUEUED, STREAM_TICK, job_key, shard_of, stream_key

from tests.app.test_split_plane import kill_one_and_check_resume
from tests.app.worker.test_crash_resume import check_one_generation
from tests.servers import PLANE_WORKER, PlaneStack, embedded_redis, queued_messages, take_queued
from tests.sse_client import openai_text, read_sse

pytestmark = pytest.mark.service  # real Redis servers and worker processes


@pytest.fixture(scope="module")
def shard_urls(tmp_path_factory):
    gens = [embedded_redis(tmp_path_factory, f"shard{n}") for n in range(2)]
    urls = [next(g) for g in gens]
    yield urls
    for g in gens:
        next(g, None)


def ids_on_both(prefix: str, n: int) -> list[str]:
    """`n` ids, alternating between the two shards."""
    ids: list[str] = []
    k = 0
    while len(ids) < n:
        candidate = f"{prefix}{k}"
        if shard_of(candidate, 2) == len(ids) % 2:
            ids.append(candidate)
        k += 1
    return ids


@pytest.fixture
def plane(redis_url, shard_urls, tmp_path):
    stack = PlaneStack(redis_url, shard_urls, tmp_path)
    yield stack
    stack.close()


def test_each_jobs_keys_live_on_its_shard_and_everything_works_as_on_one(plane, tmp_path):
    home, other = plane.shards
    ids = ids_on_both("sh", 8)
    early = [plane.client.submit(f"sharded {i}", max_new_tokens=24, request_id=j) for i, j in enumerate(ids)]
    assert len(queued_messages(plane.broker)) == 8
    for job in early:  # recorded on its own shard, listed in that shard's queued set, absent from the other
        assert plane.shard(job.id).hget(job_key(job.id), "state") == "queued"
        assert plane.shard(job.id).zscore(QUEUED, job.id) is not None
        assert not (set(plane.shards) - {plane.shard(job.id)}).pop().exists(job_key(job.id))
    first_worker = plane.worker("shard@test")
    first_worker.wait_ready()
    gateway = GatewayProcess(plane.url, tmp_path, streams_redis_url=plane.streams_redis_url).wait_ready()
    try:
        assert httpx.get(gateway.base + "/health", timeout=10).json()["workers"] == 1
        streamed = []
        for n in range(4):  # the gateway's jobs land on both shards too
            out: dict = {}
            body = {"prompt": f"sharded over http {n}", "max_tokens": 16, "stream": True, "ignore_eos": True}
            read_sse(gateway.base, "/v1/completions", body, out)
            streamed.append(out)
        plain = httpx.post(gateway.base + "/v1/completions", json={"prompt": "plain", "max_tokens": 8}, timeout=120)
        assert plain.status_code == 200, plain.text
        # resuming a stream by Last-Event-ID finds the job on its shard
        first = streamed[0]["events"][0][1]
        again = httpx.post(
            gateway.base + "/v1/completions",
            json={"prompt": "sharded over http 0", "max_tokens": 16, "stream": True, "ignore_eos": True},
            headers={"Last-Event-ID": first},
            timeout=60,
        )
        assert again.status_code == 200 and "[DONE]" in again.text, again.text
    finally:
        gateway.stop()
    http_jobs = [s["events"][0][1].split("/")[0] for s in streamed]
    assert {shard_of(j, 2) for j in http_jobs + ids} == {0, 1}
    for out, job_id in zip(streamed, http_jobs, strict=True):
        assert out["status"] == 200
        assert openai_text(out["events"]) == plane.client.job(job_id).result(timeout=30)["text"]
    for job in early:
        text = "".join(job.stream(timeout=120))
        result = job.result(timeout=10)
        assert text == result["text"]
        check_one_generation(plane.shard(job.id), job.id, result)
    # the pool's keys on the home; each shard its own tick
    assert home.hlen(HEARTBEATS) == 1 and not other.exists(HEARTBEATS)
    assert home.hexists(LEASES, plane.shard(ids[0]).hkeys(LEASES)[0])
    assert home.exists(STREAM_TICK) and other.exists(STREAM_TICK)
    assert not [k for k in plane.broker.keys("*") if k.startswith("weightq:")]

    # cancels reach a queued job and a running one on either shard
    first_worker.kill()
    queued = [plane.client.submit("cancel queued", max_new_tokens=8, request_id=j) for j in ids_on_both("cq", 2)]
    assert [job.cancel() for job in queued] == ["queued", "queued"]
    second = plane.worker("shard2@test")
    second.wait_ready()
    running = [
        plane.client.submit("cancel running", max_new_tokens=1500, ignore_eos=True, request_id=j)
        for j in ids_on_both("cr", 2)
    ]
    for job in running:
        deadline = time.monotonic() + 120
        while plane.shard(job.id).xlen(stream_key(job.id)) < 3:
            assert time.monotonic() < deadline, second.log()[-5000:]
            time.sleep(0.05)
        assert job.cancel() == "running"
    for job in queued + running:
        assert job.result(timeout=60)["finish_reason"] == "cancelled"


def test_a_killed_workers_jobs_resume_elsewhere_on_both_shards(plane):
    """The worker running jobs on both shards (else the one running most) is killed: its jobs are
    charged on their own shards and resume on the survivor; its records leave every shard."""

    def on_both_shards(owners: dict[str, str]) -> str:
        return max(set(owners.values()), key=lambda w: (len({shard_of(j, 2) for j, o in owners.items() if o == w}), w))

    victim = kill_one_and_check_resume(plane, ids_on_both("k", 6), on_both_shards)
    assert not plane.broker.hlen("unacked")
    for shard in plane.shards:  # the dead instance's records are gone from every shard
        assert all(not k.startswith(victim + "/") for k in shard.hkeys(LEASES))


def test_a_lost_message_is_sent_again_from_its_shard(plane):
    (job_id,) = [j for j in ids_on_both("lost", 2) if shard_of(j, 2) == 1]
    job = plane.client.submit("lost on the broker", max_new_tokens=5, request_id=job_id)
    assert take_queued(plane.broker) is not None
    plane.worker("lost@test", lost_job_grace_s=1, recover_interval_s=1).wait_ready()
    result = job.result(timeout=60)
    assert result["usage"]["completion_tokens"] == 5 and result["attempt"] == 1
    assert plane.shards[1].zscore(QUEUED, job_id) is None


def test_a_shard_added_while_jobs_run_moves_none_of_them(plane, tmp_path_factory):
    """Rolled out as the README says: a worker on the longer list starts, the one on the old list stops
    (warm: its running jobs go back and resume on the new one), then clients use the longer list. The
    jobs drawn on two shards keep their keys where they were and finish as one generation each; jobs
    drawn after land on the third too."""
    server = embedded_redis(tmp_path_factory, "added")
    third = next(server)
    try:
        slow = dict(runner="simulated", sim_step_cost="0.01,0,0", shutdown_grace_s=0.5)
        before = plane.worker("before@test", **slow).wait_ready()
        early = [plane.client.submit(f"before {i}", max_new_tokens=300, ignore_eos=True) for i in range(8)]
        assert {shard_of(j.id, 2) for j in early} == {0, 1}
        before.wait_stats(lambda s: s.get("active_jobs", 0) >= 4)
        longer = f"{plane.streams_redis_url},{third}"
        after = WorkerProcess(plane.url, "after@test", plane.home, streams_redis_url=longer, **(PLANE_WORKER | slow))
        try:
            after.wait_ready()
            assert before.stop() == 0
            grown = Client(plane.url, settings=Settings(redis_url=plane.url, streams_redis_url=longer))
            late = [grown.submit(f"after {i}", max_new_tokens=4) for i in range(30)]
            added = redis.Redis.from_url(third, decode_responses=True)
            for job in early:
                result = grown.job(job.id).result(timeout=120)
                assert result["usage"]["completion_tokens"] == 300
                assert shard_of(job.id, 3) == shard_of(job.id, 2)  # where it was: no key moved
                check_one_generation(plane.shard(job.id), job.id, result)
                assert not added.exists(job_key(job.id), stream_key(job.id))
            for job in late:
                assert grown.job(job.id).result(timeout=60)["usage"]["completion_tokens"] == 4
            assert any(added.hget(job_key(job.id), "state") == "done" for job in late)  # (once all have ended)
            assert after.wait_stats(lambda s: s.get("finished", 0) >= 30)  # the new worker ran them all
        finally:
            after.kill()
    finally:
        next(server, None)
