"""What a worker process hosts: one engine, and the glue between it, Celery and Redis.

Task threads call `run()`, which submits to the engine and blocks on the result. Three small
loops keep the worker honest:
  - cancellation: a client's cancel (published on a channel) or a Celery revoke reaches the engine
    within ~50 ms; the job's cancel flag stays in Redis for a run that starts later;
  - leases: the worker re-stamps its in-flight messages in kombu's `unacked_index`, so only a
    dead worker's jobs outlive the visibility timeout and are redelivered;
  - backpressure: the consumer's prefetch follows what the engine could admit soon, so several
    workers on one queue share it and none hoards jobs it cannot start;
  - recovery: kombu's Redis transport can lose a message that a Redis crash catches between
    delivery and bookkeeping; jobs still queued long after later ones started, and found neither in
    the queue nor among the unacked messages (twice, a sweep apart), are sent again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from celery.exceptions import Reject

from engine import Engine, GenerationRequest
from tasks.schema import JobSpec, RequestError

from .settings import Settings
from .streams import (
    BEGIN,
    CANCEL_CHANNEL,
    DEAD,
    FAIL,
    QUEUED,
    STARTED_HW,
    cancelled_result,
    job_key,
    result_dict,
    stream_key,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
TASK_NAME = "weightq.generate"


class GenerationFailed(RuntimeError):
    """The engine could not generate for this job (the message says why)."""


class DeadLettered(RuntimeError):
    """The job was started too many times without finishing; it is in the weightq:dead list."""


class WorkerHost:
    def __init__(self, settings: Settings, engine: Engine, client: redis.Redis, hostname: str) -> None:
        self.settings = settings
        self.engine = engine
        self.redis = client
        self.hostname = hostname
        self.active: dict[str, float] = {}  # job id -> start time, for jobs inside the engine
        self._tags: dict[str, str] = {}  # job id -> its message's delivery tag (for lease renewal)
        self._runs: dict[str, threading.Event] = {}  # job id -> set when its run here ends
        self._lock = threading.Lock()
        self._begin = client.register_script(BEGIN)
        self._fail = client.register_script(FAIL)
        self._stop = threading.Event()
        self.shutting_down = False
        self._threads: list[threading.Thread] = []
        self.consumer = None  # set once Celery's consumer exists (for leases and prefetch)
        self.app = None  # the Celery app (to re-send lost jobs)
        self._suspects: set[str] = set()  # lost-looking jobs seen by the last sweep

    # ----- task side ----------------------------------------------------------------------------
    def run(self, job_id: str, spec: JobSpec, delivery_tag: str | None = None) -> dict:
        with self._lock:
            original = self._runs.get(job_id)
            if original is None:
                self._runs[job_id] = finished = threading.Event()
        if original is not None:
            # A second delivery of a job this worker is running (a restored message after a broker
            # reconnect): never run it twice; answer with the first run's outcome.
            original.wait()
            stored = self.redis.hget(job_key(job_id), "result")
            if stored is None:
                raise GenerationFailed(f"job {job_id} failed in its first run on {self.hostname}")
            return json.loads(stored)
        try:
            return self._run(job_id, spec, delivery_tag)
        finally:
            with self._lock:
                self._runs.pop(job_id, None)
            finished.set()

    def _run(self, job_id: str, spec: JobSpec, delivery_tag: str | None) -> dict:
        s = self.settings
        attempt, stored = self._retrying(
            lambda: self._begin(
                keys=[job_key(job_id), stream_key(job_id), QUEUED, STARTED_HW, DEAD],
                args=[
                    s.stream_maxlen,
                    86_400,
                    s.result_ttl_s,
                    s.max_attempts,
                    time.time(),
                    self.hostname,
                    job_id,
                    json.dumps(cancelled_result(job_id)),
                ],
            )
        )
        if attempt == -1:
            return cancelled_result(job_id)
        if attempt == -3:
            log.error("job %s dead-lettered: %s", job_id, stored.decode() if isinstance(stored, bytes) else stored)
            raise DeadLettered(stored.decode() if isinstance(stored, bytes) else stored)
        if attempt == -2:  # finished before, redelivered before its ack: the same result again
            return json.loads(stored)
        request = GenerationRequest(job_id, spec.prompt, spec.prompt_token_ids, spec.params, spec.messages)
        extra = {"attempt": int(attempt), "worker": self.hostname}
        self.engine.sink.annotations[job_id] = extra
        with self._lock:
            self.active[job_id] = time.monotonic()
            if delivery_tag:
                self._tags[job_id] = delivery_tag
        # The stream writer records the job's end entry and final state together; the task returns
        # (and its message is acked) only after that, so a worker killed at any point leaves either a
        # finished job with its end entry or a running one that its redelivery runs again.
        written = self.engine.sink.expect(job_id)
        try:
            final = self.engine.submit(request).result()
            if not written.wait(s.redis_retry_s):
                raise GenerationFailed(f"job {job_id}: its end entry was not written in {s.redis_retry_s} s")
        finally:
            with self._lock:
                self.active.pop(job_id, None)
                self._tags.pop(job_id, None)
        if final.reason == "cancelled" and self.shutting_down:
            # Back to the queue. If kombu's requeue fails on the closing channel, the recovery sweep
            # finds the job queued and nowhere else, and sends it again. Retried like every state
            # write: a task that raised here would be acked, its job left 'running' and unrecoverable.
            self._retrying(lambda: self._requeue(job_id))
            raise Reject(f"worker {self.hostname} shutting down: job {job_id} goes back to the queue", requeue=True)
        if final.reason == "error":
            raise GenerationFailed(final.error or "error")
        return result_dict(final) | extra

    def _requeue(self, job_id: str) -> None:
        queued_at = float(self.redis.hget(job_key(job_id), "queued_at") or time.time())
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(job_key(job_id), "state", "queued")
        pipe.zadd(QUEUED, {job_id: queued_at})
        pipe.execute()

    def fail(self, job_id: str, error: RequestError) -> None:
        """A request refused before it reached the engine: end its stream with the error (once)."""
        s = self.settings
        self._retrying(
            lambda: self._fail(
                keys=[job_key(job_id), stream_key(job_id), QUEUED],
                args=[s.stream_maxlen, s.stream_ttl_s, s.result_ttl_s, str(error), error.field, job_id],
            )
        )

    def _retrying(self, op: Callable[[], T]) -> T:
        """A job's own state writes wait out a Redis restart (up to REDIS_RETRY_S): giving up would
        leave it 'running' and make a redelivery run it a second time."""
        deadline = time.monotonic() + self.settings.redis_retry_s
        while True:
            try:
                return op()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("Redis unavailable (%s); retrying", e)
                time.sleep(0.5)

    # ----- background loops ---------------------------------------------------------------------
    def start(self) -> None:
        for name, target in (
            ("cancel", self._cancel_loop),
            ("lease", self._lease_loop),
            ("prefetch", self._prefetch_loop),
            ("recover", self._recover_loop),
            ("heartbeat", self._heartbeat_loop),
        ):
            t = threading.Thread(target=self._guard(target), name=f"weightq-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _guard(self, loop):
        def run() -> None:
            while not self._stop.is_set():
                try:
                    loop()
                except Exception:
                    log.exception("%s failed; restarting it", loop.__name__)
                    self._stop.wait(1.0)

        return run

    def _cancel_loop(self) -> None:
        """Cancels arrive as a publish on CANCEL_CHANNEL (clients) or a Celery revoke (control)."""
        from celery.worker import state

        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(CANCEL_CHANNEL)
        try:
            while not self._stop.is_set():
                message = pubsub.get_message(timeout=0.05)
                if message is not None:
                    data = message["data"]
                    self.engine.cancel(data.decode() if isinstance(data, bytes) else data)
                with self._lock:
                    ids = [job_id for job_id in self.active if job_id in state.revoked]
                for job_id in ids:
                    self.engine.cancel(job_id)
        finally:
            pubsub.close()

    def _lease_loop(self) -> None:
        while not self._stop.wait(self.settings.lease_renew_s):
            tags = self._delivered_tags()
            if tags:
                now = time.time()
                # XX: only re-stamp messages still unacked; never resurrect an acked one.
                self.redis.zadd("unacked_index", dict.fromkeys(tags, now), xx=True)

    def _delivered_tags(self) -> list[str]:
        """Tags of the messages this worker holds: its running jobs' own (they outlive a broker
        reconnect, which gives the consumer a fresh channel) and what the channel has delivered."""
        with self._lock:
            tags = set(self._tags.values())
        consumer = self.consumer
        try:
            delivered = consumer.task_consumer.channel.qos._delivered  # kombu's virtual QoS
        except AttributeError:
            return list(tags)
        for _ in range(3):
            try:
                return list(tags.union(delivered))
            except RuntimeError:  # changed size during iteration: another thread acked
                continue
        return list(tags)

    def _prefetch_loop(self) -> None:
        while not self._stop.wait(0.05):
            consumer = self.consumer
            qos = getattr(consumer, "qos", None)
            if qos is None or self.shutting_down:
                continue
            b = self.engine.batcher
            with self._lock:
                active = len(self.active)
            # Hold what the engine has, plus what it could admit now (nothing once anything waits).
            want = max(1, min(self.settings.concurrency, active + b.room_for()))
            if want > qos.value:
                qos.increment_eventually(want - qos.value)
            elif want < qos.value:
                qos.decrement_eventually(qos.value - want)

    def _recover_loop(self) -> None:
        while not self._stop.wait(self.settings.recover_interval_s):
            self.recover_lost_jobs()

    def recover_lost_jobs(self) -> list[str]:
        """Re-send jobs whose message is gone; returns their ids. Cheap when nothing is lost: one
        ZRANGEBYSCORE. A job counts as lost only if it is still 'queued' long after submission, a
        later job has already started or the queue is empty (FIFO: it should have been taken), and
        it is in neither the queue nor the unacked messages in two sweeps in a row."""
        r, s = self.redis, self.settings
        if not r.set("weightq:recover-lock", self.hostname, nx=True, ex=max(1, int(s.recover_interval_s))):
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
            if state == b"queued":
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
        for job_id in lost:
            raw = r.hget(job_key(job_id), "request")
            if raw is None or self.app is None:
                continue
            log.warning("job %s lost its message (a Redis crash?): sending it again", job_id)
            self.app.send_task(TASK_NAME, args=[json.loads(raw)], task_id=job_id, queue=s.queue)
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

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(1.0):
            self.redis.hset("weightq:workers", self.hostname, json.dumps(self.stats() | {"ts": time.time()}))

    def stats(self) -> dict:
        with self._lock:
            active = len(self.active)
        stats = self.engine.stats() | {"active_jobs": active, "hostname": self.hostname}
        metrics = getattr(self.engine.sink, "metrics", None)
        if metrics is not None:
            stats["metrics"] = metrics.snapshot()
        return stats

    # ----- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Warm shutdown: stop taking jobs, let running generations finish within the grace period,
        then stop the engine; jobs still inside go back to the queue (their tasks raise Reject)."""
        consumer = self.consumer
        qos = getattr(consumer, "qos", None)
        self.shutting_down = True
        if qos is not None and qos.value > 1:
            qos.decrement_eventually(qos.value - 1)
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        while time.monotonic() < deadline:
            b = self.engine.batcher
            if not b.running and not self.engine._inbox:
                break
            time.sleep(0.1)
        self.engine.sink.requeueing = True
        self.engine.stop("cancelled", "worker shutdown")
        self._stop.set()
        with contextlib.suppress(redis.RedisError):
            self.redis.hdel("weightq:workers", self.hostname)
