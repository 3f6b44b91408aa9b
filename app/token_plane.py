"""The token plane's Redis servers: one, or several shards (STREAMS_REDIS_URL's comma-separated list).

A job's stream and hash live on the shard its id names or hashes to (tasks/contract.py: `shard_of`), beside that
shard's own index keys (queued, resuming, dead-lettered, started high-water marks, engine-jobs and held
sets, a copy of the leases, the stream tick). So every Lua script of the contract runs on one server and
stays atomic, a job's writes and reads go to one server, and each shard carries only its jobs' tokens:
adding a shard adds its capacity. The pool's own keys (heartbeats, leases, worker queues, LoRA, the
recovery lock) live on the first server, the home. The id says where its keys are, so no directory is
needed: an id drawn here names its shard (`on_shard`), and a shard added to the end of the list moves
none of them; an id of the caller's own is hashed, as Redis Cluster hashes keys to slots, and moves when
the list grows (README, "The token plane": adding a shard, in order).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from weightq.redis_conn import Durable, connect
from weightq.settings import RedisSettings
from weightq.tasks.contract import on_shard, shard_of


class TokenPlane:
    """Clients of each shard (home first), and the Durable writer of each (REDIS_WAIT_REPLICAS)."""

    def __init__(self, clients: list[redis.Redis], conf: RedisSettings) -> None:
        if not clients:
            raise ValueError("STREAMS_REDIS_URL: the token plane needs at least one Redis")
        self.shards = clients
        self.home = clients[0]
        self.durables = [Durable(c, conf.wait_replicas, conf.wait_timeout_ms) for c in clients]

    @classmethod
    def connect(cls, conf: RedisSettings, broker_url: str | None = None, **kw) -> TokenPlane:
        return cls([connect(url, conf, **kw) for url in conf.streams_urls(broker_url)], conf)

    def __len__(self) -> int:
        return len(self.shards)

    def index(self, job_id: str) -> int:
        return shard_of(job_id, len(self.shards))

    def new_id(self, span: tuple[float, float] | None = None, name: str | None = None) -> str:
        """A fresh job id (or `name`, made an id), on a shard drawn from `span` (a range of shard
        positions, `Router.shard_span`) when there are several, else from all: the jobs a worker is
        sent then live on one or two shards, so each of its writes goes to few servers, and a shard's
        writes come from its share of the workers (the per-write cost, not only the per-token one,
        divides by the shards). A hint, not a rule: any worker can run any job, on whatever shard its
        id names. On several shards the id names its shard, so adding one moves no job (`shard_of`)."""
        job_id = name or uuid.uuid4().hex
        n = len(self.shards)
        if n == 1:
            return job_id
        lo, hi = span if span is not None else (0, n)
        return on_shard(job_id, min(n - 1, int(lo + random.random() * (hi - lo))))

    def of(self, job_id: str) -> redis.Redis:
        """The client of the shard that holds the job's keys."""
        return self.shards[shard_of(job_id, len(self.shards))]

    def durable(self, job_id: str) -> Durable:
        return self.durables[shard_of(job_id, len(self.shards))]

    def split(self, job_ids: Iterable[str]) -> dict[int, list[str]]:
        """The ids by shard index, each list in the order given."""
        out: dict[int, list[str]] = {}
        for job_id in job_ids:
            out.setdefault(shard_of(job_id, len(self.shards)), []).append(job_id)
        return out

    def each(self, job_ids: Sequence[str], command: Callable[[Any, str], Any]) -> list:
        """`command(pipeline, job_id)` for each job on its shard, one round trip per shard; the replies
        in the order of `job_ids`."""
        replies: list = [None] * len(job_ids)
        positions: dict[int, list[int]] = {}
        for n, job_id in enumerate(job_ids):
            positions.setdefault(shard_of(job_id, len(self.shards)), []).append(n)
        for shard, where in positions.items():
            pipe = self.shards[shard].pipeline(transaction=False)
            for n in where:
                command(pipe, job_ids[n])
            for n, reply in zip(where, pipe.execute(), strict=True):
                replies[n] = reply
        return replies
