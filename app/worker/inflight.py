"""The jobs inside this worker's engine, shared by the task threads and the worker's loops."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

LEFT_KEPT = 65_536  # tags of jobs that left the engine remembered until acked, at most


class Closed(RuntimeError):
    """The worker is shutting down: a job still waiting to enter the engine goes back to the queue."""


class InFlight:
    """Job id -> start time and delivery tag, under one lock: task threads add and remove jobs; the
    loops read them (revokes to cancel, tags to renew, the count for prefetch and stats).

    A job suspected of crashing workers runs alone (`entered(..., alone=True)`): it waits until the
    engine is empty, and no other job enters while it waits or runs, so that if the worker dies
    again the crash is charged to it alone (app/worker/reaper.py)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._started: dict[str, float] = {}
        self._tags: dict[str, str] = {}  # job id -> its message's delivery tag (for lease renewal)
        # Tags of jobs that left the engine, their messages not yet acked: a task acks only after its
        # end entry is written and Celery's trace has run, which many jobs finishing at once queue up.
        # Kept apart from the jobs taken but not started, so they do not hold the release of the next jobs.
        self._left: dict[str, None] = {}  # in the order they left; the oldest go past LEFT_KEPT
        self._alone: str | None = None  # the job running alone, if one is
        self._waiting_alone = 0
        self._closed = False

    @contextlib.contextmanager
    def entered(self, job_id: str, delivery_tag: str | None, alone: bool = False) -> Iterator[None]:
        """The job is inside the engine for the block; raises Closed if the worker closes first."""
        with self._lock:
            if alone:
                self._waiting_alone += 1
                try:
                    self._lock.wait_for(lambda: self._closed or (not self._started and self._alone is None))
                finally:
                    self._waiting_alone -= 1
            else:
                self._lock.wait_for(lambda: self._closed or (self._alone is None and not self._waiting_alone))
            if self._closed:
                raise Closed(f"job {job_id}: the worker is shutting down")
            if alone:
                self._alone = job_id
            self._started[job_id] = time.monotonic()
            if delivery_tag:
                self._tags[job_id] = delivery_tag
        try:
            yield
        finally:
            with self._lock:
                self._started.pop(job_id, None)
                tag = self._tags.pop(job_id, None)
                if tag is not None:
                    self._left[tag] = None
                    if len(self._left) > LEFT_KEPT:  # nobody asked for a while (no consumer): forget the oldest
                        del self._left[next(iter(self._left))]
                if self._alone == job_id:
                    self._alone = None
                self._lock.notify_all()

    def close(self) -> None:
        """Jobs waiting to enter give up (Closed); those inside run on."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    @property
    def exclusive(self) -> bool:
        """A job runs alone or waits to: take no more messages meanwhile."""
        return self._alone is not None or self._waiting_alone > 0

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._started)

    def tags(self) -> set[str]:
        with self._lock:
            return set(self._tags.values())

    def pending(self, outstanding: set[str]) -> tuple[int, int]:
        """Of the consumer's outstanding (taken, unacked) delivery tags: (those whose job has not
        entered the engine yet, those whose job left it and waits for its ack); forgets the acked."""
        with self._lock:
            self._left = {tag: None for tag in self._left if tag in outstanding}
            return len(outstanding - set(self._tags.values()) - self._left.keys()), len(self._left)

    def __len__(self) -> int:
        with self._lock:
            return len(self._started)
