"""What a worker process hosts: one engine, and the glue between it, Celery and Redis.

Task threads call `run()`, which submits to the engine and blocks on the result. Three small
loops keep the worker honest:
  - cancellation: a client's cancel (published on a channel) or a Celery revoke reaches the engine
    within ~50 ms; the job's cancel flag stays in Redis for a run that starts later;
  - leases: the worker re-stamps its in-flight messages in kombu's `unacked_index`, so only a
    dead worker's jobs outlive the visibility timeout and are redelivered;
  - backpressure: the consumer's prefetch follows what the engine could admit soon, so several
    workers on one queue share it and none hoards jobs it cannot start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time

import redis
from celery.exceptions import Reject

from engine import Engine, GenerationRequest
from tasks.schema import JobSpec, RequestError

from .settings import Settings
from .streams import BEGIN, CANCEL_CHANNEL, cancelled_result, field_of, job_key, result_dict, stream_key

log = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    """The engine could not generate for this job (the message says why)."""


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
        self._stop = threading.Event()
        self.shutting_down = False
        self._threads: list[threading.Thread] = []
        self.consumer = None  # set once Celery's consumer exists (for leases and prefetch)

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
        attempt, stored = self._begin(
            keys=[job_key(job_id), stream_key(job_id)], args=[s.stream_maxlen, 86_400, s.result_ttl_s]
        )
        if attempt == -1:
            return cancelled_result(job_id)
        if attempt == -2:  # finished before, redelivered before its ack: the same result again
            return json.loads(stored)
        request = GenerationRequest(job_id, spec.prompt, spec.prompt_token_ids, spec.params, spec.messages)
        extra = {"attempt": int(attempt), "worker": self.hostname}
        self.engine.sink.annotations[job_id] = extra
        with self._lock:
            self.active[job_id] = time.monotonic()
            if delivery_tag:
                self._tags[job_id] = delivery_tag
        try:
            final = self.engine.submit(request).result()
        finally:
            with self._lock:
                self.active.pop(job_id, None)
                self._tags.pop(job_id, None)
        if final.reason == "cancelled" and self.shutting_down:
            self.redis.hset(job_key(job_id), "state", "queued")
            raise Reject(f"worker {self.hostname} shutting down: job {job_id} goes back to the queue", requeue=True)
        if final.reason == "error":
            message = final.error or "error"
            self._done(job_id, None, {"error": message, "field": field_of(message)})
            raise GenerationFailed(message)
        result = result_dict(final) | extra
        self._done(job_id, result)
        return result

    def fail(self, job_id: str, error: RequestError) -> None:
        """A request refused before it reached the engine: end its stream with the error."""
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(
            stream_key(job_id),
            {"type": "error", "message": str(error), "field": error.field},
            maxlen=s.stream_maxlen,
            approximate=True,
        )
        pipe.expire(stream_key(job_id), s.stream_ttl_s)
        pipe.hset(job_key(job_id), mapping={"state": "done", "error": str(error), "field": error.field})
        pipe.expire(job_key(job_id), s.result_ttl_s)
        pipe.execute()

    def _done(self, job_id: str, result: dict | None, error: dict[str, str] | None = None) -> None:
        """The job hash's final state: its result, or its error (so a poller never needs the stream)."""
        cancelled = result is not None and result.get("finish_reason") == "cancelled"
        mapping = {"state": "cancelled" if cancelled else "done", **(error or {})}
        if result is not None:
            mapping["result"] = json.dumps(result)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(job_key(job_id), mapping=mapping)
        pipe.expire(job_key(job_id), self.settings.result_ttl_s)
        pipe.execute()

    # ----- background loops ---------------------------------------------------------------------
    def start(self) -> None:
        for name, target in (
            ("cancel", self._cancel_loop),
            ("lease", self._lease_loop),
            ("prefetch", self._prefetch_loop),
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
