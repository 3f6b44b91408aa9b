"""Which queue a job is sent to (AFFINITY): the own queue of the worker its prompt's prefix hashes to
(tasks/affinity.py), or the shared queue every worker of QUEUE takes from.

Hashing alone spreads distinct prompts unevenly (by chance some workers get many more than others), and
the busiest worker (and its token-plane shard) sets the pace. So the choice is a bounded-load rendezvous
(consistent hashing with bounded loads, Mirrokni et al.): a worker takes a job while its backlog is
under (1 + AFFINITY_SLACK) x the mean of the workers that could take it, this job counted, and never
less than BALANCE_FLOOR; past that the job goes to the next worker in its key's order. The jobs of one
submission that share a prefix move together (a group goes where it fits whole, or stays with its
prefix's worker when it fits nowhere), so a prefix is not split over two workers' caches; only the
excess moves, and at a light load (a backlog under the floor) affinity is never traded for balance.

The live workers come from their heartbeats (those that advertise an own queue on this QUEUE), read at
most once a second. A job goes to the shared queue when no such worker is known, or when the chosen
worker's own queue already holds AFFINITY_BACKLOG jobs (counted in one round trip per submission,
with the jobs of this submission): a hot prefix then spreads over every worker with room. Jobs left
waiting in a busy worker's queue are not stranded: a worker with room and nothing else to do steals
them (app/worker/affinity.py), and a dead worker's queue is moved to the shared one.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence

import redis
from weightq.metrics import read_live_workers
from weightq.settings import QueueSettings
from weightq.tasks.affinity import rendezvous, route_key
from weightq.tasks.request import JobRequest
from weightq.transport import waiting_counts

REFRESH_S = 1.0  # heartbeats come once a second
BALANCE_FLOOR = 16  # a backlog this short is never a reason to send a job away from its prefix's worker


class Router:
    def __init__(self, streams: redis.Redis, broker: redis.Redis, conf: QueueSettings) -> None:
        self.redis, self.broker, self.conf = streams, broker, conf  # heartbeats; the queues
        self._workers: dict[str, str] = {}  # worker name -> its own queue
        self._structured: bool | None = None  # whether a live worker of QUEUE serves `guided` (None: none live)
        self._adapters: dict[str, set[str]] = {}  # LoRA adapter -> the live workers of QUEUE that hold it
        self._read_at = float("-inf")
        self._live = False

    def workers(self) -> dict[str, str]:
        """The live workers of this QUEUE that have an own queue, by name (cached for REFRESH_S)."""
        now = time.monotonic()
        if now - self._read_at >= REFRESH_S:
            live = read_live_workers(self.redis)
            queue = self.conf.queue
            mine = {name: w for name, w in live.items() if w.queue == queue}
            self._workers = {name: w.own_queue for name, w in mine.items() if w.own_queue}
            self._structured = any(w.structured for w in mine.values()) if mine else None
            self._adapters = {}
            for name, w in mine.items():
                for adapter in w.adapters:
                    self._adapters.setdefault(adapter, set()).add(name)
            self._live = bool(mine)
            self._read_at = now
        return self._workers

    def structured(self) -> bool | None:
        """Whether a live worker of this QUEUE can serve structured output (`guided`); None when no
        worker is live (a job then waits for one, as any job does)."""
        self.workers()
        return self._structured

    def adapters(self) -> set[str] | None:
        """The LoRA adapters the live workers of this QUEUE serve (None: no worker is live)."""
        self.workers()
        return set(self._adapters) if self._live else None

    def shard_span(self, queue: str, shards: int) -> tuple[float, float] | None:
        """Where the ids of jobs sent to `queue` should live among `shards` token-plane shards (for
        `TokenPlane.new_id`): the live workers in name order are laid end to end over the shards, the
        i-th of n on [i, i + 1) * shards / n, so each worker writes to one or two shards and each
        shard carries an equal share of the workers. None for the shared queue (any worker takes
        from it) or a queue no live worker owns."""
        workers = self._workers
        if shards < 2 or queue not in workers.values():
            return None
        names = sorted(workers)
        i = next(n for n, name in enumerate(names) if workers[name] == queue)
        per = shards / len(names)
        return i * per, (i + 1) * per

    def queues(self, jobs: Sequence[JobRequest]) -> list[str]:
        """The queue of each job, in order."""
        s = self.conf
        shared = [s.queue] * len(jobs)
        if not s.affinity or not jobs:
            return shared
        workers = self.workers()
        if not workers:
            return shared
        names = sorted(workers)
        backlog = dict(zip(names, waiting_counts(self.broker, [workers[n] for n in names]), strict=True))
        total = sum(backlog.values())
        keys = [route_key(job, s.affinity_prefix_chars, s.prefix_cache_shared) for job in jobs]
        group = Counter(keys)  # the jobs of this submission that share each prefix go together
        placed: dict[bytes, str] = {}
        out = []
        for job, key in zip(jobs, keys, strict=True):
            best = placed.get(key)
            if best is None:
                holders = [n for n in names if n in self._adapters.get(job.adapter, ())] if job.adapter else names
                can = holders or names
                held = total if len(can) == len(names) else sum(backlog[n] for n in can)
                size = group[key]
                cap = max(BALANCE_FLOOR, math.ceil((1 + s.affinity_slack) * (held + size) / len(can)))
                order = rendezvous(key, can)
                # the first worker with room for the whole group; none: its prefix's worker (as hashing alone)
                best = placed[key] = next((n for n in order if backlog[n] + size <= cap), order[0])
            if backlog[best] < s.affinity_backlog:
                total += 1
                backlog[best] += 1
                out.append(workers[best])
            else:
                out.append(s.queue)
        return out
