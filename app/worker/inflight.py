"""The jobs inside this worker's engine, shared by the task threads and the worker's loops."""

from __future__ import annotations

import threading
import time


class InFlight:
    """Job id -> start time and delivery tag, under one lock: task threads add and remove jobs; the
    loops read them (revokes to cancel, tags to renew, the count for prefetch and stats)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[str, float] = {}
        self._tags: dict[str, str] = {}  # job id -> its message's delivery tag (for lease renewal)

    def add(self, job_id: str, delivery_tag: str | None) -> None:
        with self._lock:
            self._started[job_id] = time.monotonic()
            if delivery_tag:
                self._tags[job_id] = delivery_tag

    def remove(self, job_id: str) -> None:
        with self._lock:
            self._started.pop(job_id, None)
            self._tags.pop(job_id, None)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._started)

    def tags(self) -> set[str]:
        with self._lock:
            return set(self._tags.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._started)
