"""The projected wait of a new job (app/client/backlog.py) against hand-computed schedules."""

from __future__ import annotations

import math

from weightq.client.backlog import WorkerOutlook, project
from weightq.tasks import heartbeat
from weightq.tasks.heartbeat import Heartbeat


def worker(free_at=(), slots=1, job_s=1.0, waiting=None) -> WorkerOutlook:
    return WorkerOutlook(tuple(free_at), slots, job_s, waiting or {})


def test_free_slots_start_jobs_at_once():
    p = project([worker(slots=4)], {})
    assert p.wait(5) == 0.0
    assert p.wait(5, extra=3) == 0.0  # the fourth job still finds a slot
    assert p.wait(5, extra=4) == 1.0  # the fifth waits for the first to finish


def test_running_requests_free_their_slots_in_order():
    p = project([worker(free_at=(3.0, 1.0), slots=2, job_s=10.0)], {5: 2})
    # queued jobs take the slots freed at 1 s and 3 s; a new job waits for the first of them: 11 s
    assert p.starts[:3] == (1.0, 3.0, 11.0)
    assert p.wait(5) == 11.0
    assert p.drain_s() == 11.0


def test_a_more_urgent_class_waits_only_behind_its_own_and_higher():
    p = project([worker(free_at=(2.0,), slots=1, job_s=2.0)], {9: 1, 5: 3, 0: 10})
    assert p.ahead == {9: 1, 8: 1, 7: 1, 6: 1, 5: 4, 4: 4, 3: 4, 2: 4, 1: 4, 0: 14}
    assert p.wait(9) == 4.0  # behind one class-9 job: slot at 2 s, next at 4 s
    assert p.wait(5) == 10.0  # behind 4 jobs
    assert p.wait(0) == 30.0  # behind 14 jobs


def test_engine_waiting_requests_count_as_queued():
    p = project([worker(free_at=(1.0,), slots=1, job_s=1.0, waiting={5: 2})], {})
    assert p.ahead[5] == 2
    assert p.wait(5) == 3.0


def test_two_workers_share_the_queue():
    p = project([worker(slots=1, job_s=2.0), worker(slots=1, job_s=4.0)], {5: 3})
    # starts: 0 (w0), 0 (w1), 2 (w0), 4 (w0 or w1): the new job is the fourth
    assert p.wait(5) == 4.0


def test_a_long_queue_is_extrapolated_at_the_steady_rate():
    p = project([worker(slots=10, job_s=5.0)], {5: 1_000_000})
    assert math.isclose(p.wait(5), 1_000_000 / 2.0, rel_tol=1e-3)  # 10 slots / 5 s = 2 jobs per second


def test_no_worker_means_no_projection():
    assert project([], {5: 10}).wait(5) is None


def test_an_outlook_from_a_heartbeat():
    stats = {
        "recent_step_s": 0.1,
        "outlook": {"finish_steps": [10, 30], "running": 4, "slots": 6, "waiting": {"7": 2}, "mean_output": 20},
    }
    beat = Heartbeat.decode(b"w1", heartbeat.encode(stats))
    assert beat is not None and beat.name == "w1" and beat.fresh()
    w = WorkerOutlook.of(beat)
    assert w is not None
    assert w.slots == 6 and w.job_s == 2.0 and w.waiting == {7: 2}
    assert sorted(w.free_at) == [1.0, 1.0, 3.0, 3.0]  # two points stand for four requests
    assert WorkerOutlook.of(Heartbeat.decode("w2", '{"running": 1}')) is None  # no outlook published


def test_heartbeats_decode_once_and_the_stale_or_broken_are_left_out():
    now = 1000.0
    raw = {
        b"fresh": heartbeat.encode({"queue": "q", "own_queue": "q.w.fresh", "adapters": ["a"], "steps": 4,
                                    "step_s": 0.2, "max_total_tokens": 2048, "structured": False}, now - 1),
        b"old": heartbeat.encode({"queue": "q"}, now - heartbeat.STALE_S - 1),
        b"junk": b"not json",
    }  # fmt: skip
    live = heartbeat.live(raw, now)
    assert list(live) == ["fresh"]
    w = live["fresh"]
    assert (w.queue, w.own_queue, w.adapters) == ("q", "q.w.fresh", ("a",))
    assert w.max_total_tokens == 2048 and w.structured is False
    assert w.step_s == 0.05 and w.serves("q") and not w.serves("other") and w.stats["steps"] == 4


def test_refusals_are_promised_slots_in_turn():
    """Under a flood, each refused job is told a later time, one job's share of the rate apart, and
    the jobs it was promised room for keep fresh arrivals out of it."""
    import time

    import pytest
    from weightq.client.backlog import Overloaded, Projection
    from weightq.client.pressure import Backpressure
    from weightq.settings import QueueSettings
    from weightq.tasks.request import JobRequest

    pressure = Backpressure(None, None, QueueSettings(max_queue_wait_s=10.0))  # type: ignore[arg-type]
    # one slot freeing every 0.5 s from now on, 40 jobs queued: a new one waits 20 s
    pressure._projection = Projection(tuple(0.5 * k for k in range(200)), 2.0, {5: 40, 9: 0}, workers=1)
    pressure._taken = float("inf")  # never refreshed
    job = JobRequest(prompt="x")
    retry_afters = []
    for _ in range(6):
        with pytest.raises(Overloaded) as e:
            pressure.admit([job])
        retry_afters.append(e.value.retry_after_s)
    assert retry_afters[0] == 12  # 20 s to a slot (the 41st start), less 0.8 of the 10 s bound (PROMISED)
    assert retry_afters == sorted(retry_afters) and retry_afters[-1] >= retry_afters[0] + 2  # in turn
    pressure.admit([JobRequest(prompt="x", priority=9)])  # an urgent job is behind none of them
    assert len(pressure._promised) == 6 and all(at > time.time() for at, _ in pressure._promised)


def test_the_autoscalers_backlog_scales_from_zero_and_holds_while_busy():
    # jobs wait and no worker runs: the drain is infinite and the backlog above 0, so KEDA activates
    idle = project([], {5: 3})
    assert idle.drain_s() == math.inf and idle.backlog_s > 0
    assert project([], {}).backlog_s == 0.0 and project([], {}).drain_s() == 0.0
    # busy workers and nothing queued: no drain time, but the work in hand keeps the replicas
    busy = project([worker(free_at=(4.0, 2.0), slots=2, job_s=6.0)], {})
    assert busy.drain_s() == 0.0 and busy.backlog_s == 3.0  # (4 + 2) s of requests over 2 slots


def test_the_backlog_does_not_depend_on_how_many_workers_share_it():
    """KEDA's AverageValue divides the metric by the target: a metric that more workers shrink (the
    drain time) would scale in as soon as it scaled out. The backlog is the same work, however split."""
    queued = {5: 40}
    one = project([worker(slots=4, job_s=8.0)], queued)
    four = project([worker(slots=4, job_s=8.0) for _ in range(4)], queued)
    assert one.backlog_s == four.backlog_s == 40 * 8.0 / 4
    assert four.drain_s() < one.drain_s()
