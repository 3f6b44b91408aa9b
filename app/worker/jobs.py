"""Running one job on the worker's engine: start it in Redis (once), generate, and make sure its end is
written before the task returns; at shutdown, send it back to the queue instead."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import redis
from celery.exceptions import Ignore, Reject
from weightq.engine import AnyEngine, GenerationRequest
from weightq.engine.params import TokenLogprobs
from weightq.redis_conn import retrying
from weightq.settings import Settings
from weightq.tasks.contract import (
    BEGIN,
    DEAD,
    FAIL,
    INSTANCE_SETS_TTL_S,
    LEASES,
    QUEUED,
    REQUEUE,
    RESUMING,
    RUNNING_STREAM_TTL_S,
    STARTED_HW,
    STREAM_TICK,
    Begun,
    Emitted,
    Requeued,
    cancelled_result,
    decode_fields,
    emitted_tokens,
    engine_jobs_key,
    field_of,
    held_key,
    job_key,
    result_dict,
    stream_key,
)
from weightq.tasks.generate import RequestRefused
from weightq.tasks.request import JobRequest
from weightq.tasks.results import TokenLogprobs as StreamedLogprobs
from weightq.token_plane import TokenPlane

from .inflight import Closed, InFlight
from .publisher import SHUTDOWN, StreamPublisher
from .to_engine import engine_request

log = logging.getLogger(__name__)
T = TypeVar("T")


class GenerationFailed(RuntimeError):
    """The engine could not generate for this job (the message says why)."""


class DeadLettered(RuntimeError):
    """Its worker died too often while running it (the last time alone); it is in the weightq:dead list."""


class JobRunner:
    """What a task thread calls: `run()` a job, or `fail()` one whose request was refused."""

    def __init__(
        self,
        settings: Settings,
        engine: AnyEngine,
        publisher: StreamPublisher,
        plane: TokenPlane,
        hostname: str,
        inflight: InFlight,
        instance: str,
    ) -> None:
        self.settings, self.engine, self.publisher = settings, engine, publisher
        self.plane, self.hostname, self.inflight, self.instance = plane, hostname, inflight, instance
        # each runs on the shard of its job's keys (a Script takes any client)
        self._begin = plane.home.register_script(BEGIN)
        self._fail = plane.home.register_script(FAIL)
        self._requeue_script = plane.home.register_script(REQUEUE)
        self._lock = threading.Lock()
        self._runs: dict[str, threading.Event] = {}  # job id -> set when its run here ends
        self._begun: dict[str, int] = {}  # job id -> the attempt of its run here that raised (fail() fences it)

    def run(self, job_id: str, spec: JobRequest, delivery_tag: str | None = None) -> dict:
        with self._lock:
            original = self._runs.get(job_id)
            if original is None:
                self._runs[job_id] = finished = threading.Event()
        if original is not None:
            # A second delivery of a job this worker is running (a restored message after a broker
            # reconnect): never run it twice; answer with the first run's outcome.
            original.wait()
            stored = self.plane.of(job_id).hget(job_key(job_id), "result")
            if stored is None:
                raise GenerationFailed(f"job {job_id} failed in its first run on {self.hostname}")
            return json.loads(stored)
        try:
            result = self._run(job_id, spec, delivery_tag)
        except (Reject, Ignore, RequestRefused):
            self._begun.pop(job_id, None)
            raise
        else:
            self._begun.pop(job_id, None)
            return result
        finally:
            with self._lock:
                self._runs.pop(job_id, None)
            finished.set()

    def _run(self, job_id: str, spec: JobRequest, delivery_tag: str | None) -> dict:
        s = self.settings
        run_id = uuid.uuid4().hex  # makes a retried BEGIN a no-op (tasks/contract.py)
        attempt, stored, *started = self.retrying(
            lambda: self.plane.durable(job_id).run(
                self._begin,
                [
                    *(job_key(job_id), stream_key(job_id), QUEUED, STARTED_HW, DEAD),
                    *(held_key(self.instance), RESUMING, LEASES),
                ],
                [
                    s.stream.maxlen,
                    RUNNING_STREAM_TTL_S,
                    s.stream.result_ttl_s,
                    s.worker.max_attempts,
                    time.time(),
                    self.hostname,
                    job_id,
                    json.dumps(cancelled_result(job_id)),
                    run_id,
                    spec.priority,
                    self.instance,
                    delivery_tag or "",
                ],
            )
        )
        if attempt == Begun.CANCELLED:
            return cancelled_result(job_id)
        if attempt == Begun.DEAD_LETTERED:
            message = stored.decode() if isinstance(stored, bytes) else stored
            log.error("job %s dead-lettered: %s", job_id, message)
            raise DeadLettered(message)
        if attempt == Begun.DONE:  # finished before, redelivered before its ack: the same outcome again
            if stored:
                return json.loads(stored)
            error = self.retrying(lambda: self.plane.of(job_id).hget(job_key(job_id), "error"))  # ended in error
            error = error.decode() if isinstance(error, bytes) else error
            raise GenerationFailed(error or "it failed in an earlier run")
        self._begun[job_id] = attempt = int(attempt)
        submitted_s, crashes, resumed_from = float(started[0] or 0) or None, int(started[1]), int(started[2])
        emitted, lps = self._emitted(job_id, spec, resumed_from)
        request = engine_request(
            job_id, spec, shared_prefix_cache=s.queues.prefix_cache_shared, submitted_s=submitted_s
        )
        if self.publisher.metrics is not None and submitted_s:
            self.publisher.metrics.submitted(job_id, submitted_s)  # latency from submission
        request.emitted, request.emitted_logprobs = emitted.token_ids, lps
        extra = {"attempt": attempt, "worker": self.hostname}
        # Suspected of crashing workers: alone in the engine, so that a crash now is its own.
        alone = crashes >= max(1, s.worker.max_attempts - 1)
        if alone:
            log.warning("job %s: its worker died %d times while running it; it runs alone", job_id, crashes)
        try:
            with self.inflight.entered(job_id, delivery_tag, alone):
                final, written = self._generate(job_id, request, attempt, extra)
        except Closed:  # shutting down before it could start: back to the queue as it was
            final, written = None, True
        if not written:  # Redis down too long: the task ends the job (FAIL), and its queued entries go
            self.publisher.runs.abandon(job_id)
            raise GenerationFailed(f"job {job_id}: its end entry was not written in {s.redis.retry_s} s")
        end = self.publisher.runs.ended(job_id)
        if end.superseded:
            raise Ignore(f"job {job_id} resumed on another worker while this one was taken for dead")
        if end.refused is not None:
            raise GenerationFailed(end.refused)  # its stream ended with an error entry (publisher._abort)
        if final is None or (final.reason == "cancelled" and final.error == SHUTDOWN):
            # Back to the queue, unless its client cancelled it during the grace period (a cancel the
            # engine missed: its pub/sub message can be lost while the cancel loop restarts).
            # If kombu's requeue fails on the closing channel, the recovery sweep finds the job
            # queued and nowhere else, and sends it again. Retried like every state write: a task
            # that raised here would be acked, its job left 'running' and unrecoverable.
            # reason "cancelled", with what it had generated
            result = (result_dict(final) if final else _unstarted(job_id, emitted)) | extra
            requeued = self.retrying(lambda: self._requeue(job_id, result, attempt))
            if requeued == Requeued.SUPERSEDED:
                raise Ignore(f"job {job_id} resumed on another worker while this one was taken for dead")
            if requeued == Requeued.ENDED:
                return result
            raise Reject(f"worker {self.hostname} shutting down: job {job_id} goes back to the queue", requeue=True)
        if final.reason == "error":
            if field_of(final.error):  # the request named a field the engine refused: a client error
                raise RequestRefused(final.error)
            raise GenerationFailed(final.error or "error")
        return result_dict(final) | extra

    def _generate(self, job_id: str, request: GenerationRequest, attempt: int, extra: dict):
        """Run the job in the engine: (its FinishEvent, whether its end was written in time)."""
        # The stream writer records the job's end entry and final state together; the task returns
        # (and its message is acked) only after that, so a worker killed at any point leaves either a
        # finished job with its end entry or a running one that its redelivery runs again.
        written = self.publisher.runs.begin(job_id, attempt, extra)
        key, shard = engine_jobs_key(self.instance), self.plane.of(job_id)  # the shard's own set (reaper.py)
        self.retrying(
            lambda: shard.pipeline(transaction=False).sadd(key, job_id).expire(key, INSTANCE_SETS_TTL_S).execute()
        )
        try:
            final = self.engine.submit(request).result()
            return final, written.wait(self.settings.redis.retry_s)
        finally:
            self.publisher.runs.end(job_id)
            with contextlib.suppress(redis.RedisError):  # a stale member is never charged (reaper.py)
                shard.srem(key, job_id)

    def _emitted(self, job_id: str, spec: JobRequest, expected: int) -> tuple[Emitted, list | None]:
        """What earlier runs of the job emitted, from its stream (the new run's prefix), and their
        log-probabilities as streamed (when the request asks for them)."""
        if not expected:
            return Emitted(), None
        entries = self.retrying(lambda: self.plane.of(job_id).xrange(stream_key(job_id)))
        try:
            emitted = emitted_tokens([decode_fields(f) for _, f in entries])
        except ValueError as e:
            raise GenerationFailed(f"job {job_id} cannot resume: {e} (STREAM_MAXLEN)") from None
        if len(emitted.token_ids) != expected:
            log.warning("job %s: %d tokens in its stream, BEGIN saw %d", job_id, len(emitted.token_ids), expected)
        log.info("job %s resumes after %d tokens", job_id, len(emitted.token_ids))
        lps = None
        if spec.logprobs is not None and len(emitted.logprobs) == len(emitted.token_ids):
            lps = [TokenLogprobs(*StreamedLogprobs.from_json(x)) for x in emitted.logprobs]
        return emitted, lps

    def _requeue(self, job_id: str, result: dict, attempt: int) -> Requeued:
        # Listed as queued since long ago: if kombu's requeue on the closing channel is lost, the next
        # two recovery sweeps (RECOVER_INTERVAL_S apart) re-send it, without waiting LOST_JOB_GRACE_S.
        s = self.settings
        since = time.time() - s.worker.lost_job_grace_s - 1
        keys = [job_key(job_id), QUEUED, stream_key(job_id)]
        args = [since, job_id, json.dumps(result), s.stream.maxlen, s.stream.ttl_s, attempt]
        return Requeued(int(self.plane.durable(job_id).run(self._requeue_script, keys, args)))

    def fail(self, job_id: str, message: str, field: str = "") -> None:
        """End the job with an error entry and state done, once (a no-op for a job already done): a
        request refused before it reached the engine (`field` names why), or a run that failed (a
        no-op if a later run began meanwhile: this worker was taken for dead)."""
        s = self.settings
        attempt = self._begun.pop(job_id, "")
        self.retrying(
            lambda: self.plane.durable(job_id).run(
                self._fail,
                [job_key(job_id), stream_key(job_id), QUEUED, STREAM_TICK],
                [s.stream.maxlen, s.stream.ttl_s, s.stream.result_ttl_s, message, field, job_id, attempt],
            )
        )

    def retrying(self, op: Callable[[], T]) -> T:
        """A job's own state writes wait out a Redis restart or failover (up to REDIS_RETRY_S): giving
        up would leave it 'running' and make a redelivery run it a second time."""
        return retrying(op, self.settings.redis.retry_s)


def _unstarted(job_id: str, emitted: Emitted) -> dict:
    """The result of a run stopped before it reached the engine: what earlier runs had emitted."""
    n = len(emitted.token_ids)
    usage = {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}
    return cancelled_result(job_id) | {"text": "".join(emitted.texts), "token_ids": emitted.token_ids, "usage": usage}
