"""Re-sending jobs whose message was lost: kombu's Redis transport can lose a message that a Redis crash
(or a worker's death) catches between delivery and bookkeeping. Jobs still queued long after later
ones of their class (or a lower one) started, and jobs a dead worker's reaper sent back that no run
has begun since (`weightq:resuming`), found neither in the queue's lists (one per priority, the
workers' own queues included) nor among the unacked messages (twice, a sweep apart), are sent again,
with their priority."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis
from weightq.settings import Settings
from weightq.tasks.contract import (
    QUEUED,
    RECOVER_LOCK,
    RESUMING,
    STARTED_HW,
    TASK_NAME,
    JobState,
    args_repr,
    job_key,
    staged_sets,
)
from weightq.tasks.limits import DEFAULT_PRIORITY, MAX_PRIORITY, broker_priority
from weightq.token_plane import TokenPlane
from weightq.transport import priority_queues, waiting_by_priority

from .affinity import own_queues

log = logging.getLogger(__name__)

SWEEP_JOBS = 500  # queued jobs (the oldest) and resuming ones (a random sample) a sweep checks on each shard
SCAN_PAGE = 1000  # messages read from the broker per command while a sweep looks for its jobs


class LostJobSweeper:
    """`plane` reaches the jobs (the streams' Redis, or its shards), `broker` the queue's lists and
    unacked messages (the same server unless STREAMS_REDIS_URL is set): the sweep reads each apart and
    acts only on a job missing from the broker in two sweeps in a row, so reading several servers at
    several moments is safe. Each shard keeps its jobs' queued and resuming sets and the high-water
    marks of the jobs started there: the sweep reads them all, the marks merged."""

    def __init__(
        self,
        settings: Settings,
        plane: TokenPlane,
        broker: redis.Redis,
        hostname: str,
        celery_app: Callable[[], object],
    ) -> None:
        self.settings, self.plane, self.broker, self.hostname = settings, plane, broker, hostname
        self.celery_app = celery_app  # the worker's Celery app, once it exists
        self._suspects: set[str] = set()  # lost-looking jobs seen by the last sweep

    def sweep(self) -> list[str]:
        """Re-send jobs whose message is gone; returns their ids. Cheap when nothing is lost: one
        ZRANGEBYSCORE. A job counts as lost only if it is still 'queued' long after submission, it
        should have been taken (a job of its class or a lower one submitted later has started, or no
        list it waits behind holds a message: the broker takes the more urgent lists first and each
        list in order), and it is in neither the queue's lists nor the unacked messages in two sweeps
        in a row."""
        plane, s = self.plane, self.settings
        if not plane.home.set(RECOVER_LOCK, self.hostname, nx=True, ex=max(1, int(s.worker.recover_interval_s))):
            return []
        grace = time.time() - s.worker.lost_job_grace_s
        lists = priority_queues(s.queues.queue)  # lists[i] holds class MAX_PRIORITY - i
        lengths = waiting_by_priority(self.broker, [s.queues.queue])[0]  # and its staged sets (FAIR_QUEUE)
        started: dict[int, float] = {}  # class -> latest submission started (on any shard)
        for shard in plane.shards:
            for k, v in shard.hgetall(STARTED_HW).items():
                started[int(k)] = max(float(v), started.get(int(k), 0.0))
        waiting = sum(lengths)
        cutoff = min(grace, max(started.values(), default=0.0)) if waiting else grace
        old = [
            (raw_id.decode(), queued_at)
            for shard in plane.shards
            for raw_id, queued_at in shard.zrangebyscore(
                QUEUED, "-inf", cutoff, start=0, num=SWEEP_JOBS, withscores=True
            )
        ]
        # jobs a dead worker's reaper sent back and no run has begun since (their message may be lost)
        resuming = sorted(j.decode() for shard in plane.shards for j in shard.srandmember(RESUMING, SWEEP_JOBS))
        if not old and not resuming:
            self._suspects.clear()
            return []
        states = plane.each([j for j, _ in old], lambda pipe, j: pipe.hmget(job_key(j), "state", "request"))
        queued = []
        for (job_id, queued_at), (state, request) in zip(old, states, strict=True):
            if state != JobState.QUEUED.encode():
                plane.of(job_id).zrem(QUEUED, job_id)  # started (or expired) without BEGIN seeing it here
                continue
            cls = _priority_of(request)
            ahead = sum(lengths[: MAX_PRIORITY - cls + 1])  # messages of its class and more urgent ones
            passed = max((t for c, t in started.items() if c <= cls), default=0.0)
            if not ahead or queued_at < passed:
                queued.append(job_id)
        queued += self._resuming(resuming)
        if not queued:
            return []
        if waiting > s.worker.lost_job_scan_limit:
            log.info("%d jobs look lost, but the queue is too long to scan now", len(queued))
            return []
        # a job may wait in a worker's own queue (prefix affinity) while later ones start elsewhere
        own = list(own_queues(plane.home, s.queues.queue))
        present = self._present(queued, [*lists, *(k for q in own for k in priority_queues(q))], [s.queues.queue, *own])
        missing = {j for j in queued if j not in present}
        lost, self._suspects = sorted(missing & self._suspects), missing - self._suspects
        app = self.celery_app()
        for job_id in lost:
            raw = plane.of(job_id).hget(job_key(job_id), "request")
            if raw is None or app is None:
                continue
            log.warning("job %s lost its message (a Redis or worker crash?): sending it again", job_id)
            request = json.loads(raw)
            app.send_task(  # type: ignore[attr-defined]
                TASK_NAME,
                args=[request],
                task_id=job_id,
                queue=s.queues.queue,
                argsrepr=args_repr(request),
                kwargsrepr="{}",
                priority=broker_priority(_priority_of(raw)),
            )
        return lost

    def _resuming(self, job_ids: list[str]) -> list[str]:
        """Those still running (their message should be in a list or unacked); the rest leave the set."""
        states = self.plane.each(job_ids, lambda pipe, j: pipe.hget(job_key(j), "state"))
        ended = [j for j, state in zip(job_ids, states, strict=True) if state != JobState.RUNNING.encode()]
        for shard, gone in self.plane.split(ended).items():
            self.plane.shards[shard].srem(RESUMING, *gone)
        return [j for j in job_ids if j not in ended]

    def _present(self, job_ids: list[str], lists: list[str], staging: list[str]) -> set[str]:
        """Which of these jobs have a message in the queue's lists, staged for one of the `staging`
        queues, or among the unacked ones."""
        needles = {j: f'"{j}"'.encode() for j in job_ids}
        found: set[str] = set()

        def scan(blobs) -> None:
            for blob in blobs:
                for j, needle in needles.items():
                    if needle in blob:
                        found.add(j)

        scan(self.broker.hvals("unacked"))
        for name in lists:
            for start in range(0, self.broker.llen(name), SCAN_PAGE):
                scan(self.broker.lrange(name, start, start + SCAN_PAGE - 1))
        for name in (key for q in staging for key in staged_sets(q)):
            for start in range(0, self.broker.zcard(name), SCAN_PAGE):
                scan(self.broker.zrange(name, start, start + SCAN_PAGE - 1))
        return found


def _priority_of(request: bytes | None) -> int:
    """The class of a job's stored request: the client stored JobRequest.to_json(), which always names
    it (checked when the job was submitted)."""
    try:
        return int(json.loads(request or b"{}")["priority"])
    except (ValueError, TypeError, KeyError):
        return DEFAULT_PRIORITY
