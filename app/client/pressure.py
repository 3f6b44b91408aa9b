"""Backpressure at submission: a job whose projected wait (backlog.py) is past MAX_QUEUE_WAIT_S, or
past its own deadline, is refused before anything is written, with when to come back. The client
checks it in submit_many; the gateway once per HTTP request (answering 429 with Retry-After)."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Sequence

import redis
from weightq.metrics import live_workers
from weightq.settings import Settings
from weightq.tasks.contract import HEARTBEATS
from weightq.tasks.limits import MAX_PRIORITY
from weightq.tasks.request import JobRequest
from weightq.transport import priority_queues

from .backlog import DeadlineUnreachable, Overloaded, Projection, WorkerOutlook, project


class Backpressure:
    """The projection of a moment ago (REFRESH_S), plus the jobs this process accepted since, which
    the broker's lists it read did not hold yet."""

    REFRESH_S = 0.25

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis, self.settings = client, settings
        self._lock = threading.Lock()
        self._projection: Projection | None = None
        self._taken = 0.0
        self._since: Counter[int] = Counter()  # class -> jobs accepted since the projection

    def projection(self) -> Projection:
        with self._lock:
            if self._projection is None or time.monotonic() - self._taken > self.REFRESH_S:
                self._projection, self._taken = self._project(), time.monotonic()
                self._since.clear()
            return self._projection

    def _project(self) -> Projection:
        queue = self.settings.queue
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(HEARTBEATS)
        for key in priority_queues(queue):
            pipe.llen(key)
        beats, *depths = pipe.execute()
        outlooks = [
            o
            for w in live_workers(beats).values()
            if (w.get("queue") or queue) == queue and (o := WorkerOutlook.of(w)) is not None
        ]
        queued = {MAX_PRIORITY - i: n for i, n in enumerate(depths) if n}
        return project(outlooks, queued)

    def admit(self, jobs: Sequence[JobRequest]) -> None:
        """Raises Overloaded (or DeadlineUnreachable) naming the first job that would wait too long;
        otherwise counts them in. Jobs of one call go in class order: each waits behind the others
        of its class or above."""
        bound = self.settings.max_queue_wait_s
        if bound <= 0 and all(job.deadline is None for job in jobs):
            return
        proj = self.projection()
        now = time.time()
        with self._lock:
            since = dict(self._since)
        for k, job in enumerate(sorted(jobs, key=lambda j: -j.priority)):
            ahead = k + sum(n for cls, n in since.items() if cls >= job.priority)
            wait = proj.wait(job.priority, ahead)
            if wait is None:  # no worker to project from: jobs wait in the queue for one, as always
                break
            if bound > 0 and wait > bound:
                raise Overloaded(
                    f"overloaded: a job of priority {job.priority} would wait {_s(wait)} for a worker, past "
                    f"MAX_QUEUE_WAIT_S={bound:g}; retry after {_retry(wait - bound)} s",
                    wait,
                    _retry(wait - bound),
                )
            if job.deadline is not None and now + wait > job.deadline:
                left = job.deadline - now
                raise DeadlineUnreachable(
                    f"deadline: the job would wait {_s(wait)} for a worker and its deadline is "
                    f"{'past' if left <= 0 else f'{left:.1f} s away'}",
                    wait,
                    _retry(wait - max(left, 0.0)),
                )
        with self._lock:
            self._since.update(job.priority for job in jobs)


def _s(wait: float) -> str:
    return "indefinitely" if math.isinf(wait) else f"{wait:.1f} s"


def _retry(seconds: float) -> int:
    return 3600 if math.isinf(seconds) else max(1, math.ceil(seconds))
