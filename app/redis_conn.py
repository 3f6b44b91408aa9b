"""How every part of weightq opens Redis, so that one REDIS_URL serves a plain server, TLS, a unix
socket or a Sentinel-managed group alike; STREAMS_REDIS_URL, when set, takes the token streams and job
state (every weightq:* key) to another server in any of these forms (README, "The token plane").

Sentinel URLs are kombu's and Celery's own form, so the same value configures the broker, the result
backend and weightq's clients:

    sentinel://[:password@]host:26379[/db][;sentinel://host2:26379...]   (REDIS_SENTINEL_MASTER names the group)

The password is the data servers'; REDIS_SENTINEL_PASSWORD, if the sentinels need one. A connection
asks the sentinels for the master when it (re)connects, so after a failover each client finds the new
master at its next connection error, or at a write the replicas did not confirm (see `durable`).

Replication is asynchronous: a write the master acknowledged can be lost if it fails over before a
replica has it. REDIS_WAIT_REPLICAS=N makes weightq's own state writes (a job's submission, its start,
every batch of stream entries, its end) wait until N replicas have them (Redis WAIT); a write they
do not confirm in time is retried, on the master the sentinels name then. The writes are idempotent,
so a retry never doubles anything (README, "High availability": what each setting closes, measured).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

if TYPE_CHECKING:
    from redis.commands.core import Script

    from .settings import RedisSettings


log = logging.getLogger(__name__)
T = TypeVar("T")


class NotReplicated(redis.ConnectionError):
    """The master applied a write but fewer than REDIS_WAIT_REPLICAS replicas confirmed it in time.
    A ConnectionError, so that every loop that waits out a Redis outage retries it."""


# Replies of a server that is not (or no longer) a writable master with its replicas: a failover in
# progress, or a restart still loading its data. Worth retrying, as a dropped connection is.
# Inside a script the reply comes wrapped ("Error running script ...: -NOREPLICAS ..."): search for it.
_TRANSIENT_REPLY = re.compile(r"(?:^|-)(?:NOREPLICAS|READONLY|LOADING|MASTERDOWN|UNBLOCKED|TRYAGAIN) ")


def is_transient(exc: BaseException) -> bool:
    """A Redis error that a retry (on a fresh connection) can get past."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # kombu and Celery wrap the redis-py error
        seen.add(id(exc))
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)):
            return True
        if isinstance(exc, redis.ResponseError) and _TRANSIENT_REPLY.search(str(exc)):
            return True
        if type(exc).__module__.startswith("kombu") and "OperationalError" in type(exc).__name__:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class FailoverAwareConnection(SentinelManagedConnection):
    """Reads a "not a writable master now" reply (NOREPLICAS, READONLY, ...) as a lost connection:
    the command was refused, not applied, so the reconnect (to whichever server the sentinels name
    now) and retry that redis-py, kombu and Celery do for a lost connection are right for it, where a
    ResponseError would stop Celery's consumer for good."""

    def read_response(self, *args, **kwargs):
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as e:
            if not is_transient(e):
                raise
            self.disconnect()
            raise NotReplicated(f"{e} (reconnecting through the sentinels)") from e


def retrying(op: Callable[[], T], within_s: float, pause_s: float = 0.5) -> T:
    """`op()`, retried after transient errors (a restart, a failover) for up to `within_s` seconds;
    the writes it is used for are idempotent, so a retry after a lost reply doubles nothing."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return op()
        except Exception as e:
            if not is_transient(e) or time.monotonic() > deadline:
                raise
            log.warning("Redis unavailable (%s); retrying", e)
            time.sleep(pause_s)


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None


def redacted(url: str) -> str:
    """The URL with any password replaced, for logs."""
    return re.sub(r"(://[^:/@;]*:)[^@/;]+@", r"\1***@", url)


def is_sentinel(url: str) -> bool:
    return url.startswith("sentinel://")


def parse_sentinel(url: str) -> SentinelTarget:
    """Every `sentinel://host:port` part of a `;`-separated URL; db and credentials from the first
    part that has them (kombu reads them the same way)."""
    hosts: list[tuple[str, int]] = []
    db, username, password = 0, None, None
    for part in filter(None, (p.strip() for p in url.split(";"))):
        u = urlsplit(part)
        if u.scheme != "sentinel" or not u.hostname:
            raise ValueError(f"REDIS_URL: {part!r} is not sentinel://host:port (in {url!r})")
        hosts.append((u.hostname, u.port or 26379))
        if u.path.strip("/"):
            db = int(u.path.strip("/"))
        username = username or (unquote(u.username) if u.username else None)
        password = password or (unquote(u.password) if u.password else None)
    if not hosts:
        raise ValueError(f"REDIS_URL: no sentinel in {url!r}")
    return SentinelTarget(tuple(hosts), db, username, password)


def _sentinel_kwargs(conf: RedisSettings) -> dict:
    kw: dict[str, Any] = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}
    if conf.sentinel_password:
        kw["password"] = conf.sentinel_password
    return kw


class CPacker:
    """Packs a command's arguments in C (hiredis). redis-py's own serializer first runs every argument
    through `Encoder.encode` in Python: a large share of a worker's main-process CPU with many streams
    (each stream-writer script call carries several arguments per token). hiredis writes str
    (UTF-8), bytes, memoryview, int and float as redis-py does; what it refuses (a bool, a bytearray)
    goes the redis-py way, which refuses a bool by name. One instance serves every connection."""

    def __init__(self) -> None:
        from redis._parsers.encoders import Encoder
        from redis.connection import PythonRespSerializer

        self._fallback = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode).pack

    def pack(self, *args: Any) -> list[bytes]:
        head = args[0]
        if (" " in head) if isinstance(head, str) else (b" " in head):  # "CLIENT SETNAME", "XINFO STREAM"
            args = (*head.split(), *args[1:])
        try:
            return [_pack_command(args)]
        except TypeError:
            return self._fallback(*args)


try:
    from hiredis import pack_command as _pack_command

    _PACKER: dict[str, Any] = {"command_packer": CPacker()}
except ImportError:  # redis-py's serializer
    _PACKER = {}


REACH_TIMEOUT_S = 2.0  # to connect, then to answer a PING: a first contact fails within twice this


class RedisUnreachable(redis.ConnectionError):
    """No Redis answers at the URL a client or command was about to use. Raised at the first contact
    (without REDIS_RETRY_S's wait, which is for a Redis that answered once and went away), naming the
    URL, where it came from and the fix."""


def check_reachable(url: str, conf: RedisSettings, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Raise RedisUnreachable unless the server at `url` answers one PING within about `timeout_s`
    (connect, then reply; no retries). A server still loading its data counts as reachable, and so does
    one that refuses the password: the next command raises redis-py's AuthenticationError, which says so."""
    client = connect(url, conf, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except (redis.BusyLoadingError, redis.AuthenticationError):
        return
    except (redis.ConnectionError, redis.TimeoutError, redis.InvalidResponse) as e:  # the last: not a Redis
        raise RedisUnreachable(unreachable_message(url, conf, e)) from e
    finally:
        client.close()


def unreachable_message(url: str, conf: RedisSettings, error: BaseException) -> str:
    """What a person needs when no Redis answers: the URL, why that one, and what to do."""
    fix = "`weightq up` (the whole stack) or `weightq redis` (Redis alone)"
    where = f"cannot reach Redis at {redacted(url)} ({error})"
    # every message starts "cannot reach Redis at ...": a command prefixes its name
    if conf.streams_url and url in conf.streams_urls():
        return f"{where}: it is in STREAMS_REDIS_URL; check that this Redis runs and the URL is right"
    if conf.url:
        if url != conf.url:
            return f"{where}: the URL given to the client; check that Redis runs there"
        return (
            f"{where}: REDIS_URL names it; check that Redis runs there and REDIS_URL is right, or unset "
            "REDIS_URL to use the embedded Redis (`weightq up` or `weightq redis` starts it)"
        )
    record = conf.home / "redis" / "url"
    recorded = record.read_text().strip() if record.exists() else ""
    if url == recorded:
        return (
            f"{where}: REDIS_URL is unset and the embedded Redis recorded in {record} is not running "
            f"(the command that ran it was killed?). Start it with {fix}, or set REDIS_URL to your Redis"
        )
    if not recorded and url == conf.resolved_url():  # the default, as nothing else named a server
        return (
            f"{where}: REDIS_URL is unset and no embedded Redis is running (none recorded in {record}), "
            f"so the default was tried. Set REDIS_URL to your Redis (redis://host:6379/0), or start one here: {fix}"
        )
    return f"{where}: the URL given to the client; check that Redis runs there, or set REDIS_URL"


def connect(url: str, conf: RedisSettings, **kw) -> redis.Redis:
    """A client of the master (whichever server that is now, under Sentinel)."""
    kw = _PACKER | kw
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kw)
    return _master_for(Sentinel, url, conf, connection_class=FailoverAwareConnection, **kw)


def connect_streams(conf: RedisSettings, broker_url: str | None = None, **kw) -> redis.Redis:
    """A client of the token plane's home (the heartbeats, leases and LoRA keys): STREAMS_REDIS_URL's
    first server, else the broker's (`broker_url`, default REDIS_URL). A job's keys: TokenPlane."""
    return connect(conf.streams_urls(broker_url)[0], conf, **kw)


def connect_async(url: str, conf: RedisSettings, **kw) -> aredis.Redis:
    """The asyncio client of the master (the gateway's stream reads)."""
    if not is_sentinel(url):
        return aredis.Redis.from_url(url, **kw)
    return _master_for(AsyncSentinel, url, conf, **kw)


def _master_for(sentinel_class, url: str, conf: RedisSettings, **kw):
    t = parse_sentinel(url)
    sentinel = sentinel_class(list(t.sentinels), sentinel_kwargs=_sentinel_kwargs(conf))
    # STREAMS_REDIS_URL may name another group, watched by the same sentinels or others
    shards = conf.streams_urls() if conf.streams_url else []
    master = conf.streams_master() if url in shards else conf.sentinel_master
    return sentinel.master_for(master, db=t.db, username=t.username, password=t.password, **kw)


def celery_options(url: str, conf: RedisSettings) -> dict:
    """Broker and result-backend options that a Sentinel URL needs (none for the others)."""
    if not is_sentinel(url):
        return {}
    opts: dict[str, Any] = {"master_name": conf.sentinel_master}
    if conf.sentinel_password:
        opts["sentinel_kwargs"] = {"password": conf.sentinel_password}
    return {"broker_transport_options": opts, "result_backend_transport_options": dict(opts)}


def raw_xread(client: redis.Redis | aredis.Redis) -> None:
    """This client's XREAD returns Redis' reply as hiredis parsed it, without redis-py's reshaping in
    Python: for a reader following hundreds of streams that is a large share of an XREAD, each
    token's entry rebuilt as a tuple and a dict. Read it with `xread_streams`."""
    client.set_response_callback("XREAD", _as_is)


def _as_is(response: Any, **options: Any) -> Any:
    return response


def xread_streams(response: Any) -> list:
    """A raw XREAD reply as [(stream key, [(entry id, [field, value, ...]), ...]), ...]: a map under
    RESP3, a list of pairs under RESP2; [] when nothing came (Redis replies nil)."""
    if not response:
        return []
    return list(response.items()) if isinstance(response, dict) else response


class Durable:
    """Runs a state-changing script and, when REDIS_WAIT_REPLICAS asks for it, waits on the same
    connection (WAIT counts the writes of its own connection) until the replicas have it.

    "all" waits for every replica the sentinels see up (a plain URL: every replica connected now). In a
    failover only one replica is promoted, so a write all of them hold survives it whichever is chosen;
    a write that only some hold is refused here and retried on the master the sentinels name next.
    A replica that dies stops counting once the sentinels mark it down."""

    REFRESH_S = 2.0  # how often "all" recounts the replicas (and after each unconfirmed write)

    def __init__(self, client: redis.Redis, replicas: int | str, timeout_ms: int) -> None:
        self.client, self.timeout_ms = client, timeout_ms
        self.all = replicas == "all"
        self.replicas = 0 if self.all else int(replicas)
        self._counted_at = float("-inf")

    def needed(self) -> int:
        if self.all and time.monotonic() - self._counted_at > self.REFRESH_S:
            self.replicas = self._count_replicas()
            self._counted_at = time.monotonic()
        return self.replicas

    def _count_replicas(self) -> int:
        pool = self.client.connection_pool
        manager = getattr(pool, "sentinel_manager", None)
        try:
            if manager is not None:
                return len(manager.discover_slaves(pool.service_name))
            return int(self.client.info("replication").get("connected_slaves", 0))
        except redis.RedisError:
            return max(self.replicas, 1)  # cannot tell now: ask for at least one, retry counting soon

    def run(self, script: Script, keys: list, args: list) -> Any:
        return self.run_many(script, [(keys, args)])[0]

    def run_many(self, script: Script, calls: list[tuple[list, list]]) -> list[Any]:
        """The script once per (keys, args), in one round trip and, when asked, under one WAIT."""
        needed = self.needed()
        try:
            if needed <= 0 and len(calls) == 1:
                return [script(keys=calls[0][0], args=calls[0][1], client=self.client)]
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                script(keys=keys, args=args, client=pipe)
            if needed > 0:
                pipe.execute_command("WAIT", needed, self.timeout_ms)
            replies = pipe.execute()
        except redis.ResponseError as e:  # NOREPLICAS, READONLY...: retried as a lost connection is
            if not is_transient(e):
                raise
            self._reconnect()
            raise NotReplicated(str(e)) from e
        if needed <= 0:
            return replies
        *results, acked = replies
        if acked < needed:
            self._reconnect()
            raise NotReplicated(f"a write reached {acked} of the {needed} replicas REDIS_WAIT_REPLICAS asks for")
        return results

    def _reconnect(self) -> None:
        # Most likely a failover: this server is no longer the master, or lost its replicas. Idle
        # connections reconnect through the sentinels (with a plain URL, to the same server: no harm).
        self._counted_at = float("-inf")
        self.client.connection_pool.disconnect(inuse_connections=False)
