"""Running one job on the worker's engine: start it in Redis (once), generate, and make sure its end is
written before the task returns; at shutdown, send it back to the queue instead."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import redis
from celery.exceptions import Reject
from weightq.engine import AnyEngine
from weightq.redis_conn import Durable, retrying
from weightq.settings import Settings
from weightq.tasks.contract import (
    BEGIN,
    DEAD,
    FAIL,
    QUEUED,
    REQUEUE,
    RUNNING_STREAM_TTL_S,
    STARTED_HW,
    cancelled_result,
    field_of,
    job_key,
    result_dict,
    stream_key,
)
from weightq.tasks.generate import RequestRefused
from weightq.tasks.request import JobRequest

from .inflight import InFlight
from .publisher import SHUTDOWN, StreamPublisher
from .to_engine import engine_request

log = logging.getLogger(__name__)
T = TypeVar("T")


class GenerationFailed(RuntimeError):
    """The engine could not generate for this job (the message says why)."""


class DeadLettered(RuntimeError):
    """The job was started too many times without finishing; it is in the weightq:dead list."""


class JobRunner:
    """What a task thread calls: `run()` a job, or `fail()` one whose request was refused."""

    def __init__(
        self,
        settings: Settings,
        engine: AnyEngine,
        publisher: StreamPublisher,
        client: redis.Redis,
        hostname: str,
        inflight: InFlight,
        stopping: threading.Event,
    ) -> None:
        self.settings, self.engine, self.publisher = settings, engine, publisher
        self.redis, self.hostname, self.inflight, self.stopping = client, hostname, inflight, stopping
        self.durable = Durable(client, settings.redis_wait_replicas, settings.redis_wait_timeout_ms)
        self._begin = client.register_script(BEGIN)
        self._fail = client.register_script(FAIL)
        self._requeue_script = client.register_script(REQUEUE)
        self._lock = threading.Lock()
        self._runs: dict[str, threading.Event] = {}  # job id -> set when its run here ends

    def run(self, job_id: str, spec: JobRequest, delivery_tag: str | None = None) -> dict:
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

    def _run(self, job_id: str, spec: JobRequest, delivery_tag: str | None) -> dict:
        s = self.settings
        run_id = uuid.uuid4().hex  # makes a retried BEGIN a no-op (tasks/contract.py)
        attempt, stored, *submitted = self.retrying(
            lambda: self.durable.run(
                self._begin,
                [job_key(job_id), stream_key(job_id), QUEUED, STARTED_HW, DEAD],
                [
                    s.stream_maxlen,
                    RUNNING_STREAM_TTL_S,
                    s.result_ttl_s,
                    s.max_attempts,
                    time.time(),
                    self.hostname,
                    job_id,
                    json.dumps(cancelled_result(job_id)),
                    run_id,
                    spec.priority,
                ],
            )
        )
        if attempt == -1:
            return cancelled_result(job_id)
        if attempt == -3:
            message = stored.decode() if isinstance(stored, bytes) else stored
            log.error("job %s dead-lettered: %s", job_id, message)
            raise DeadLettered(message)
        if attempt == -2:  # finished before, redelivered before its ack: the same result again
            return json.loads(stored)
        request = engine_request(job_id, spec, shared_prefix_cache=s.prefix_cache_shared)
        if self.publisher.metrics is not None and submitted and submitted[0]:
            self.publisher.metrics.submitted(job_id, float(submitted[0]))  # latency from submission
        extra = {"attempt": int(attempt), "worker": self.hostname}
        self.publisher.annotations[job_id] = extra
        self.inflight.add(job_id, delivery_tag)
        # The stream writer records the job's end entry and final state together; the task returns
        # (and its message is acked) only after that, so a worker killed at any point leaves either a
        # finished job with its end entry or a running one that its redelivery runs again.
        written = self.publisher.expect(job_id)
        try:
            final = self.engine.submit(request).result()
            if not written.wait(s.redis_retry_s):
                raise GenerationFailed(f"job {job_id}: its end entry was not written in {s.redis_retry_s} s")
        finally:
            self.inflight.remove(job_id)
        if (why := self.publisher.failed.pop(job_id, None)) is not None:
            raise GenerationFailed(why)  # its stream ended with an error entry (publisher._abort)
        if final.reason == "cancelled" and final.error == SHUTDOWN:
            # Back to the queue, unless its client cancelled it during the grace period (a cancel the
            # engine missed: its pub/sub message can be lost while the cancel loop restarts).
            # If kombu's requeue fails on the closing channel, the recovery sweep finds the job
            # queued and nowhere else, and sends it again. Retried like every state write: a task
            # that raised here would be acked, its job left 'running' and unrecoverable.
            result = result_dict(final) | extra  # reason "cancelled", with what it had generated
            if self.retrying(lambda: self._requeue(job_id, result)):
                return result
            raise Reject(f"worker {self.hostname} shutting down: job {job_id} goes back to the queue", requeue=True)
        if final.reason == "error":
            if field_of(final.error):  # the request named a field the engine refused: a client error
                raise RequestRefused(final.error)
            raise GenerationFailed(final.error or "error")
        return result_dict(final) | extra

    def _requeue(self, job_id: str, result: dict) -> bool:
        """True when the job ended (cancelled by its client meanwhile) instead of going back."""
        # Listed as queued since long ago: if kombu's requeue on the closing channel is lost, the next
        # two recovery sweeps (RECOVER_INTERVAL_S apart) re-send it, without waiting LOST_JOB_GRACE_S.
        s = self.settings
        since = time.time() - s.lost_job_grace_s - 1
        keys = [job_key(job_id), QUEUED, stream_key(job_id)]
        args = [since, job_id, json.dumps(result), s.stream_maxlen, s.stream_ttl_s]
        return bool(self.durable.run(self._requeue_script, keys, args))

    def fail(self, job_id: str, message: str, field: str = "") -> None:
        """End the job with an error entry and state done, once (a no-op for a job already done): a
        request refused before it reached the engine (`field` names why), or a run that failed."""
        s = self.settings
        self.retrying(
            lambda: self.durable.run(
                self._fail,
                [job_key(job_id), stream_key(job_id), QUEUED],
                [s.stream_maxlen, s.stream_ttl_s, s.result_ttl_s, message, field, job_id],
            )
        )

    def retrying(self, op: Callable[[], T]) -> T:
        """A job's own state writes wait out a Redis restart or failover (up to REDIS_RETRY_S): giving
        up would leave it 'running' and make a redelivery run it a second time."""
        return retrying(op, self.settings.redis_retry_s)
