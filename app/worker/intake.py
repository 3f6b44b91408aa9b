"""What a worker takes from the queue, and when: the one place its task slots are given out.

A job reaches the engine only through a task thread (CONCURRENCY of them), and the engine's batcher
can put the right job first only among the jobs it holds. So the queue in front of it must not be
first come, first served:
- **Fair staging** (FAIR_QUEUE): clients stage jobs in sorted sets per class (app/transport.py:
  `_put`, tasks/queue_scripts.py: STAGE), ordered within a class by each tenant's start tag in weight
  units; this worker releases them into the lists Celery consumes (RELEASE) only as fast as its
  engine can start them: what it releases is what the batcher would pick next, whoever flooded.
- **The batcher is what binds**: it runs at most CONCURRENCY - INTERACTIVE_SLOTS requests (the
  worker passes that as its cap on running requests), so the task threads never run out before it
  does, and it is the batcher, which sees classes and tenants' shares, that decides who yields.
- **Threads held back for jobs that come to preempt**: the INTERACTIVE_SLOTS reserved threads take,
  a few at a time (URGENT_LOOKAHEAD), jobs of an urgent class while background work runs, and jobs of
  a tenant below its share (in weight or in running requests: Urgency.heavy_tenants) while the
  engine is full; the batcher then preempts background work (`preemption.for_class`) or the heaviest
  tenant's newest requests (`preemption.for_tenant`) for them, within a step, whether KV or the count
  of running requests binds. An interactive job never waits for a batch job to finish, nor a light
  tenant for a flood to drain.
- The consumer's prefetch follows the same count, so several workers on one queue share it and none
  hoards jobs it cannot start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from weightq.engine import AnyEngine, Urgency
from weightq.settings import Settings
from weightq.tasks.contract import RELEASE, fair_key, staged_sets, worker_queue
from weightq.tasks.limits import DEFAULT_PRIORITY, broker_priority
from weightq.transport import priority_queues, wake_poller

from .inflight import InFlight
from .loops import pipe_counts

TICK_S = 0.02  # how often the worker looks: a staged job waits at most about this long for a free worker
URGENT_LOOKAHEAD = 4  # urgent jobs taken beyond the engine's room while it has none waiting
# Released jobs not yet in the engine (Celery's consumer and task threads start a few hundred a second):
# a better job staged meanwhile waits behind at most this many, where releasing the whole room at once
# kept a light tenant's job ~1 s behind a flood's released jobs.
IN_PIPE = 16
LAST_URGENT = broker_priority(DEFAULT_PRIORITY)  # broker priorities 0..this are the urgent classes
EVERYTHING = 1 << 30


@dataclass(frozen=True, slots=True)
class Released:
    jobs: int  # staged jobs moved into the lists Celery consumes
    waiting: int  # messages of the urgent classes waiting in the lists this worker takes from


class Release:
    """RELEASE over one destination queue and its sources (their staged sets)."""

    def __init__(self, broker: redis.Redis) -> None:
        self._script = broker.register_script(RELEASE)

    def __call__(
        self,
        dest: str,
        sources: list[str],
        any_class: int,
        urgent: int = 0,
        light: int = 0,
        heavy: tuple[str, ...] = (),
        *,
        watch: str | None = None,
        count_waiting: bool = True,
        recount: bool = True,
    ) -> Released:
        """Release up to `any_class` staged jobs of `sources` (in order) into `dest`'s lists, then up
        to `urgent` more of the urgent classes, then up to `light` more of the urgent classes of tenants
        not `heavy` (below their share); with `count_waiting`, less what waits in `dest`'s lists already
        (all of it for `any_class`, the urgent classes' for `urgent`; a light tenant's job goes ahead of
        them). `watch`: another queue whose
        urgent messages this worker takes too (the shared one). The urgent classes' waiting messages are
        counted when something is released or may go beyond the room, or `recount`."""
        keys = [*priority_queues(dest), *priority_queues(watch or dest)]
        for source in sources:
            keys += [fair_key(source), *staged_sets(source)]
        args = [any_class, urgent, LAST_URGENT, len(sources), int(count_waiting), light, int(recount), *heavy]
        released, waiting = self._script(keys=keys, args=args)
        return Released(int(released), int(waiting))


class Intake:
    """This worker's release of staged jobs and its prefetch, from its engine's room and its slots."""

    def __init__(self, broker: redis.Redis, settings: Settings, hostname: str) -> None:
        self.settings = settings
        own = worker_queue(settings.queues.queue, hostname) if settings.queues.affinity else None
        self.dest = own or settings.queues.queue  # released jobs go where this worker takes first
        self.sources = [own, settings.queues.queue] if own else [settings.queues.queue]
        self.release = Release(broker)
        self.reserve = settings.worker.reserved_slots()
        self.released = 0  # staged jobs this worker released (heartbeat, tests)
        self._waiting = 0  # messages waiting in its lists at the last count

    def plan(self, room: int, running: int, taken: int, urgency: Urgency, exclusive: bool) -> tuple[int, int, int]:
        """(jobs of any class to release within the engine's room, urgent ones beyond it, urgent ones of
        tenants below their share beyond it): `room` typical jobs the engine could start now, `running`
        jobs in the engine, `taken` messages not yet in it, `urgency` its batcher's
        (batcher.outlook.Urgency). Within the room, jobs go in the staged order and hold at most
        CONCURRENCY - INTERACTIVE_SLOTS threads, the most the batcher runs at once. The reserved threads
        are for jobs that come to preempt: urgent ones while background work runs, and those of a tenant
        below its share (in weight, or in running requests), for which the batcher preempts the heaviest
        tenant's newest requests; a few at a time. A lookahead open to any job of the class it runs
        would fill with a flood's jobs and keep the next tenant's out."""
        if exclusive:  # a job running alone (or waiting to) admits no other
            return 0, 0, 0
        threads = self.settings.worker.concurrency
        held = running + taken
        any_class = max(0, min(room, IN_PIPE, threads - self.reserve - running) - taken)
        lookahead = max(0, min(threads - held - any_class, URGENT_LOOKAHEAD) - taken)
        urgent = max(0, lookahead - urgency.urgent_waiting) if urgency.background_running else 0
        # with no tenant at its share there is no light one: what the lookahead released then was the
        # flood's next jobs, put at the consuming end ahead of a light job released within the room
        light = max(0, lookahead - urgency.light_waiting) if urgency.heavy_tenants else 0
        return any_class, urgent, light

    def tick(self, engine: AnyEngine, inflight: InFlight, consumer: Any) -> int | None:
        """One look: release what the engine can start; returns the prefetch the consumer should
        allow (None: no consumer yet)."""
        qos = getattr(consumer, "qos", None)
        if qos is None:
            return None
        s = self.settings
        exclusive = inflight.exclusive
        room = 0 if exclusive else engine.room_for()
        running = len(inflight)
        taken, finishing = pipe_counts(inflight, consumer)
        view = engine.urgency()
        any_class, urgent, light = self.plan(room, running, taken, view, exclusive)
        watch = s.queues.queue if self.dest != s.queues.queue else None
        # staged jobs are released even with FAIR_QUEUE off here: clients with it on stage them
        sources = self.sources
        extra = 0
        if any_class or urgent or light:
            recount = self._waiting > 0  # released beyond the room last time: until taken, they need the prefetch
            out = self.release(
                self.dest, sources, any_class, urgent, light, view.heavy_tenants, watch=watch, recount=recount
            )
            self.released += out.jobs
            self._waiting = out.waiting
            extra = min(out.waiting, urgent + light)
        return self.prefetch(room, running, extra, finishing, exclusive)

    def prefetch(self, room: int, running: int, extra: int, finishing: int, exclusive: bool) -> int:
        """The messages the consumer may hold: what the engine holds (`running`) or, with room, up to
        what background work may hold, plus `extra` urgent messages waiting in the lists for the
        reserved threads (RELEASE counts only those: a background message never takes one), plus the
        messages whose job left the engine and whose ack is still to come (`finishing`: they hold
        kombu's prefetch, not the room). Never below what the worker holds, or messages released for
        the reserved threads would stay in the lists while it holds more than background work may."""
        threads = self.settings.worker.concurrency
        base = running if exclusive else max(running, min(threads - self.reserve, running + room))
        return max(1, min(threads, base + extra) + finishing)


def _wake() -> None:
    """Nothing: a tick of Celery's event loop, which applies the prefetch and re-arms kombu's BRPOP."""


def intake_loop(
    intake: Intake,
    engine: AnyEngine,
    inflight: InFlight,
    consumer: Callable[[], Any],
    stopping: threading.Event,
    stop: threading.Event,
) -> None:
    while not stop.wait(TICK_S):
        if stopping.is_set():
            continue
        c = consumer()
        released = intake.released
        want = intake.tick(engine, inflight, c)
        if want is None:
            continue
        qos = c.qos
        if want > qos.value:
            qos.increment_eventually(want - qos.value)
        elif want < qos.value:
            qos.decrement_eventually(qos.value - want)
        hub = getattr(c, "hub", None)
        if hub is not None and (intake.released > released or want != qos.prev):
            # kombu re-arms its BRPOP only at a tick of Celery's event loop, and only while the prefetch
            # has room: without a wake, jobs released after the prefetch had filled waited ~1 s there
            hub.call_soon(_wake)
            wake_poller(hub)  # kombu 5.6: call_soon from this thread does not end the loop's poll
