"""kombu's Redis transport, with weightq's fair staging, batched takes and acks, and survival of a Redis
crash inside a long-lived worker.

- Staged messages (FAIR_QUEUE) go to a sorted set per class (`STAGE`, tasks/queue_scripts.py) instead
  of a list; the worker releases them into the lists in fair order (app/worker/intake.py).
- A consumer takes every message its prefetch allows in one script call after a BRPOP (`TAKE`), and
  acks made on Celery's event loop leave Redis together at the end of its turn (`BatchedQoS`).
- After a broker reconnect, tasks still running hold messages of the old channel: their ack or reject
  is done directly in Redis (the same deletions kombu would make), and restoring unacked messages
  when a channel closes is off (the visibility sweep of whichever worker runs next restores them).

kombu internals this module still touches, and why (tests/app/test_kombu_edges.py fails, naming the
one, when a kombu release changes any of them). Supported: kombu 5.6 and 5.7, each with Celery of its
minor; CI tests the newest, `make test-kombu-prev` the kombu-sensitive tests on 5.6 (`KOMBU_5_7` marks
what goes with 5.6 support):
- `Channel._put`: a staged message is filed by STAGE instead of LPUSH (kombu 5.7 may pass a
  `_publish_batch` pipeline, which the script joins).
- `Channel._brpop_read`: a transient ResponseError (NOREPLICAS, READONLY) becomes a connection error,
  which Celery reconnects after; after a BRPOP, TAKE takes the rest of the prefetch room.
- `Channel._do_restore_message`: a restored message gets a fresh delivery tag and goes back to the
  shared queue (not a worker's own).
- `Channel._q_for_pri`, `Channel.sep`, `priority_steps`, `active_queues`, `_get_message_priority`,
  `global_keyprefix`: the names of a queue's priority lists, which TAKE pops and a stale reject refills.
- `Channel.unacked_key` / `unacked_index_key` and the unacked record ([payload, exchange, routing
  key]): TAKE records what it takes as kombu's QoS.append would, so kombu's own ack, restore and
  visibility sweep keep working on them; the reaper (app/worker/reaper.py) reads them too.
- `Transport._deliver`: a message TAKE took is handed to the consumer as kombu's BRPOP path would.
- `virtual.QoS.ack` / `virtual.QoS.append` (the base class's, past kombu's Redis writes): the prefetch
  room of a batched ack is freed at once, and a message TAKE recorded is not recorded twice.
- `virtual.QoS._delivered` / `_dirty`: what the consumer holds, which the intake counts
  (app/worker/loops.py: pipe_counts, delivered_tags); read from other threads with a retry.
- The event loop's public `on_tick` / `on_close` sets: the batched acks flush at the end of a turn.
- kombu 5.7's public `Producer.batch` (`publish_batch`, for app/client/jobs.py): a submission's messages
  in one pipeline; on 5.6, one round trip per message.
- kombu 5.7's Hub waking its poll when `call_soon` is called from another thread, and sweeping for
  expired unacked messages at `unacked_restore_interval` / `unacked_restore_throttle`. On 5.6,
  `Transport.register_with_event_loop` adds a LoopBackport (a waker on the public `Hub.add_reader`; the
  sweep on `Hub.call_repeatedly`, calling `MultiChannelPoller.maybe_restore_messages`), and
  `QoS.restore_visible(start, num, interval)` is given the throttle.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uuid

import kombu
import redis
from kombu.asynchronous import get_event_loop
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from weightq.tasks.contract import STAGE, fair_key, served_queue, staged_sets, staged_target

from .redis_conn import FailoverAwareConnection, is_transient
from .settings import RedisSettings

log = logging.getLogger(__name__)

# What a staged message carries for its fair order (app/client/jobs.py sets them): whose job it is, and
# its weight in the batcher's units (prompt tokens, estimated, plus new tokens).
TENANT_HEADER = "weightq_tenant"
WEIGHT_HEADER = "weightq_weight"


# kombu 5.6 and 5.7 are supported; what only 5.6 needs is marked by this, and goes with 5.6 support
KOMBU_5_7 = kombu.VERSION[:2] >= (5, 7)

BROKER_OPTION = "weightq_broker"  # the transport option that carries a BrokerClient (celery_config.py)


class BrokerClient:
    """A Redis client of its own for the broker a channel was opened on, from the settings the app was
    configured with (celery_config.py passes it as a transport option): the ack or reject of a message
    whose channel went with an old broker connection. Its repr hides the URL, which may hold a password."""

    def __init__(self, url: str, settings: RedisSettings) -> None:
        self.url, self.settings = url, settings

    def __call__(self) -> redis.Redis:
        from .redis_conn import connect

        return connect(self.url, self.settings, socket_timeout=10)

    def __repr__(self) -> str:
        return "BrokerClient(<the broker's URL>)"

    def __json__(self) -> str:
        """What a worker's stats and conf show of it (kombu's JSON encoder asks for this)."""
        return repr(self)


def _fresh_client(channel) -> redis.Redis:
    if channel.broker_client is None:
        raise RuntimeError(f"the transport option {BROKER_OPTION!r} is unset: configure Celery with celery_config()")
    return channel.broker_client()


# Pop up to ARGV[1] messages from the lists (in order: the most urgent priority first) and record
# each as unacked in the same script: no message is ever out of Redis and unrecorded, unlike
# BRPOP-then-record. The unacked value is kombu's ([payload, exchange, routing key]), the payload
# kept byte for byte (a cjson round trip would turn [null, null] into {}).
TAKE = """
local out = {}
local n = tonumber(ARGV[1])
for i = 3, #KEYS do
  while #out < 2 * n do
    local m = redis.call('RPOP', KEYS[i])
    if not m then break end
    local props = cjson.decode(m)['properties']
    local info = props['delivery_info']
    local tag = props['delivery_tag']
    redis.call('ZADD', KEYS[1], ARGV[2], tag)
    redis.call('HSET', KEYS[2], tag, '[' .. m .. ',' .. cjson.encode(info['exchange']) .. ','
      .. cjson.encode(info['routing_key']) .. ']')
    out[#out + 1] = KEYS[i]
    out[#out + 1] = m
  end
end
return out
"""


class BatchedQoS(kombu_redis.QoS):
    """kombu's QoS, except for messages TAKE already recorded as unacked (no second round trip), and
    acks made on Celery's event loop, which leave Redis together once per turn of the loop.

    kombu acks each message in a transaction of its own (MULTI, ZREM, HDEL, EXEC): a tenth of the
    worker's main-process CPU per short job. A batched ack frees its prefetch room at once, as kombu's
    does; its Redis record goes at the end of the loop's turn (`on_tick`, before it polls again). Should
    the worker die in between, the message comes back after the visibility timeout and its job's BEGIN
    answers with the stored outcome: delivered again, never run again.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.recorded: set[str] = set()
        self._acks: list[str] = []
        self._flushing_on = None  # the event loop whose turns flush the acks
        self._closed_loop = None
        # the thread that consumes this channel's messages (Celery's event loop): an ack made there is
        # flushed at the end of the loop's turn; anywhere else, at once
        self.consumer_thread: int | None = None

    def ack(self, delivery_tag):
        hub = get_event_loop()
        if (
            hub is None
            or hub is self._closed_loop  # acks run as the loop closes: it turns no more
            or self.channel.closed
            or self.consumer_thread != threading.get_ident()  # off the loop: nothing there would flush it
        ):
            return super().ack(delivery_tag)
        if self._flushing_on is not hub:
            hub.on_tick.add(self.flush_acks)
            hub.on_close.add(self._loop_closing)
            self._flushing_on = hub
        self._acks.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)  # its prefetch room, now
        return None

    def flush_acks(self) -> None:
        """The acks of this turn of the loop: one transaction for all of them."""
        if not self._acks:
            return
        tags, self._acks = self._acks, []
        try:
            try:
                with self.pipe_or_acquire() as pipe:
                    forget_unacked(pipe, tags, self.channel.unacked_keys).execute()
            except AttributeError:  # a stale channel (see basic_ack)
                forget_unacked(_fresh_client(self.channel).pipeline(), tags, self.channel.unacked_keys).execute()
        except redis.RedisError as e:  # their messages come back after the visibility timeout, done already
            log.warning("%d acks not recorded in Redis (%s); their jobs' BEGIN will answer a redelivery", len(tags), e)

    def _loop_closing(self, hub) -> None:
        """The loop closes, or resets for a new broker connection (whose channel has a QoS of its
        own): acks go at once from now on, and the loop keeps no reference to this channel."""
        self._closed_loop = hub
        hub.on_tick.discard(self.flush_acks)
        # a new set, not a change of the one the hub may be iterating (kombu 5.6 iterates it, 5.7 a copy)
        hub.on_close = hub.on_close - {self._loop_closing}
        self.flush_acks()

    def restore_visible(self, start=0, num=10, interval=10):
        if not KOMBU_5_7:  # 5.6 passes no throttle: the transport option's, as 5.7 passes it (LoopBackport)
            interval = self.channel.connection.client.transport_options.get("unacked_restore_throttle", interval)
        return super().restore_visible(start, num, interval)

    def restore_unacked_once(self, stderr=None):
        """The channel closes: what this turn acked goes first (the loop may not turn again)."""
        self.flush_acks()
        return super().restore_unacked_once(stderr)

    def append(self, message, delivery_tag):
        if delivery_tag in self.recorded:
            self.recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
        else:
            super().append(message, delivery_tag)


class StaleChannelSafe:
    """The ack and reject of a message whose channel went with an old broker connection; a consumer
    that takes a burst of messages in one round trip instead of one BRPOP each; and restored messages
    under a fresh delivery tag."""

    do_restore = False
    QoS = BatchedQoS
    _take = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # kept now: kombu drops a channel's connection when it closes, before a stale ack needs this
        self.broker_client: BrokerClient | None = self.connection.client.transport_options.get(BROKER_OPTION)

    def _put(self, queue, message, **kwargs):
        """A message sent to a staged name (FAIR_QUEUE) is filed in its target's staged set, with its
        tenant's start tag (STAGE), in the same pipeline as kombu's own publish would be."""
        target = staged_target(queue)
        if target is None:
            return super()._put(queue, message, **kwargs)
        headers = message.get("headers") or {}
        tenant = str(headers.get(TENANT_HEADER) or "")
        try:
            weight = max(1, int(headers.get(WEIGHT_HEADER) or 1))
        except (TypeError, ValueError):
            weight = 1
        pri = self._get_message_priority(message, reverse=False)
        args = (STAGE, 2, staged_sets(target)[pri], fair_key(target), kombu_redis.dumps(message), tenant, weight, pri)
        batch = kwargs.pop("_publish_batch", None)
        if batch is not None:
            batch.add("eval", *args)
            return None
        with self.conn_or_acquire() as client:
            client.eval(*args)
        return None

    def _do_restore_message(self, payload, exchange, routing_key, pipe, leftmost=False):
        # The run the message was taken from may still ack (or reject) its old tag later (a paused
        # worker taken for dead): that must not delete the record of the delivery that replaced it.
        _fresh_tag(payload)
        # a worker's own queue (prefix affinity): back to the shared queue, for any worker to take
        return super()._do_restore_message(payload, exchange, served_queue(routing_key), pipe, leftmost)

    def _brpop_read(self, **options):
        # BRPOP is a write: a master that lost its replicas (min-replicas-to-write) answers
        # NOREPLICAS, and a demoted one READONLY. Celery stops its consumer for good on a ResponseError
        # but reconnects after a connection error, which (under Sentinel) finds the new master.
        try:
            self.qos.consumer_thread = threading.get_ident()
            delivered = super()._brpop_read(**options)
        except redis.ResponseError as e:
            if not is_transient(e):
                raise
            self.client.connection.disconnect()
            raise redis.ConnectionError(f"the broker cannot serve BRPOP now ({e}); reconnecting") from e
        self._take_more()
        return delivered

    def _take_more(self) -> None:
        """After a BRPOP's message, every message the prefetch room allows, in one script call. kombu
        takes one message per BRPOP and records it in a second round trip, all on Celery's consumer
        thread: 256 jobs queued at once waited ~0.5-1 s to start (bench.serve, queued_to_started)."""
        room = self.qos.can_consume_max_estimate()
        if not room or self.global_keyprefix:  # None: no prefetch limit (weightq always sets one)
            return
        if self._take is None:
            self._take = self.client.register_script(TAKE)
        keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in self.active_queues]
        try:
            taken = self._take(keys=[self.unacked_index_key, self.unacked_key, *keys], args=[room, time.time()])
        except redis.RedisError as e:  # the next BRPOP meets the same broker and handles it
            log.warning("taking queued messages in a batch failed: %s", e)
            return
        recorded = self.qos.recorded
        for i in range(0, len(taken), 2):
            dest = kombu_redis.bytes_to_str(taken[i]).rsplit(self.sep, 1)[0]
            payload = kombu_redis.loads(kombu_redis.bytes_to_str(taken[i + 1]))
            recorded.add(payload["properties"]["delivery_tag"])
            self.connection._deliver(payload, dest)

    @property
    def unacked_keys(self) -> tuple[str, str]:
        """This channel's names for kombu's unacked index and messages (`forget_unacked`)."""
        return self.unacked_index_key, self.unacked_key

    def close(self):
        """The acks this loop turn batched go first, on the channel's own connection: kombu's close
        disconnects its pools before it restores unacked messages, and a flush then would open a
        connection of its own and leave it open."""
        if not self.closed and isinstance(self._qos, BatchedQoS):
            self._qos.flush_acks()
        super().close()

    def basic_ack(self, delivery_tag, multiple=False):
        try:
            return super().basic_ack(delivery_tag, multiple)
        except AttributeError:  # a stale channel: its connection went with the old broker connection
            log.warning("acking %s outside its stale channel", delivery_tag)
            forget_unacked(_fresh_client(self).pipeline(), [delivery_tag], self.unacked_keys).execute()

    def basic_reject(self, delivery_tag, requeue=False):
        try:
            return super().basic_reject(delivery_tag, requeue)
        except AttributeError:
            log.warning("rejecting %s outside its stale channel (requeue=%s)", delivery_tag, requeue)
            client = _fresh_client(self)
            raw = client.hget(self.unacked_key, delivery_tag)
            pipe = client.pipeline()
            if requeue and raw is not None:
                message, _, routing_key = kombu_redis.loads(raw)
                priority = self._get_message_priority(message, reverse=False)
                queue = self._q_for_pri(served_queue(routing_key), priority)
                pipe.lpush(queue, kombu_redis.dumps(message))  # the default exchange: key = queue, per priority
            forget_unacked(pipe, [delivery_tag], self.unacked_keys).execute()


# kombu's record of the messages delivered and not yet acked: the message by delivery tag, and the index of
# tags by delivery time that its visibility sweep reads (the same names on every channel)
UNACKED, UNACKED_INDEX = kombu_redis.Channel.unacked_key, kombu_redis.Channel.unacked_index_key


def forget_unacked(pipe, tags: list[str], keys: tuple[str, str] = (UNACKED_INDEX, UNACKED)):
    """Queue on `pipe` the deletions that make delivered messages acked (kombu's own: the index, then
    the message; `keys` a channel's own names for them), for an ack, a reject, or a restore under a
    fresh tag. Returns the pipe."""
    index, unacked = keys
    return pipe.zrem(index, *tags).hdel(unacked, *tags)


def _fresh_tag(payload: dict) -> None:
    with contextlib.suppress(KeyError, TypeError):
        payload["properties"]["delivery_tag"] = str(uuid.uuid4())


def publish_batch(producer, max_size: int):
    """A context in which `producer`'s publishes leave Redis in one pipeline (kombu 5.7's public
    `Producer.batch`, which `StaleChannelSafe._put` joins). kombu 5.6 has no batch: there each publish
    is a round trip of its own. The fallback goes when kombu 5.6 is no longer supported."""
    if not KOMBU_5_7:
        return contextlib.nullcontext()
    return producer.batch(max_size=max_size)


def restore_unacked(client: redis.Redis, tags: list[str]) -> list[str]:
    """Put the unacked messages with these delivery tags back at the head of their queue lists (as
    kombu restores the messages a visibility timeout expired), each under a fresh tag; returns the
    task ids restored. Each in a WATCH transaction: two workers restoring one tag restore it once."""
    restored = []
    for tag in tags:

        def restore(pipe, tag=tag):
            raw = pipe.hget(UNACKED, tag)
            pipe.multi()
            forget_unacked(pipe, [tag])
            if raw is None:
                return None  # acked, or restored already
            message, _, routing_key = kombu_redis.loads(kombu_redis.bytes_to_str(raw))
            with contextlib.suppress(KeyError, TypeError):
                message["headers"]["redelivered"] = True
                message["properties"]["delivery_info"]["redelivered"] = True
            _fresh_tag(message)
            try:
                priority = min(max(int(message["properties"]["priority"]), 0), 9)
            except (KeyError, TypeError, ValueError):
                priority = 0
            # taken next; a worker's own queue's message goes to the shared queue, for any worker
            pipe.rpush(priority_queues(served_queue(routing_key))[priority], kombu_redis.dumps(message))
            return message.get("headers", {}).get("id") or tag

        job = client.transaction(restore, UNACKED, value_from_callable=True)
        if job is not None:
            restored.append(job)
    return restored


def priority_queues(queue: str) -> list[str]:
    """The Redis lists of a queue, one per message priority (celery_config.py: priority_steps 0-9), in
    the order kombu takes them: priority 0 (the most urgent class, tasks/limits.py: broker_priority)
    first."""
    return [queue] + [f"{queue}{kombu_redis.Channel.sep}{p}" for p in range(1, 10)]


def waiting_by_priority(client: redis.Redis, queues: list[str]) -> list[list[int]]:
    """Jobs waiting for each queue, per broker priority (index 0: the most urgent class): its lists
    and its staged sets (FAIR_QUEUE) together, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for q in queues:
        for key in priority_queues(q):
            pipe.llen(key)
        for key in staged_sets(q):
            pipe.zcard(key)
    counts, n = pipe.execute(), len(priority_queues(""))
    out = []
    for i in range(len(queues)):
        lists, staged = counts[2 * i * n : (2 * i + 1) * n], counts[(2 * i + 1) * n : (2 * i + 2) * n]
        out.append([a + b for a, b in zip(lists, staged, strict=True)])
    return out


def waiting_counts(client: redis.Redis, queues: list[str]) -> list[int]:
    """Jobs waiting for each queue (all its priority lists and staged sets), in one round trip."""
    return [sum(by_priority) for by_priority in waiting_by_priority(client, queues)]


class Channel(StaleChannelSafe, kombu_redis.Channel):
    pass


class SentinelChannel(StaleChannelSafe, kombu_redis.SentinelChannel):
    """The same under Sentinel, where a failover is exactly such a reconnect."""

    connection_class = FailoverAwareConnection


# What kombu 5.7 does for Celery's event loop and 5.6 does not: 5.7's Hub.call_soon, called from another
# thread, ends the loop's poll (on 5.6 the intake's wake after a release waited for the poll's timeout,
# up to seconds, while another worker stole the released jobs), and 5.7 sweeps for expired unacked
# messages every `unacked_restore_interval` s, scanning every `unacked_restore_throttle`-th time (5.6
# ignores both: a sweep every 10 s, a scan every 100 s). LoopBackport gives a 5.6 hub both; it goes when
# kombu 5.6 is no longer supported.
BACKPORT_ATTR = "weightq_backport"  # where a hub of kombu 5.6 keeps its LoopBackport


class LoopBackport:
    """A socket pair whose reading end the event loop watches (public `Hub.add_reader`): a byte
    written from any thread ends the loop's poll. And the loop's visibility sweep, at the interval
    the transport options ask for."""

    def __init__(self, hub) -> None:
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)
        hub.add_reader(self.reader, self._drain)
        self.sweep = None  # the timer entry of the visibility sweep

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # closed with its hub meanwhile, or a wake already pending
            self.writer.send(b"\0")

    def sweep_every(self, hub, seconds: float, sweep) -> None:
        """The sweep of the transport connected last (a reconnect replaces the old one's)."""
        if self.sweep is not None:
            self.sweep.cancel()
        self.sweep = hub.call_repeatedly(seconds, sweep)

    def _drain(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.recv(4096)

    def close(self) -> None:
        if self.sweep is not None:
            self.sweep.cancel()
        self.reader.close()
        self.writer.close()


def backport_loop(hub) -> LoopBackport | None:
    """`hub`'s LoopBackport on kombu 5.6, made on the loop's own thread the first time; None on 5.7."""
    if KOMBU_5_7:
        return None
    backport = getattr(hub, BACKPORT_ATTR, None)
    if backport is None:
        backport = LoopBackport(hub)
        setattr(hub, BACKPORT_ATTR, backport)
        hub.on_close.add(_close_backport)  # the same function each time: in the set once
    return backport


def _close_backport(hub) -> None:
    """The hub closes (or resets, for a new broker connection): its readers are gone, and so goes the
    backport; `register_with_event_loop` makes a new one with the new connection."""
    backport = hub.__dict__.pop(BACKPORT_ATTR, None)
    if backport is not None:
        backport.close()


def wake_poller(hub) -> None:
    """From any thread: end `hub`'s current poll, so that the callbacks queued with `call_soon` run
    now. Nothing on kombu 5.7, whose `call_soon` does it. A 5.6 hub without a backport yet (kombu's own
    transport, for rediss:// and unix sockets) gets one at its next turn."""
    if KOMBU_5_7:
        return
    backport = getattr(hub, BACKPORT_ATTR, None)
    if backport is None:
        hub.call_soon(backport_loop, hub)
    else:
        backport.wake()


def _register_backport(transport, connection, loop) -> None:
    backport = backport_loop(loop)  # on the loop's thread, before it first polls
    if backport is not None:
        interval = connection.client.transport_options.get("unacked_restore_interval", 10)
        backport.sweep_every(loop, interval, transport.cycle.maybe_restore_messages)


class Transport(kombu_redis.Transport):
    Channel = Channel

    def register_with_event_loop(self, connection, loop):
        super().register_with_event_loop(connection, loop)
        _register_backport(self, connection, loop)


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel

    def register_with_event_loop(self, connection, loop):
        super().register_with_event_loop(connection, loop)
        _register_backport(self, connection, loop)
