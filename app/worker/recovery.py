"""Re-sending jobs whose message was lost: kombu's Redis transport can lose a message that a Redis crash
catches between delivery and bookkeeping. Jobs still queued long after later ones started, and found
neither in the queue nor among the unacked messages (twice, a sweep apart), are sent again."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis

from app.settings import Settings
from tasks.contract import QUEUED, RECOVER_LOCK, STARTED_HW, TASK_NAME, JobState, args_repr, job_key

log = logging.getLogger(__name__)


class LostJobSweeper:
    def __init__(
        self, settings: Settings, client: redis.Redis, hostname: str, celery_app: Callable[[], object]
    ) -> None:
        self.settings, self.redis, self.hostname = settings, client, hostname
        self.celery_app = celery_app  # the worker's Celery app, once it exists
        self._suspects: set[str] = set()  # lost-looking jobs seen by the last sweep

    def sweep(self) -> list[str]:
        """Re-send jobs whose message is gone; returns their ids. Cheap when nothing is lost: one
        ZRANGEBYSCORE. A job counts as lost only if it is still 'queued' long after submission, a
        later job has already started or the queue is empty (FIFO: it should have been taken), and
        it is in neither the queue nor the unacked messages in two sweeps in a row."""
        r, s = self.redis, self.settings
        if not r.set(RECOVER_LOCK, self.hostname, nx=True, ex=max(1, int(s.recover_interval_s))):
            return []
        cutoff = time.time() - s.lost_job_grace_s
        if r.llen(s.queue):  # FIFO: only jobs older than one that has started should have left the queue
            cutoff = min(cutoff, float(r.get(STARTED_HW) or 0))
        old = [x.decode() for x in r.zrangebyscore(QUEUED, "-inf", cutoff, start=0, num=500)]
        if not old:
            self._suspects.clear()
            return []
        pipe = r.pipeline(transaction=False)
        for job_id in old:
            pipe.hget(job_key(job_id), "state")
        queued = []
        for job_id, state in zip(old, pipe.execute(), strict=True):
            if state == JobState.QUEUED.encode():
                queued.append(job_id)
            else:
                r.zrem(QUEUED, job_id)  # started (or expired) without BEGIN seeing it here
        if not queued:
            return []
        if r.llen(s.queue) > s.lost_job_scan_limit:
            log.info("%d jobs look lost, but the queue is too long to scan now", len(queued))
            return []
        present = self._present(queued)
        missing = {j for j in queued if j not in present}
        lost, self._suspects = sorted(missing & self._suspects), missing - self._suspects
        app = self.celery_app()
        for job_id in lost:
            raw = r.hget(job_key(job_id), "request")
            if raw is None or app is None:
                continue
            log.warning("job %s lost its message (a Redis crash?): sending it again", job_id)
            request = json.loads(raw)
            app.send_task(  # type: ignore[attr-defined]
                TASK_NAME, args=[request], task_id=job_id, queue=s.queue, argsrepr=args_repr(request), kwargsrepr="{}"
            )
        return lost

    def _present(self, job_ids: list[str]) -> set[str]:
        """Which of these jobs have a message in the queue or among the unacked ones."""
        needles = {j: f'"{j}"'.encode() for j in job_ids}
        found: set[str] = set()

        def scan(blobs) -> None:
            for blob in blobs:
                for j, needle in needles.items():
                    if needle in blob:
                        found.add(j)

        scan(self.redis.hvals("unacked"))
        for start in range(0, self.redis.llen(self.settings.queue), 1000):
            scan(self.redis.lrange(self.settings.queue, start, start + 999))
        return found
