"""What a worker process hosts: one engine, and the pieces that join it to Celery and Redis.

Task threads call `run()` (jobs.py), which submits to the engine and blocks on the result; the
background loops (loops.py, recovery.py) keep the worker honest; `shutdown()` is the warm shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import redis
from weightq.engine import AnyEngine
from weightq.settings import Settings
from weightq.tasks.contract import HEARTBEATS
from weightq.tasks.request import JobRequest, RequestError
from weightq.token_plane import TokenPlane

from . import loops
from .adapters import AdapterSync, adapters_loop
from .affinity import Affinity, steal_loop
from .inflight import InFlight
from .intake import Intake, intake_loop
from .jobs import SHUTDOWN, DeadLettered, GenerationFailed, JobRunner
from .lease import WorkerLease, new_instance
from .publisher import StreamPublisher
from .reaper import Reaper
from .recovery import LostJobSweeper

log = logging.getLogger(__name__)

__all__ = ["DeadLettered", "GenerationFailed", "WorkerHost"]

HAND_OVER_S = 1.0  # a warm shutdown hands its own queue over again this often: clients route by heartbeats
SHUTDOWN_POLL_S = 0.1  # how often a warm shutdown checks whether the engine is idle


class WorkerHost:
    def __init__(
        self,
        settings: Settings,
        engine: AnyEngine,
        publisher: StreamPublisher,
        plane: TokenPlane,
        hostname: str,
        instance: str | None = None,
        broker: redis.Redis | None = None,
    ) -> None:
        self.settings, self.engine, self.publisher = settings, engine, publisher
        # `plane` reaches the streams and job state (its home: the pool's keys), `broker` Celery's keys
        # (the same server unless STREAMS_REDIS_URL is set)
        client = plane.home
        self.plane, self.redis, self.broker, self.hostname = plane, client, broker or client, hostname
        self.instance = instance or new_instance(hostname)  # its Redis connections carry it (lease.py)
        self.inflight = InFlight()
        self.stopping = threading.Event()  # warm shutdown began: cancelled jobs go back to the queue
        self._stop = threading.Event()  # the loops end
        self.jobs = JobRunner(settings, engine, publisher, plane, hostname, self.inflight, self.instance)
        publisher.on_write_failed = engine.cancel  # a job whose stream Redis refuses stops generating
        self.consumer: Any = None  # Celery's consumer, once it exists (leases and prefetch)
        self.app: Any = None  # the Celery app (to re-send lost jobs)
        self.sweeper = LostJobSweeper(settings, plane, self.broker, hostname, lambda: self.app)
        self.lease = WorkerLease(plane, settings.worker, hostname, self.instance)
        self.reaper = Reaper(plane, self.broker, settings.worker, self.instance)
        self.affinity = Affinity(client, self.broker, settings, hostname, self.instance)  # its own queue (AFFINITY)
        self.intake = Intake(self.broker, settings, hostname)  # what it takes from the queue, and when
        publisher.on_superseded = engine.cancel  # a job resumed elsewhere: stop this run of it
        self._threads: list[threading.Thread] = []

    # ----- what the task calls -------------------------------------------------------------------
    def run(self, job_id: str, spec: JobRequest, delivery_tag: str | None = None) -> dict:
        return self.jobs.run(job_id, spec, delivery_tag or loops.delivery_tag_of(self.consumer, job_id))

    def fail(self, job_id: str, error: RequestError) -> None:
        """A request the contract refused."""
        self.jobs.fail(job_id, str(error), error.field)

    def fail_job(self, job_id: str, message: str) -> None:
        """A run that raised: its job must not stay 'running' (Celery acks a failed task)."""
        self.jobs.fail(job_id, message)

    # ----- the loops -------------------------------------------------------------------------------
    def start(self) -> None:
        s, r, stop, consumer = self.settings, self.redis, self._stop, lambda: self.consumer

        def recover() -> None:
            while not stop.wait(s.worker.recover_interval_s):
                self.sweeper.sweep()

        def reap() -> None:
            while True:
                self.reaper.sweep()
                self.affinity.drain_dead()  # the dead's own queues (and what the reaper put back there)
                if stop.wait(self.reaper.interval_s):
                    return

        def renew() -> None:
            while True:
                self.lease.renew(set(loops.delivered_tags(self.inflight, consumer())))
                # listed again: a drain that found its lease lapsed (a pause) may have forgotten its queue
                self.affinity.register()
                if stop.wait(self.lease.renew_s):
                    return

        self.affinity.register()
        self.lease.renew(set())  # listed on every shard before its first job begins (BEGIN reads it there)
        lora = s.engine.enable_lora or bool(s.engine.lora_modules)  # adapters follow the pool's (LORA_ADAPTERS)
        adapter_sync = AdapterSync(r, self.engine, self.hostname, s.served)
        for name, loop in (
            ("lease", renew),  # its own lease (LEASE_TTL_S / 4)
            ("reap", reap),
            ("cancel", lambda: loops.cancel_loop(self.plane.shards, self.engine, self.inflight, stop)),
            ("restamp", lambda: loops.restamp_loop(self.broker, s.worker, self.inflight, consumer, stop)),
            ("intake", lambda: intake_loop(self.intake, self.engine, self.inflight, consumer, self.stopping, stop)),
            ("recover", recover),
            ("heartbeat", lambda: loops.heartbeat_loop(r, self.hostname, self.stats, stop)),
            ("steal", lambda: steal_loop(self.affinity, self.room, lambda: not len(self.inflight), stop)),
            *([("adapters", lambda: adapters_loop(adapter_sync, stop))] if lora else []),
        ):
            self._threads.append(loops.run_guarded(name, loop, stop))

    def room(self) -> int:
        """Jobs this worker could take now: the engine's room, less messages taken but not yet in it."""
        if self.stopping.is_set() or self.inflight.exclusive or self.consumer is None:
            return 0
        pending = loops.pipe_counts(self.inflight, self.consumer)[0]
        return max(0, min(self.engine.room_for(), self.settings.worker.concurrency - len(self.inflight)) - pending)

    def stats(self) -> dict:
        s = self.settings
        stats = self.engine.stats() | {
            "active_jobs": len(self.inflight),
            "hostname": self.hostname,
            "threads": s.worker.concurrency,  # its pool's task threads (the pool's count wins over CONCURRENCY)
            "queue": s.queues.queue,  # what `weightq batch` and the gateway's queue depth look for
            # where clients route this worker's prefixes (None: off, or shutting down: route elsewhere)
            "own_queue": None if self.stopping.is_set() else self.affinity.queue,
            "stolen": self.affinity.stolen,
            "drained": self.affinity.drained,
            "released": self.intake.released,  # staged jobs it released (FAIR_QUEUE)
            "idle_queued_s": round(self.affinity.idle_queued_s, 2),
            "room": self.room(),  # jobs it could take now
            "in_pipe": loops.pipe_counts(self.inflight, self.consumer)[0] if self.consumer is not None else 0,
            "served_model": s.served.name(),
        }
        if self.publisher.metrics is not None:
            stats["metrics"] = self.publisher.metrics.snapshot()
        return stats

    # ----- shutdown ----------------------------------------------------------------------------------
    def _hand_over_own_queue(self) -> None:
        """What waits in this worker's own queue goes to the shared one, for the other workers: it takes
        nothing more, and its heartbeat stops advertising the queue (`stats`), where a warm shutdown's
        grace period kept jobs routed there waiting for its lease to lapse."""
        if self.affinity.queue is None:
            return
        try:
            if n := self.affinity.move(self.affinity.queue, self.settings.queues.queue):
                log.info("warm shutdown: %d jobs of this worker's queue go to the shared queue", n)
        except redis.RedisError as e:
            log.warning("warm shutdown: this worker's queue stays for the others to drain (%s)", e)

    def shutdown(self) -> None:
        """Warm shutdown: stop taking jobs, let running generations finish within the grace period,
        then stop the engine; jobs still inside go back to the queue (their tasks raise Reject)."""
        qos = getattr(self.consumer, "qos", None)
        self.stopping.set()
        if qos is not None and qos.value > 1:
            qos.decrement_eventually(qos.value - 1)
        deadline = time.monotonic() + self.settings.worker.shutdown_grace_s
        handed = 0.0
        while time.monotonic() < deadline and not self.engine.idle():
            if time.monotonic() >= handed:  # every HAND_OVER_S: clients route by heartbeats a second old
                self._hand_over_own_queue()
                handed = time.monotonic() + HAND_OVER_S
            time.sleep(SHUTDOWN_POLL_S)
        self._hand_over_own_queue()
        self.publisher.requeueing = True
        self.inflight.close()  # jobs waiting to enter (behind one running alone) go back to the queue
        self.engine.stop("cancelled", SHUTDOWN)
        self._stop.set()
        with contextlib.suppress(redis.RedisError):
            self.redis.hdel(HEARTBEATS, self.hostname)
