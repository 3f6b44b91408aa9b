"""A worker's lease: how the others know it is alive, and which messages it holds.

Each worker process is an *instance* (its hostname and a random suffix: a worker restarted under the
same name is another instance). Every LEASE_TTL_S / 4 it renews `weightq:lease:{instance}` (expiring
after LEASE_TTL_S), lists itself in `weightq:leases` and updates `weightq:held:{instance}`, the
delivery tags of the messages it holds. Its Redis connections carry the instance in their client
name, so a worker whose lease lapsed while it is paused (a long GC pause, a stalled step, SIGSTOP)
still shows as connected, unlike a dead one (reaper.py).

The lease itself lives on the token plane's home; with several shards each also keeps the list of
instances and their held tags, because BEGIN (run on the shard of the job's keys) reads them there."""

from __future__ import annotations

import uuid

import redis
from weightq.settings import WorkerSettings
from weightq.tasks.contract import INSTANCE_SETS_TTL_S, LEASES, held_key, lease_key
from weightq.token_plane import TokenPlane

CLIENT_PREFIX = "weightq-worker:"  # a worker's Redis connections are named this and its instance


def new_instance(hostname: str) -> str:
    return f"{hostname}/{uuid.uuid4().hex[:12]}"


def client_name(instance: str) -> str:
    """The name of the instance's Redis connections (CLIENT SETNAME allows no spaces)."""
    return CLIENT_PREFIX + instance.replace(" ", "_")


class WorkerLease:
    def __init__(self, plane: TokenPlane, conf: WorkerSettings, hostname: str, instance: str) -> None:
        self.plane, self.hostname, self.instance = plane, hostname, instance
        self.ttl_ms = max(1, int(conf.lease_ttl_s * 1000))
        self.renew_s = conf.lease_ttl_s / 4
        self._held: set[str] = set()  # the tags as last written

    def renew(self, held: set[str]) -> None:
        """The lease for another LEASE_TTL_S, and the tags held now (those added or gone since the last
        renewal: BEGIN adds a started job's tag itself, which a renewal must not remove)."""
        key = held_key(self.instance)
        added, gone = held - self._held, self._held - held
        failed: redis.RedisError | None = None
        for shard in self.plane.shards:  # a shard that is down does not keep the others from the renewal
            pipe = shard.pipeline(transaction=True)
            if shard is self.plane.home:
                pipe.set(lease_key(self.instance), self.hostname, px=self.ttl_ms)
            pipe.hset(LEASES, self.instance, self.hostname)
            if added:
                pipe.sadd(key, *added)
            if gone:
                pipe.srem(key, *gone)
            pipe.expire(key, INSTANCE_SETS_TTL_S)
            try:
                pipe.execute()
            except redis.RedisError as e:
                failed = e
        if failed is not None:
            raise failed  # the same changes go to every shard again at the next renewal
        self._held = held
