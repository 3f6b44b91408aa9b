"""Backpressure at submission: a job whose projected wait (backlog.py) is past MAX_QUEUE_WAIT_S, or
past its own deadline, is refused before anything is written, with when to come back. The client
checks it in submit_many; the gateway once per HTTP request (answering 429 with Retry-After).

A Retry-After is kept as a promise. Under a flood that goes on, a refused caller that comes back
when told would find the queue full again of the jobs that arrived meanwhile, and be refused again
and again: its real wait many times what it was told. So each refusal reserves the slot it was
promised: a job submitted now waits behind the refused jobs due back within the bound (they will
queue before it starts), and a refusal's Retry-After counts every promise still out ahead of it.
Promises are this process's (a gateway's): several gateways each keep their own.

A fresh job is let in while its projected wait is within the bound less a margin learned from how
late the first tokens of the jobs admitted here came against their projections (wait_error.py)."""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import Counter
from collections.abc import Sequence

import redis
from weightq.metrics import read_live_workers
from weightq.settings import QueueSettings
from weightq.tasks.limits import MAX_PRIORITY
from weightq.tasks.request import JobRequest
from weightq.transport import waiting_by_priority

from .backlog import DeadlineUnreachable, Overloaded, Projection, WorkerOutlook, project
from .wait_error import WaitError

# A refused job is told to come back when its projected wait will be this share of the bound (and a
# new job is refused if it would push a promised one past the bound less the margin): the slack takes the
# projection's drift over the wait (a worker slower than its last second), so that most come back
# once, not twice.
PROMISED = 0.8
SLACK = 0.1  # ... and never closer than this share to where the projection's error leaves it at the bound
NO_END_RETRY_S = 3600  # Retry-After for a wait with no end in sight (jobs wait and no worker serves them)


class Backpressure:
    """The projection of a moment ago (REFRESH_S), plus the jobs this process accepted since, which
    the broker's lists it read did not hold yet."""

    REFRESH_S = 0.25

    def __init__(self, streams: redis.Redis, broker: redis.Redis, conf: QueueSettings) -> None:
        self.redis, self.broker, self.conf = streams, broker, conf  # heartbeats; the queue
        self._lock = threading.Lock()
        self._projection: Projection | None = None
        self._taken = 0.0
        self._since: Counter[int] = Counter()  # class -> jobs accepted since the projection
        self._promised: list[tuple[float, int]] = []  # (unix s a refused job was told to return, class)
        # a fresh job is let in while its projected wait is within the bound less this margin
        self.error = WaitError()
        self._margin = self.margin()  # the prior, until samples come

    def submitted(self, ids: Sequence[str], jobs: Sequence[JobRequest]) -> None:
        """The ids of jobs admitted here: their first entries (first_entry) teach the margin."""
        self.error.submitted(ids, jobs)

    def first_entry(self, job_id: str) -> None:
        self.error.first_entry(job_id)

    def margin(self) -> float:
        """What is taken off the bound now (`WaitError.margin`: learned from late first entries)."""
        return self.error.margin(self.conf.max_queue_wait_s)

    def projection(self) -> Projection:
        with self._lock:
            if self._projection is None or time.monotonic() - self._taken > self.REFRESH_S:
                self._projection, self._taken = self._project(), time.monotonic()
                self._since.clear()
                self._margin = self.margin()
            return self._projection

    def _project(self) -> Projection:
        queue = self.conf.queue
        now = time.time()
        beats = read_live_workers(self.redis, now).values()
        workers = [w for w in beats if w.serves(queue)]
        # the shared queue's lists and each worker's own (prefix affinity): a job waits in one of them
        queues = [queue, *sorted({w.own_queue for w in workers if w.own_queue})]
        queued: Counter[int] = Counter()
        for by_priority in waiting_by_priority(self.broker, queues):  # lists and staged sets
            for i, n in enumerate(by_priority):
                queued[MAX_PRIORITY - i] += n
        outlooks = [o for w in workers if (o := WorkerOutlook.of(w, now)) is not None]
        return project(outlooks, queued)

    def admit(self, jobs: Sequence[JobRequest]) -> None:
        """Raises Overloaded (or DeadlineUnreachable) naming the first job that would wait too long;
        otherwise counts them in. Jobs of one call go in class order: each waits behind the others
        of its class or above."""
        bound = self.conf.max_queue_wait_s
        if bound <= 0 and all(job.deadline is None for job in jobs):
            return
        proj = self.projection()
        now = time.time()
        with self._lock:
            elapsed = max(0.0, min(self.REFRESH_S, time.monotonic() - self._taken))  # since the projection
            since = dict(self._since)
            self._promised = self._promised[bisect.bisect_right(self._promised, (now, MAX_PRIORITY + 1)) :]
            promised = list(self._promised)
            margin = self._margin
        waits = []
        for k, job in enumerate(sorted(jobs, key=lambda j: -j.priority)):
            ahead = proj.ahead.get(job.priority, 0) + k + sum(n for cls, n in since.items() if cls >= job.priority)
            if not proj.workers:  # no worker to project from: jobs wait in the queue for one, as always
                break
            wait = max(0.0, proj.start(ahead) - elapsed)
            if bound > 0:
                due = [at - now + elapsed for at, cls in promised if cls >= job.priority]  # from the projection
                # what a projected start may be for the first token to come within the bound
                limit = bound - margin
                promise = min(bound * PROMISED, (1 - SLACK) * limit)
                if wait > limit or not kept(proj, ahead + 1, due, limit):
                    # its turn: behind every refused job told to come back before it
                    last = max(due, default=0.0)
                    retry = _retry(max(proj.start(ahead + len(due)) - promise, last) - elapsed)
                    with self._lock:
                        bisect.insort(self._promised, (now + retry, job.priority))
                    raise Overloaded(
                        f"overloaded: a job of priority {job.priority} would wait {_s(wait)} for a worker (or take "
                        f"the turn of a job refused before it), past MAX_QUEUE_WAIT_S={bound:g}; retry after "
                        f"{retry} s",
                        wait,
                        retry,
                    )
            if job.deadline is not None and now + wait > job.deadline:
                left = job.deadline - now
                raise DeadlineUnreachable(
                    f"deadline: the job would wait {_s(wait)} for a worker and its deadline is "
                    f"{'past' if left <= 0 else f'{left:.1f} s away'}",
                    wait,
                    _retry(wait - max(left, 0.0)),
                )
            waits.append((job, wait))
        with self._lock:
            self._since.update(job.priority for job in jobs)
        for job, wait in waits:
            self.error.admitted(job, wait)


def kept(proj: Projection, first: int, due: list[float], limit: float) -> bool:
    """Whether each refused job, coming back as told (`due`: seconds from the projection,
    ascending) behind `first` jobs and the ones told before it, still starts within the limit."""
    return all(proj.start(first + i) - at <= limit for i, at in enumerate(due))


def _s(wait: float) -> str:
    return "indefinitely" if math.isinf(wait) else f"{wait:.1f} s"


def _retry(seconds: float) -> int:
    return NO_END_RETRY_S if math.isinf(seconds) else max(1, math.ceil(seconds))
