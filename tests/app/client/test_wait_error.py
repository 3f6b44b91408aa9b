"""The margin backpressure keeps below MAX_QUEUE_WAIT_S, learned from how late first tokens came
against the projected waits of the jobs this process admitted."""

from __future__ import annotations

import pytest
from weightq.client import wait_error
from weightq.client.backlog import Overloaded, Projection
from weightq.client.pressure import Backpressure
from weightq.client.wait_error import MIN_SAMPLES, WaitError
from weightq.settings import QueueSettings
from weightq.tasks.request import JobRequest


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(wait_error, "time", c)
    return c


def teach(err: WaitError, clock: Clock, lateness: list[float], projected: float = 5.0) -> None:
    """Jobs admitted with `projected` s to wait whose first entries came `lateness` s after it."""
    for late in lateness:
        job, job_id = JobRequest(prompt="x"), f"j{clock.now}"
        err.admitted(job, projected)
        err.submitted([job_id], [job])
        clock.now += projected + late
        err.first_entry(job_id)
        clock.now -= projected + late - 0.01  # the next job admitted just after: all within the horizon


def test_the_prior_or_the_worst_seen_until_enough_samples_then_the_p99_of_the_lateness(clock):
    err = WaitError()
    teach(err, clock, [0.5] * (MIN_SAMPLES - 2))
    assert err.margin(10.0) == pytest.approx(1.0)  # 0.1 of the bound: too few samples
    teach(err, clock, [3.0])
    assert err.margin(10.0) == pytest.approx(3.0)  # ... unless one came later than that
    teach(err, clock, [0.25] * 100)
    teach(err, clock, [3.0] * 2)
    assert err.margin(10.0) == pytest.approx(3.0)  # 3 of 152 came 3 s late: the p99 is 3 s
    teach(err, clock, [0.25] * 500)
    assert err.margin(10.0) == pytest.approx(0.25)  # the late ones left the latest 512


def test_early_first_tokens_never_lend_more_than_the_bound(clock):
    err = WaitError()
    teach(err, clock, [-2.0] * MIN_SAMPLES)  # the projection erred long (requests ending early)
    assert err.margin(10.0) == 0.0


def test_samples_age_out_and_only_jobs_admitted_here_count_once(clock):
    err = WaitError()
    teach(err, clock, [2.0] * MIN_SAMPLES)
    assert err.margin(10.0) == pytest.approx(2.0)
    clock.now += wait_error.HORIZON_S + 10
    assert err.margin(10.0) == pytest.approx(1.0) and err.samples() == 0  # a quiet while: the prior again
    err.first_entry("never-admitted-here")
    job = JobRequest(prompt="x")
    err.admitted(job, 3.0)
    err.submitted(["a"], [job])
    err.first_entry("a")
    err.first_entry("a")  # the same job's later entries count once
    assert err.samples() == 1
    # projected to start at once, it came 1.5 s late (slots taken since the heartbeat): learned too
    teach(err, clock, [1.5], projected=0.0)
    assert err.samples() == 2 and err.margin(10.0) == pytest.approx(1.5)


def test_backpressure_admits_up_to_the_bound_less_the_learned_margin(clock):
    pressure = Backpressure(None, None, QueueSettings(max_queue_wait_s=10.0))  # type: ignore[arg-type]
    # a slot freeing every 0.5 s from now on, 19 jobs queued: a new one waits 9.5 s
    pressure._projection = Projection(tuple(0.5 * k for k in range(200)), 2.0, {0: 19}, workers=1)
    pressure._taken = float("inf")  # never refreshed: the margin is set by hand below
    with pytest.raises(Overloaded):
        pressure.admit([JobRequest(prompt="x", priority=0)])  # the prior margin: 1 s
    pressure._promised.clear()  # the refused job's promised turn would keep the next one out
    teach(pressure.error, clock, [0.2] * MIN_SAMPLES)
    pressure._margin = pressure.error.margin(10.0)
    job = JobRequest(prompt="x", priority=0)
    pressure.admit([job])  # the projection has been 0.2 s short at worst: 9.5 s is let in
    pressure.submitted(["late"], [job])
    assert "late" in pressure.error._open
