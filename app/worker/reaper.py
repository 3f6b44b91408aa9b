"""Resuming the jobs of a worker that died, within seconds rather than kombu's visibility timeout.

Every live worker sweeps the lease registry (lease.py) every LEASE_TTL_S / 4. An instance whose lease
lapsed and that has no connection left in Redis (`CLIENT LIST`, by client name) is dead once a second
sweep, at least `confirm_s` later, finds it so (a Redis restart or failover drops every connection
and may lapse every lease for a moment: live workers reconnect and renew within that time). A worker
that is merely paused keeps its connections: its jobs stay where they are. Where CLIENT LIST is
refused (some managed Redis), the lapsed lease alone decides; the stream fence keeps a paused worker
from writing into a job that resumed elsewhere either way.

The dead instance's jobs: those inside its engine are charged a crash (CHARGE), the others it held
are released uncharged, and every message it held goes back to the head of its queue, under a fresh
delivery tag, with any unacked message no live instance holds (one taken in the instant before the
death). Kombu's visibility timeout stays the last resort (a worker that vanished with its
connections half-open)."""

from __future__ import annotations

import logging
import time

import redis
from kombu.transport import redis as kombu_redis
from weightq.settings import WorkerSettings
from weightq.tasks.contract import CHARGE, LEASES, RESUMING, engine_jobs_key, held_key, job_key, lease_key
from weightq.token_plane import TokenPlane
from weightq.transport import restore_unacked

from .lease import CLIENT_PREFIX, client_name

log = logging.getLogger(__name__)


class Reaper:
    """`plane` reaches the jobs, and on its home the leases and the worker connections that say who
    is alive (the streams' Redis); `broker` the unacked messages it puts back (the same server unless
    STREAMS_REDIS_URL is set). Charging comes first, on each shard, and the dead instance's records go
    last, so a reaper that dies between the servers' steps leaves the instance for the next one to finish."""

    def __init__(self, plane: TokenPlane, broker: redis.Redis, conf: WorkerSettings, instance: str) -> None:
        self.plane, self.redis, self.broker, self.instance = plane, plane.home, broker, instance
        self.interval_s = conf.lease_ttl_s / 4
        self.confirm_s = max(1.0, conf.lease_ttl_s / 2)
        self._charge = plane.home.register_script(CHARGE)
        self._suspects: dict[str, float] = {}  # instance -> when it was first seen lapsed and unconnected
        self._client_list = True  # False once the server refused CLIENT LIST

    def sweep(self) -> list[str]:
        """Reap the instances found dead; returns the ids of the jobs sent back to the queue."""
        r = self.redis
        others = [i.decode() for i in r.hkeys(LEASES) if i.decode() != self.instance]
        if not others:
            self._suspects.clear()
            return []
        pipe = r.pipeline(transaction=False)
        for instance in others:
            pipe.exists(lease_key(instance))
        lapsed = [i for i, live in zip(others, pipe.execute(), strict=True) if not live]
        connected = self._connected() if lapsed else set()
        now = time.monotonic()
        self._suspects = {i: self._suspects.get(i, now) for i in lapsed if client_name(i) not in connected}
        resumed: list[str] = []
        for instance, since in list(self._suspects.items()):
            if now - since >= self.confirm_s:
                resumed += self.reap(instance)
                del self._suspects[instance]
        return resumed

    def _connected(self) -> set[str]:
        """The client names of worker connections open in Redis (alive, if perhaps paused)."""
        if not self._client_list:
            return set()
        try:
            clients = self.redis.client_list()
        except redis.ResponseError as e:
            log.warning("CLIENT LIST refused (%s): a lapsed lease alone marks a worker dead", e)
            self._client_list = False
            return set()
        return {c["name"] for c in clients if c.get("name", "").startswith(CLIENT_PREFIX)}

    def _orphans(self) -> list[str]:
        """Unacked messages that no live instance holds, delivered over LEASE_TTL_S ago: those a dead
        worker took in its last instant, before its lease renewal could list them (a burst of jobs
        taken with a poison one that crashed the worker at once). A live worker lists its messages
        within LEASE_TTL_S / 4."""
        r = self.redis
        old = self.broker.zrangebyscore(
            kombu_redis.Channel.unacked_index_key, "-inf", time.time() - 4 * self.interval_s
        )
        if not old:
            return []
        instances = [i.decode() for i in r.hkeys(LEASES)]
        keys = [held_key(i) for i in instances]
        live = {t for shard in self.plane.shards for t in shard.sunion(keys)} if instances else set()
        return [t.decode() for t in old if t not in live]

    def reap(self, instance: str) -> list[str]:
        """Charge and release the dead instance's jobs, and put every message it held back (with the
        orphans: jobs among them that it had begun are released too)."""
        shards = self.plane.shards
        inside = {j.decode() for shard in shards for j in shard.smembers(engine_jobs_key(instance))}
        tags = sorted({t.decode() for shard in shards for t in shard.smembers(held_key(instance))}) + self._orphans()
        held = set()
        for raw in self.broker.hmget(kombu_redis.Channel.unacked_key, tags) if tags else []:
            if raw is not None:
                held.add(kombu_redis.loads(kombu_redis.bytes_to_str(raw))[0].get("headers", {}).get("id"))
        jobs = sorted(inside) + sorted(held - inside - {None})
        charged = []
        for shard, ids in self.plane.split(jobs).items():  # each shard charges the jobs it holds
            flags = [x for j in ids for x in (int(j in inside), j)]
            keys = [RESUMING, *(job_key(j) for j in ids)]
            charged += self._charge(keys=keys, args=[instance, *flags], client=shards[shard])
        resumed = restore_unacked(self.broker, tags)
        for shard in [*shards[1:], shards[0]]:  # the home last: until then the next sweep still sees the instance
            shard.pipeline().delete(engine_jobs_key(instance), held_key(instance)).hdel(LEASES, instance).execute()
        log.warning(
            "worker %s is dead: %d of its jobs go back to the queue, %d of them charged with the crash",
            instance,
            len(resumed),
            len(charged),
        )
        return resumed
