"""The worker's side of prefix affinity (AFFINITY; the client's side is app/client/routing.py).

Each worker consumes its own queue (`<QUEUE>.w.<hostname>`, tasks/contract.py: worker_queue) before
the shared QUEUE, at every priority: kombu takes a list per priority, the own queue's first. It
advertises the queue in its heartbeat, which is how clients learn where to route, and registers it
in `weightq:worker-queues` so that any worker can find every own queue:
- work stealing: a worker with room, nothing waiting in its engine, and its own and the shared
  queue empty, moves the oldest messages of the fullest other own queue (one found non-empty twice,
  a poll apart: its worker had no room to take them) into its own queue, as many as it has room for
  and at most half of what waits there. So no worker idles while work it could take is queued, and
  a hot prefix spreads to whoever is free;
- a dead worker's queue: whoever finds its instance's lease lapsed (lease.py) moves what waits there
  to the shared queue, the messages the reaper restored to it included (a message goes back to the
  queue it was sent to). No accepted job waits on a worker that is gone.
Messages move with one Lua script (MOVE_QUEUED), list by list, and staged jobs (FAIR_QUEUE) with
RELEASE, so none is ever out of Redis.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis
from weightq.metrics import read_live_workers
from weightq.settings import Settings
from weightq.tasks.contract import FORGET_FAIR, MOVE_QUEUED, WORKER_QUEUES, fair_key, lease_key, worker_queue
from weightq.transport import priority_queues, waiting_counts

from .intake import EVERYTHING, Release

log = logging.getLogger(__name__)

STEAL_POLL_S = 0.25  # how often an idle worker looks for work to steal


def consume_own_queue(sender: str, instance, **_kwargs) -> None:
    """celeryd_after_setup: the worker consumes its own queue first, then those -Q named."""
    settings = instance.app.settings  # the Celery app's (app/celery.py: WorkerCelery)
    if not settings.queues.affinity:
        return
    queues = instance.app.amqp.queues
    own = worker_queue(settings.queues.queue, sender)
    current = [name for name in queues.consume_from if name != own]
    queues.add(own)
    queues.select([own, *current])


def own_queues(client: redis.Redis, queue: str) -> dict[str, dict]:
    """The registered own queues of workers on `queue`: {own queue: its registration}."""
    out = {}
    for name, raw in client.hgetall(WORKER_QUEUES).items():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if entry.get("queue") == queue:
            out[name.decode() if isinstance(name, bytes) else name] = entry
    return out


class Affinity:
    def __init__(
        self, client: redis.Redis, broker: redis.Redis, settings: Settings, hostname: str, instance: str
    ) -> None:
        # the registry, leases and heartbeats on the streams' Redis (STREAMS_REDIS_URL); queues on the broker
        self.redis, self.broker, self.settings = client, broker, settings
        self.hostname, self.instance = hostname, instance
        self.queue = worker_queue(settings.queues.queue, hostname) if settings.queues.affinity else None
        self._move = broker.register_script(MOVE_QUEUED)
        self._forget_fair = broker.register_script(FORGET_FAIR)
        self._release = Release(broker)
        self._seen_waiting: set[str] = set()  # other own queues found non-empty by the last poll
        self._gone: dict[str, float] = {}  # own queues of lapsed leases -> since when (monotonic)
        self.stolen = 0  # messages this worker took from other workers' queues
        self.drained = 0  # messages it moved from dead workers' queues to the shared one
        self.idle_queued_s = 0.0  # about how long it held no job while some queue it takes from had one

    def register(self) -> None:
        if self.queue is not None:
            entry = {"queue": self.settings.queues.queue, "instance": self.instance, "hostname": self.hostname}
            self.redis.hset(WORKER_QUEUES, self.queue, json.dumps(entry))

    def move(self, source: str, dest: str, most: int = 0) -> int:
        """Move up to `most` (0: all) waiting jobs from `source` to `dest`, the oldest first: its
        lists' messages, then its staged jobs (FAIR_QUEUE), released into `dest`'s lists."""
        moved = int(self._move(keys=[*priority_queues(source), *priority_queues(dest)], args=[most]))
        if most and moved >= most:
            return moved
        left = most - moved if most else EVERYTHING
        return moved + self._release(dest, [source], left, count_waiting=False).jobs

    def drain_dead(self) -> int:
        """Move the queues of workers whose lease lapsed to the shared queue; forget those that are
        empty, whose worker no client routes to any more (no fresh heartbeat), lapsed for longer than
        a message restored to them could take to come back."""
        queues = {q: e for q, e in own_queues(self.redis, self.settings.queues.queue).items() if q != self.queue}
        if not queues:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for entry in queues.values():
            pipe.exists(lease_key(entry.get("instance", "")))
        leased = pipe.execute()
        moved, now = 0, time.monotonic()
        status = list(zip(queues.items(), leased, strict=True))
        self._gone = {q: self._gone.get(q, now) for (q, _), alive in status if not alive}
        live = read_live_workers(self.redis) if self._gone else {}
        for (q, entry), alive in status:
            if alive:
                continue  # alive (or paused: its lease is renewed by a thread of its own)
            n = self.move(q, self.settings.queues.queue)
            if n:
                log.warning("worker %s is gone: %d jobs of its queue go to the shared queue", entry.get("hostname"), n)
            moved += n
            routed = live.get(entry.get("hostname", ""), {})
            # forgotten once no client routes there (no fresh heartbeat) and no restore can target it: kombu's
            # own transport (rediss://, unix sockets) restores to the queue a message was sent to
            w = self.settings.worker
            settled = now - self._gone[q] > w.visibility_timeout_s + 2 * w.lease_ttl_s
            if settled and routed.get("own_queue") != q and not waiting_counts(self.broker, [q])[0]:
                self.redis.hdel(WORKER_QUEUES, q)
                self._forget_fair(keys=[fair_key(q)])
                del self._gone[q]
        self.drained += moved
        return moved

    def steal(self, room: int, idle: bool = False) -> int:
        """With room for `room` more jobs and nothing else to take: take from the fullest other own
        queue that was non-empty at the last poll too. Returns the messages moved here. `idle` (the
        worker holds no job) counts the time it idles while work waits (`idle_queued_s`)."""
        if self.queue is None or (room <= 0 and not idle):
            return 0
        others = [q for q in own_queues(self.redis, self.settings.queues.queue) if q != self.queue]
        if not others and not idle:  # a lone worker, busy: nothing to steal and no idle time to count
            self._seen_waiting.clear()
            return 0
        mine, shared, *theirs = waiting_counts(self.broker, [self.queue, self.settings.queues.queue, *others])
        if idle and (mine or shared or any(theirs)):
            self.idle_queued_s += STEAL_POLL_S
        if room <= 0 or mine or shared:
            self._seen_waiting.clear()
            return 0
        backlogged = {q: n for q, n in zip(others, theirs, strict=True) if n}
        seen, self._seen_waiting = self._seen_waiting, set(backlogged)
        candidates = [q for q in backlogged if q in seen]
        if not candidates:
            return 0
        victim = max(candidates, key=lambda q: backlogged[q])
        n = self.move(victim, self.queue, min(room, max(1, backlogged[victim] // 2)))
        self.stolen += n
        return n


def steal_loop(affinity: Affinity, room: Callable[[], int], idle: Callable[[], bool], stop) -> None:
    while not stop.wait(STEAL_POLL_S):
        affinity.steal(room(), idle())
