"""How long a new job would wait for a worker, projected from what the workers' batchers publish with
their heartbeats (batcher/outlook.py) and the broker's queue: the base of backpressure (a fast 429
with an honest Retry-After instead of a queue without bound), of deadlines refused at submit, and
of the drain-time gauge autoscalers scale on.

A job starts when a worker has a slot for it. Each worker has `slots` (running requests plus room for
more of the typical size); its running requests free theirs after their remaining steps, and every
queued job then holds a slot for its worker's typical length (recent finished requests' mean
output), a step lasting the worker's recent step time. Jobs are served by class, most urgent first,
then in arrival order, so a new job of class c waits behind everything queued in classes >= c
(waiting in the engines or in the broker). `project` replays this: a heap of slot-free times, one
pop per job ahead. Past MAX_REPLAY jobs it extrapolates at the steady rate, slots over job time.

It is a projection, not a promise: requests that end early (EOS) free slots sooner, so it errs
towards longer waits; and it sees the heartbeats of a second ago.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from weightq.tasks.heartbeat import Heartbeat
from weightq.tasks.limits import MAX_PRIORITY

MAX_REPLAY = 20_000  # jobs replayed one by one; the rest extrapolated
BEYOND = 2048  # ... past those queued now: the jobs submitted until the next projection
DEFAULT_STEP_S = 0.05  # a worker that has not stepped yet: a guess, replaced at its first heartbeat
DEFAULT_OUTPUT = 64  # ... and no finished request yet: the job door's default max_new_tokens
MAX_AGE_S = 5.0  # a heartbeat is moved on by its age, up to this
DEFAULT_SLOTS = 16  # ... and no worker at all (the autoscaler's backlog from zero): a guess of its slots


@dataclass(frozen=True)
class WorkerOutlook:
    """One worker, in seconds: when its running requests free their slots, how many slots it has,
    how long a typical job holds one."""

    free_at: tuple[float, ...]
    slots: int
    job_s: float
    waiting: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, beat: Heartbeat, now: float | None = None) -> WorkerOutlook | None:
        """From a heartbeat (None without an outlook), moved on to `now`: its requests are that much
        nearer their end (the heartbeat is up to a second old, and the jobs the worker took from the
        queue meanwhile are in neither: `project` lets the slots freed since go to them)."""
        o = beat.outlook
        if o is None:
            return None
        step_s = beat.step_s or DEFAULT_STEP_S
        points, running = o.finish_steps, o.running
        # each published point stands for running / len(points) requests (quantiles of a large batch)
        age = min(MAX_AGE_S, max(0.0, now - beat.ts)) if now is not None and beat.ts else 0.0
        free_at = [points[(i * len(points)) // running] * step_s - age for i in range(running)] if points else []
        mean = o.mean_output or DEFAULT_OUTPUT
        slots = max(o.slots, running, 1)
        return cls(tuple(free_at), slots, max(1.0, mean) * step_s, dict(o.waiting))


@dataclass(frozen=True)
class Projection:
    """Start times of the k-th job to come (k = 0, 1, ...), and how many are ahead of each class."""

    starts: tuple[float, ...]
    rate: float  # jobs started per second once the replay ends
    ahead: Mapping[int, int]  # class -> jobs (in engines and the broker) a new job of it waits behind
    workers: int
    # the work in hand (running and queued) in seconds of one worker: what an autoscaler divides by its
    # target (KEDA's AverageValue). More workers do not shrink it (they shrink the drain time), so
    # replicas settle where it says, and with jobs queued and no worker it is above 0 (scale from zero).
    backlog_s: float = 0.0

    def wait(self, priority: int, extra: int = 0) -> float | None:
        """Seconds until a new job of this class (behind `extra` more just submitted) could start;
        None with no worker to project from."""
        if not self.workers:
            return None
        return self.start(self.ahead.get(priority, 0) + extra)

    def start(self, k: int) -> float:
        if k < len(self.starts):
            return self.starts[k]
        last = self.starts[-1] if self.starts else 0.0
        return last + (k - len(self.starts) + 1) / self.rate if self.rate > 0 else math.inf

    def drain_s(self) -> float:
        """Seconds until every job now queued has a worker (0 when none waits; infinite while jobs
        wait with no worker)."""
        if not self.ahead.get(0, 0):
            return 0.0  # none queued
        if not self.workers:
            return math.inf
        return self.start(self.ahead[0])  # when a worker is free for a job queued after them


def project(workers: list[WorkerOutlook], queued: Mapping[int, int]) -> Projection:
    """`queued`: broker messages waiting per class; the engines' waiting requests are added to it."""
    by_class = dict(queued)
    for w in workers:
        for cls, n in w.waiting.items():
            by_class[cls] = by_class.get(cls, 0) + n
    ahead, total = {}, 0
    for cls in range(MAX_PRIORITY, -1, -1):
        total += by_class.get(cls, 0)
        ahead[cls] = total
    heap: list[tuple[float, int]] = []
    for i, w in enumerate(workers):
        busy = sorted(w.free_at)
        heap.extend((0.0, i) for _ in range(w.slots - len(busy)))
        heap.extend((t, i) for t in busy)
    heapq.heapify(heap)
    while total and heap and heap[0][0] < 0:  # freed since the heartbeats: taken by jobs the queue no longer holds
        t, i = heapq.heappop(heap)
        heapq.heappush(heap, (t + workers[i].job_s, i))
    starts: list[float] = []
    for _ in range(min(total + 1 + BEYOND, MAX_REPLAY)):
        if not heap:
            break
        t, i = heapq.heappop(heap)
        starts.append(max(0.0, t))
        heapq.heappush(heap, (t + workers[i].job_s, i))
    rate = sum(w.slots / w.job_s for w in workers)
    return Projection(tuple(starts), rate, ahead, len(workers), backlog_seconds(workers, total))


def backlog_seconds(workers: list[WorkerOutlook], queued: int) -> float:
    """Seconds of one worker's time the running and `queued` jobs take: each running request's
    remaining time and each queued job's typical time, over the slots it shares a worker with. With no
    worker to learn from, a queued job counts a default job over DEFAULT_SLOTS."""
    running = sum(sum(max(0.0, t) for t in w.free_at) / w.slots for w in workers)
    if workers:
        per_job = sum(w.job_s / w.slots for w in workers) / len(workers)
    else:
        per_job = DEFAULT_OUTPUT * DEFAULT_STEP_S / DEFAULT_SLOTS
    return running + queued * per_job


class Overloaded(RuntimeError):
    """The job would wait longer than MAX_QUEUE_WAIT_S for a worker: refused before anything was
    written. `retry_after_s`: when its projected wait would be back within the bound if nothing
    else arrived meanwhile (the gateway's Retry-After)."""

    field = ""

    def __init__(self, message: str, wait_s: float, retry_after_s: int) -> None:
        super().__init__(message)
        self.wait_s, self.retry_after_s = wait_s, retry_after_s


class DeadlineUnreachable(Overloaded):
    """The job could not start before its `deadline`: refused rather than run late."""

    field = "deadline"
