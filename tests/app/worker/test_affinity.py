"""Prefix affinity on the pull queue (AFFINITY): same-prefix jobs go to one worker's own queue; a
worker with room steals from a backlogged one; a hot prefix spreads past AFFINITY_BACKLOG; a killed
worker's queued jobs run elsewhere; AFFINITY=0 keeps the single queue."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import redis
from weightq.client import Client
from weightq.client.routing import Router
from weightq.settings import Settings
from weightq.tasks.affinity import rendezvous, route_key
from weightq.tasks.contract import HEARTBEATS, WORKER_QUEUES, fair_key, job_key, lease_key, worker_queue
from weightq.tasks.request import JobRequest
from weightq.token_plane import TokenPlane
from weightq.transport import priority_queues, waiting_counts
from weightq.worker.affinity import Affinity

pytestmark = pytest.mark.service  # real Redis servers and worker processes

SLOW = dict(runner="simulated", sim_step_cost="0.01,0,0", max_batch_weight=8192)  # 10 ms a step


def prefix_for(worker: str, workers: list[str], tag: str) -> str:
    """A prompt prefix whose jobs the rendezvous sends to `worker`."""
    for i in range(1000):
        text = f"{tag} {i}: " + "the same long system prompt, " * 12
        if rendezvous(route_key(JobRequest(prompt=text), 256), workers)[0] == worker:
            return text
    raise AssertionError("no prefix found")


def register_own_queues(r: redis.Redis, queue: str, names: list[str]) -> list[str]:
    """Each worker's own queue listed in the registry, as a worker registers it (instance `<name>/1`)."""
    owns = [worker_queue(queue, name) for name in names]
    for name, own in zip(names, owns, strict=True):
        r.hset(WORKER_QUEUES, own, json.dumps({"queue": queue, "instance": f"{name}/1", "hostname": name}))
    return owns


def ran_on(client: Client, job_id: str) -> str:
    """The worker of the job's last run (its instance is the job's owner: hostname/suffix)."""
    owner = client.redis.hget(job_key(job_id), "owner")
    return owner.decode().rsplit("/", 1)[0] if owner else ""


def heartbeat(r: redis.Redis, name: str, own: str, queue: str = "weightq") -> None:
    r.hset(HEARTBEATS, name, json.dumps({"queue": queue, "own_queue": own, "ts": time.time()}))


def test_moving_a_queue_keeps_each_priority_and_the_order(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    a = Affinity(r, r, Settings(redis_url=redis_url), "w1@t", "w1@t/x")
    src, dst = priority_queues("src"), priority_queues("dst")
    for i in range(5):  # kombu pushes on the left and takes from the right: m0 is the oldest
        r.lpush(src[0], f"urgent{i}")
        r.lpush(src[5], f"p5-{i}")
    assert a.move("src", "dst", 3) == 3  # the most urgent list first, oldest first
    assert [r.rpop(dst[0]) for _ in range(3)] == [b"urgent0", b"urgent1", b"urgent2"]
    r.lpush(dst[5], "already there")
    assert a.move("src", "dst") == 7
    assert r.llen(src[0]) == r.llen(src[5]) == 0
    assert [r.rpop(dst[5]) for _ in range(6)] == [b"p5-0", b"p5-1", b"p5-2", b"p5-3", b"p5-4", b"already there"]


def test_a_dead_workers_queue_goes_to_the_shared_queue_and_a_live_ones_stays(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    queue = Settings(redis_url=redis_url).queues.queue
    for own in register_own_queues(r, queue, ["dead@t", "live@t"]):
        r.lpush(priority_queues(own)[4], "job a", "job b")
    r.set(lease_key("live@t/1"), "live@t", px=10_000)
    for name in ("dead@t", "live@t"):  # fair-order state, nothing staged
        r.hset(fair_key(worker_queue(queue, name)), mapping={"v:4": 30, "n": 0})
    me = Affinity(r, r, Settings(redis_url=redis_url, visibility_timeout_s=1, lease_ttl_s=0.1), "me@t", "me@t/1")
    assert me.drain_dead() == 2
    assert waiting_counts(r, [queue, worker_queue(queue, "dead@t"), worker_queue(queue, "live@t")]) == [2, 0, 2]
    assert r.rpop(priority_queues(queue)[4]) == b"job a"  # the oldest is taken first, at its priority
    assert r.hexists(WORKER_QUEUES, worker_queue(queue, "dead@t"))  # a restore may still target it
    time.sleep(1.3)
    assert me.drain_dead() == 0
    assert not r.hexists(WORKER_QUEUES, worker_queue(queue, "dead@t"))  # empty, no heartbeat: forgotten
    assert not r.exists(fair_key(worker_queue(queue, "dead@t")))  # with its fair-order state
    assert r.hexists(WORKER_QUEUES, worker_queue(queue, "live@t"))
    assert r.exists(fair_key(worker_queue(queue, "live@t")))


def test_a_worker_steals_only_a_backlog_seen_at_two_polls_and_counts_its_idle_time(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    queue = Settings(redis_url=redis_url).queues.queue
    theirs, _ = register_own_queues(r, queue, ["owner@t", "thief@t"])
    r.lpush(priority_queues(theirs)[4], *[f"job {i}" for i in range(6)])
    thief = Affinity(r, r, Settings(redis_url=redis_url), "thief@t", "thief@t/1")
    assert thief.steal(room=4, idle=True) == 0  # its owner may take it within a poll: left there
    assert thief.idle_queued_s > 0  # but the idle time while it waited is counted
    assert thief.steal(room=0) == 0  # no room: nothing
    assert thief.steal(room=4) == 3  # still there a poll later: half of it, the oldest first
    assert waiting_counts(r, [theirs, thief.queue]) == [3, 3] and thief.stolen == 3
    assert r.rpop(priority_queues(thief.queue)[4]) == b"job 0"


def test_a_message_of_an_own_queue_is_restored_to_the_shared_queue(redis_url):
    from kombu.transport import redis as kombu_redis
    from weightq.transport import restore_unacked

    r = redis.Redis.from_url(redis_url)
    r.flushall()
    own = worker_queue("weightq", "gone@t")
    message = {"body": "", "headers": {"id": "j1"}, "properties": {"priority": 4, "delivery_tag": "t1"}}
    r.hset("unacked", "t1", kombu_redis.dumps([message, "", own]))
    r.zadd("unacked_index", {"t1": 1.0})
    assert restore_unacked(r, ["t1"]) == ["j1"]
    assert waiting_counts(r, ["weightq", own]) == [1, 0] and r.llen(priority_queues("weightq")[4]) == 1


def test_the_queue_depth_counts_own_queues_in_the_queue_they_serve(redis_url):
    from weightq.metrics import queue_depths

    r = redis.Redis.from_url(redis_url)
    r.flushall()
    own = worker_queue("weightq", "a@t")
    r.lpush(priority_queues(own)[4], "x", "y")
    r.lpush(priority_queues("weightq")[4], "z")
    depths = queue_depths(r, ["weightq"], {own: "weightq"})
    assert depths[("weightq", 5)] == 3 and sum(depths.values()) == 3


def test_the_router_sends_a_prefix_to_its_worker_until_the_backlog_then_to_the_shared_queue(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    s = Settings(redis_url=redis_url, affinity_backlog=4).queues
    queue = s.queue
    assert Router(r, r, s).queues([JobRequest(prompt="x")]) == [queue]  # no worker known: the shared queue
    names = ["a@t", "b@t"]
    for n in names:
        heartbeat(r, n, worker_queue(queue, n))
    heartbeat(r, "other@t", "elsewhere.w.other@t", queue="another-model")  # another queue's worker
    hot = prefix_for("a@t", names, "hot")
    cold = prefix_for("b@t", names, "cold")
    jobs = [JobRequest(prompt=hot + str(i)) for i in range(10)] + [JobRequest(prompt=cold + "!")]
    queues = Router(r, r, s).queues(jobs)
    assert queues == [worker_queue(queue, "a@t")] * 4 + [queue] * 6 + [worker_queue(queue, "b@t")]
    r.lpush(priority_queues(worker_queue(queue, "b@t"))[0], *range(4))  # b's own queue is full now
    assert Router(r, r, s).queues(jobs[-1:]) == [queue]
    off = Settings(redis_url=redis_url, affinity=False).queues
    assert Router(r, r, off).queues(jobs) == [queue] * len(jobs)


def test_the_router_bounds_each_workers_backlog_and_moves_only_the_excess(redis_url):
    """Bounded-load rendezvous: no worker past (1 + AFFINITY_SLACK) x the mean, the excess to its key's
    next worker, a submission's jobs of one prefix together, and nothing moved under the floor."""
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    s = Settings(redis_url=redis_url).queues
    names = ["a@t", "b@t", "c@t"]
    owns = [worker_queue(s.queue, n) for n in names]
    for n, own in zip(names, owns, strict=True):
        heartbeat(r, n, own)
    jobs = [JobRequest(prompt=f"q {i}") for i in range(300)]
    first = [worker_queue(s.queue, rendezvous(route_key(j, 256), names)[0]) for j in jobs]
    natural = max(first.count(q) for q in owns)
    assert natural > 105  # hashing alone piles more than the bound on one worker
    queues = Router(r, r, s).queues(jobs)
    assert max(queues.count(q) for q in owns) <= 105 and set(queues) == set(owns)  # ceil(1.05 x 300 / 3)
    moved = sum(a != b for a, b in zip(queues, first, strict=True))
    assert 0 < moved <= 2 * (natural - 100)  # only about the excess moves
    pure = Settings(redis_url=redis_url, affinity_slack=100).queues  # a slack past any backlog: hashing alone
    assert Router(r, r, pure).queues(jobs) == first

    # a light load keeps affinity: a burst under the floor stays on its prefix's worker
    hot = prefix_for("b@t", names, "hot")
    burst = [JobRequest(prompt=hot + str(i)) for i in range(12)]
    assert Router(r, r, s).queues(burst) == [owns[1]] * 12
    # b backlogged well past the others: the prefix's next jobs go to one second worker, the same each time
    r.lpush(priority_queues(owns[1])[4], *range(40))
    r.lpush(priority_queues(owns[0])[4], *range(10))
    second = worker_queue(s.queue, rendezvous(route_key(burst[0], 256), names)[1])
    assert set(Router(r, r, s).queues(burst)) == {second}  # the group moves whole: one cache holds it
    # a group no worker has room for stays whole with its prefix's worker, as hashing alone sends it
    assert set(Router(r, r, s).queues(burst * 3)) == {owns[1]}


def test_fresh_ids_live_on_the_shards_of_the_worker_they_are_routed_to(redis_url):
    """Each worker's jobs on one or two token-plane shards, each shard with an equal share of workers."""
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    s = Settings(redis_url=redis_url).queues
    names = ["a@t", "b@t", "c@t"]
    for n in names:
        heartbeat(r, n, worker_queue(s.queue, n))
    router = Router(r, r, s)
    router.workers()
    own = [worker_queue(s.queue, n) for n in names]
    assert [router.shard_span(q, 3) for q in own] == [(0, 1), (1, 2), (2, 3)]
    assert router.shard_span(own[1], 2) == pytest.approx((2 / 3, 4 / 3))
    assert router.shard_span(s.queue, 3) is None and router.shard_span(own[0], 1) is None
    plane = TokenPlane([r, r, r], Settings(redis_url=redis_url).redis)
    assert {plane.index(plane.new_id((1, 2))) for _ in range(50)} == {1}
    straddling = [plane.index(plane.new_id((2 / 3, 4 / 3))) for _ in range(400)]
    assert set(straddling) == {0, 1} and 120 < straddling.count(0) < 280  # half of its jobs on each
    assert len({plane.index(plane.new_id()) for _ in range(100)}) == 3  # no span: any shard
    assert TokenPlane([r], Settings(redis_url=redis_url).redis).new_id((0.5, 1)) != plane.new_id()


def test_affine_routing_stealing_and_a_killed_workers_queue(service):
    names = ["aff1@test", "aff2@test"]
    small = service.worker(names[0], concurrency=1, **SLOW)  # takes one job at a time: backlogged soon
    big = service.worker(names[1], concurrency=16, **SLOW)
    small.wait_ready()
    big.wait_ready()
    client = service.client

    # same-prefix jobs run on the worker their prefix hashes to, each group on one worker
    to_big = [prefix_for(names[1], names, f"big{k}") for k in range(2)]
    to_small = prefix_for(names[0], names, "small")
    jobs = client.submit_many(
        [{"prompt": p + f" question {i}", "max_new_tokens": 4} for p in to_big for i in range(4)]
        + [{"prompt": to_small + " one question", "max_new_tokens": 4}]
    )
    for job in jobs:
        job.result(timeout=120)
    assert {ran_on(client, job.id) for job in jobs[:8]} == {names[1]}
    assert ran_on(client, jobs[8].id) == names[0]
    later = client.submit(to_big[0] + " a follow-up", max_new_tokens=4).result(timeout=120)
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its worker holds the prefix

    # a backlog on the small worker: the big one, with room and nothing else queued, steals from it
    jobs = client.submit_many([{"prompt": to_small + f" q{i}", "max_new_tokens": 32} for i in range(10)])
    for job in jobs:
        job.result(timeout=120)
    runs = [ran_on(client, job.id) for job in jobs]
    assert names[1] in runs and names[0] in runs, runs
    assert big.wait_stats(lambda s: s["stolen"] > 0)["stolen"] <= 10

    # a hot prefix spreads: past AFFINITY_BACKLOG its jobs go to the shared queue, taken by any worker
    spread = Client(service.url, settings=Settings(redis_url=service.url, affinity_backlog=2))
    hot = [{"prompt": to_small + f" hot {i}", "max_new_tokens": 8} for i in range(8)]
    assert spread.router.queues([JobRequest(**h) for h in hot]).count(worker_queue("weightq", names[0])) == 2
    for job in spread.submit_many(hot):
        job.result(timeout=120)

    # AFFINITY=0 on the client: every job on the shared queue, run as before
    off = Client(service.url, settings=Settings(redis_url=service.url, affinity=False))
    assert set(off.router.queues([JobRequest(**h) for h in hot])) == {"weightq"}
    for job in off.submit_many(hot):
        assert job.result(timeout=120)["finish_reason"] == "length"

    # the small worker dies holding a backlog in its own queue: every job still runs, on the other
    # (paused meanwhile, so that it cannot steal the backlog before the small one dies with it)
    os.killpg(big.proc.pid, signal.SIGSTOP)
    try:
        jobs = client.submit_many([{"prompt": to_small + f" last {i}", "max_new_tokens": 48} for i in range(8)])
        deadline = time.monotonic() + 30
        while not small.stats().get("active_jobs") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting_counts(client.redis, [worker_queue("weightq", names[0])])[0] > 0  # queued in its own queue
        small.kill()
    finally:
        os.killpg(big.proc.pid, signal.SIGCONT)
    states = [client.redis.hget(job_key(job.id), "state") for job in jobs]
    for job in jobs:
        assert job.result(timeout=120)["usage"]["completion_tokens"] == 48
    assert {ran_on(client, job.id) for job, state in zip(jobs, states, strict=True) if state != b"done"} == {names[1]}


def test_a_warm_shutdown_hands_its_own_queue_to_the_others_at_once(service):
    name = "leaving@test"
    leaving = service.worker(name, concurrency=1, **SLOW)
    leaving.wait_ready()
    client = service.client
    own = worker_queue("weightq", name)
    client.redis.hdel(WORKER_QUEUES, own)  # as a drain does that took the worker for dead (a long pause)
    deadline = time.monotonic() + 30
    while not client.redis.hexists(WORKER_QUEUES, own) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.redis.hexists(WORKER_QUEUES, own)  # listed again, for the others to steal from and drain
    deadline = time.monotonic() + 30
    while client.router.workers() != {name: own} and time.monotonic() < deadline:  # heartbeats a second old
        time.sleep(0.1)
    long = client.submit("a long one", max_new_tokens=300, ignore_eos=True)  # ~3 s of steps: the grace period
    leaving.wait_stats(lambda s: s.get("active_jobs") == 1)
    queued = client.submit_many([{"prompt": f"routed {i}", "max_new_tokens": 4} for i in range(4)])
    assert waiting_counts(client.broker, [own])[0] == 4  # routed to its own queue, waiting behind the long one
    assert leaving.stop() == 0  # the long job finishes within the grace period; the routed ones are not its
    assert waiting_counts(client.broker, [own, "weightq"]) == [0, 4]
    assert long.result(timeout=30)["usage"]["completion_tokens"] == 300
    other = service.worker("staying@test", **SLOW)
    other.wait_ready()
    for job in queued:
        assert job.result(timeout=120)["usage"]["completion_tokens"] == 4
        assert ran_on(client, job.id) == "staying@test"
