"""The queue's order is the scheduler's (FAIR_QUEUE, app/worker/intake.py): jobs staged in Redis by
class, then by each tenant's start tag in weight units; released by a worker only as it can start them;
background work leaves task slots to the urgent classes; a light tenant's job goes ahead of another's
flood through the real client, Redis and worker."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import redis
from weightq.client import Client
from weightq.engine import Urgency
from weightq.settings import Settings
from weightq.tasks.contract import STAGE, fair_key, job_key, staged_sets
from weightq.transport import priority_queues
from weightq.worker.inflight import LEFT_KEPT, InFlight
from weightq.worker.intake import LAST_URGENT, Intake, Release
from weightq.worker.loops import pipe_counts

from tests.servers import queued_messages

pytestmark = pytest.mark.service  # real Redis servers and worker processes

SIM = dict(runner="simulated", sim_step_cost="0.01,0,0", max_batch_weight=4096, prefix_cache=0)


def stage(r: redis.Redis, target: str, name: str, tenant: str, weight: int, priority: int = 4) -> None:
    r.eval(STAGE, 2, staged_sets(target)[priority], fair_key(target), name, tenant, weight, priority)


def taken(r: redis.Redis, queue: str, priority: int = 4) -> list[str]:
    out = []
    while (m := r.rpop(priority_queues(queue)[priority])) is not None:
        out.append(m.decode())
    return out


def test_staged_jobs_are_released_by_class_then_by_each_tenants_share_in_weight(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    release = Release(r)
    for i in range(6):  # a flood of heavy jobs first
        stage(r, "q", f"heavy{i}", "A", 100)
    stage(r, "q", "light0", "B", 10)
    stage(r, "q", "light1", "B", 10)
    stage(r, "q", "urgent", "C", 1000, priority=0)  # class 9: before every class-5 job whatever its weight
    out = release("q", ["q"], 3)
    assert (out.jobs, taken(r, "q", 0), taken(r, "q")) == (3, ["urgent"], ["heavy0", "light0"])
    # B's second job (tag 10) goes before A's second (tag 100): weights, not counts, are shared
    assert release("q", ["q"], 2).jobs == 2 and taken(r, "q") == ["light1", "heavy1"]
    # a tenant back from idle starts at the virtual clock: it saves no credit, and jumps the flood once
    stage(r, "q", "light2", "B", 10)
    assert release("q", ["q"], 1).jobs == 1 and taken(r, "q") == ["light2"]
    assert release("q", ["q"], 10).jobs == 4 and taken(r, "q") == [f"heavy{i}" for i in range(2, 6)]


def test_a_release_that_empties_a_queue_forgets_its_tenants_and_keeps_its_clocks(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    release = Release(r)
    for i in range(3):
        stage(r, "q", f"a{i}", "A", 100)
        stage(r, "q", f"b{i}", "B", 10, priority=0)
    assert release("q", ["q"], 4).jobs == 4  # two of A's left: every tenant's finish tag is kept
    assert {k.decode() for k in r.hkeys(fair_key("q"))} == {"t:A", "t:B", "v:0", "n"}
    assert release("q", ["q"], 10).jobs == 2
    state = {k.decode(): float(v) for k, v in r.hgetall(fair_key("q")).items()}
    assert state == {"v:0": 20.0, "v:4": 200.0, "n": 0.0}  # nothing staged: no tenant kept, the clocks stay
    stage(r, "q", "a3", "A", 100)  # at the clock of its class, as a newcomer (its finish tag was 300)
    assert r.zscore(staged_sets("q")[4], "A a3") == 200.0 and r.hget(fair_key("q"), "t:A") == b"300"


def test_release_counts_what_waits_and_goes_beyond_the_room_only_for_the_urgent_and_the_light(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    release = Release(r)
    for i in range(4):
        stage(r, "q", f"bg{i}", "A", 10, priority=7)  # class 2
        stage(r, "q", f"flood{i}", "A", 10)
    r.lpush(priority_queues("q")[4], "already waiting")
    assert release("q", ["q"], 1).jobs == 0  # the room is taken by what waits in the lists already
    r.delete(*priority_queues("q"))
    out = release("q", ["q"], 0, urgent=2)  # beyond the room: urgent classes only
    assert (out.jobs, taken(r, "q"), taken(r, "q", 7)) == (2, ["flood0", "flood1"], [])
    stage(r, "q", "newcomer", "B", 10)
    # beyond the room for tenants below their share: B's job, never the heavy A's, of no background class
    out = release("q", ["q"], 0, light=3, heavy=("A",))
    assert (out.jobs, taken(r, "q"), taken(r, "q", 7)) == (1, ["newcomer"], [])
    assert release("q", ["q"], 0, light=1).jobs == 1 and taken(r, "q") == ["flood2"]  # A not heavy any more
    assert LAST_URGENT == 4


def test_a_light_tenants_job_goes_beyond_the_room_past_a_heavy_tenants_job_at_the_head(redis_url):
    """Measured through the stack (bench.queueing): a flood's job at the head of the class (its tag one
    job ahead of the light tenant's) held the light job back until the engine had room, seconds."""
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    release = Release(r)
    stage(r, "q", "flood0", "A", 80)  # tag 0
    stage(r, "q", "light0", "B", 30)  # tag 0 + ... behind flood0 in the set's order
    for i in range(1, 5):
        stage(r, "q", f"flood{i}", "A", 80)
    r.zincrby(staged_sets("q")[4], 1, "B light0")  # strictly behind the head, whatever the tie-break
    r.lpush(priority_queues("q")[4], "let in before")  # released within the room earlier, not taken yet
    out = release("q", ["q"], 0, light=2, heavy=("A",), count_waiting=False)
    # B's only job (A's head stays staged), taken next: ahead of what the room let in before
    assert (out.jobs, taken(r, "q")) == (1, ["light0", "let in before"])
    assert release("q", ["q"], 1).jobs == 1 and taken(r, "q") == ["flood0"]
    for i in range(40):  # beyond the scan: a light job behind more than LIGHT_SCAN heavy ones waits for room
        stage(r, "q", f"more{i}", "A", 80)
    stage(r, "q", "late", "B", 30)
    r.zincrby(staged_sets("q")[4], 10**6, "B late")
    assert release("q", ["q"], 0, light=1, heavy=("A",)).jobs == 0


def test_background_work_leaves_slots_and_urgent_jobs_go_beyond_the_room(redis_url):
    intake = Intake(redis.Redis.from_url(redis_url), Settings(concurrency=64), "w@t")
    assert intake.reserve == 8
    bg = Urgency(background_running=56, heavy_tenants=("local",))
    # room for 30, nothing held: at most the pipe's worth at once
    assert intake.plan(30, 0, 0, Urgency(), False)[0] == 16
    # background fills 56 slots: no more of any class, though the engine has room
    assert intake.plan(30, 56, 0, bg, False)[0] == 0
    # no room, background running: a few urgent jobs beyond it, fewer while some already wait
    assert intake.plan(0, 56, 0, bg, False)[1] == 4
    assert intake.plan(0, 56, 1, Urgency(2, 56), False)[1] == 1
    # no background running: none go beyond the room for their class alone, only for a light tenant
    assert intake.plan(0, 40, 0, Urgency(heavy_tenants=("flood",)), False)[1:] == (0, 4)
    assert intake.plan(0, 40, 0, Urgency(3, 0, ("flood",), 3), False)[1:] == (0, 1)
    assert intake.plan(0, 40, 0, Urgency(), False)[1:] == (0, 0)  # no tenant at its share: none is light
    assert intake.plan(30, 0, 0, Urgency(), True) == (0, 0, 0)  # a job running alone admits no other
    # the reserved threads are for jobs that come to preempt, a few at a time, never for more of the
    # class that runs (the batcher runs at most 56: a flood of the default class must not fill them)
    assert intake.plan(30, 56, 0, bg, False)[:2] == (0, 4)
    assert intake.plan(30, 60, 1, Urgency(), False) == (0, 0, 0)
    # the prefetch: what background work may hold with room; beyond it, what the engine holds plus the
    # urgent messages waiting for the reserved threads (a held count over the cap must not swallow them)
    assert intake.prefetch(30, 10, 0, 0, False) == 40
    assert intake.prefetch(30, 50, 0, 2, False) == 58
    assert intake.prefetch(0, 58, 3, 0, False) == 61
    assert intake.prefetch(0, 63, 4, 0, False) == 64
    two = Intake(redis.Redis.from_url(redis_url), Settings(concurrency=2), "w@t")
    assert two.reserve == 1 and two.plan(10, 1, 0, Urgency(), False) == (0, 0, 0)
    assert two.plan(10, 1, 0, Urgency(background_running=1), False) == (0, 1, 0)  # an urgent job preempts


def test_jobs_that_left_the_engine_hold_no_room_while_their_acks_wait():
    """A wave of finishing jobs acks only after each task's end entry and Celery's trace: counted as
    taken and not started, they held the next jobs' release (a light tenant's among them) 0.5 s."""
    inflight = InFlight()
    kombu_qos = SimpleNamespace(_delivered={"a": 1, "b": 2, "c": 3}, _dirty=set())
    consumer = SimpleNamespace(task_consumer=SimpleNamespace(channel=SimpleNamespace(qos=kombu_qos)))
    with inflight.entered("job-a", "a"), inflight.entered("job-b", "b"):
        assert pipe_counts(inflight, consumer) == (1, 0)  # c: taken, not in the engine yet
    assert pipe_counts(inflight, consumer) == (1, 2)  # a and b left the engine, their acks not made
    kombu_qos._dirty.add("a")  # acked (kombu drops it from _delivered only at its next delivery)
    assert pipe_counts(inflight, consumer) == (1, 1)
    del kombu_qos._delivered["b"]
    assert pipe_counts(inflight, consumer) == (1, 0) and inflight.pending({"b"}) == (1, 0)  # forgotten once acked
    for n in range(LEFT_KEPT + 10):  # nobody asks (no consumer yet): the oldest are forgotten
        with inflight.entered(f"job-{n}", f"t{n}"):
            pass
    assert inflight.pending({"t0", f"t{LEFT_KEPT + 9}"}) == (1, 1)


def test_release_counts_only_the_urgent_messages_waiting_and_releases_no_more_than_they_leave(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    release = Release(r)
    r.lpush(priority_queues("q")[7], "background, sent by name")
    # background messages waiting do not count: the prefetch they would raise is the reserved threads'
    out = release("q", ["q"], 0, urgent=1)
    assert (out.jobs, out.waiting) == (0, 0)
    for i in range(3):
        stage(r, "q", f"web{i}", "A", 10)
    r.lpush(priority_queues("q")[4], "released before, not taken yet")
    out = release("q", ["q"], 0, urgent=2)  # one of the two is the message waiting already
    assert (out.jobs, out.waiting) == (1, 2)
    assert taken(r, "q") == ["web0", "released before, not taken yet"]
    # a light tenant's job goes ahead of what waits, whatever waits: its budget is not cut by it
    stage(r, "q", "light", "B", 10)
    r.lpush(priority_queues("q")[4], "a flood's, released before")
    out = release("q", ["q"], 0, light=1, heavy=("A",))
    assert out.jobs == 1 and taken(r, "q") == ["light", "a flood's, released before"]


def test_a_light_tenants_job_starts_ahead_of_another_tenants_flood(service):
    service.worker(**SIM).wait_ready()
    client: Client = service.client
    flood = client.submit_many(
        [{"prompt": f"flood {i}: " + "go on " * 10, "max_new_tokens": 48, "tenant": "flood"} for i in range(300)],
        background=False,
    )
    time.sleep(0.5)
    light = client.submit("a light request", max_new_tokens=8, tenant="light")
    assert light.result(timeout=120)["usage"]["completion_tokens"] == 8
    r = client.redis
    states = [r.hget(job_key(j.id), "state") for j in flood]
    started = sum(s != b"queued" for s in states)
    assert started < 200, f"{started} of the flood's 300 jobs started before the light tenant's one"
    for job in flood:
        job.result(timeout=300)
    assert not queued_messages(client.broker)


def test_an_urgent_job_reaches_the_engine_while_background_jobs_hold_every_slot_it_may(service):
    w = service.worker(concurrency=8, **SIM).wait_ready()
    client: Client = service.client
    background = client.submit_many(
        [{"prompt": f"batch {i}", "max_new_tokens": 400, "ignore_eos": True} for i in range(64)]
    )  # 64 jobs: background by default (BATCH_PRIORITY)
    assert json.loads(client.redis.hget(job_key(background[0].id), "request"))["priority"] == 2
    w.wait_stats(lambda s: s.get("active_jobs", 0) >= 7)  # the slots background work may hold: 8 - 1
    urgent = client.submit("now, please", max_new_tokens=4)
    result = urgent.result(timeout=60)
    assert result["usage"]["completion_tokens"] == 4
    left = sum(client.redis.hget(job_key(j.id), "state") != b"done" for j in background)
    assert left > 32, "the urgent job waited for the background work to finish"
    for job in background:
        job.cancel()


def test_a_light_tenants_job_takes_a_slot_when_task_threads_bind_not_kv(service):
    """The budget holds hundreds, eight task threads hold seven running: the batcher's cap on running
    requests binds, and a light tenant's job still starts at once by preempting the flood's newest."""
    w = service.worker(concurrency=8, **SIM).wait_ready()
    client: Client = service.client
    flood = client.submit_many(
        [{"prompt": f"flood {i}", "max_new_tokens": 400, "ignore_eos": True, "tenant": "flood"} for i in range(40)],
        background=False,
    )
    w.wait_stats(lambda s: s.get("active_jobs", 0) >= 7)
    light = client.submit("a light request", max_new_tokens=4, tenant="light")
    assert light.result(timeout=60)["usage"]["completion_tokens"] == 4
    done = sum(client.redis.hget(job_key(j.id), "state") == b"done" for j in flood)
    assert done == 0, f"the light tenant's job waited for {done} of the flood's jobs to finish"
    for job in flood:
        job.cancel()
