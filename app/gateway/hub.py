"""Many token streams read over one Redis connection, for asyncio servers (the HTTP gateway).

A blocked XREAD per HTTP client would need a Redis connection per client; the hub instead keeps one
reader task that XREADs every followed stream at once and hands entries to each follower.
Between reads it blocks on the workers' STREAM_TICK stream (one entry per batch they write), not on every
followed stream, and takes what each tick carries (tasks/ticks.py: the entries of the batch): a followed
stream is read only where a tick cannot stand in for it (a follower not where the batch begins, an
entry written without a tick), so Redis sends each entry once per gateway, not once per stream read.
A follower that registers while the hub waits is picked up on the next round (the wait is short),
and it reads from its own `last_id`, so nothing written before it registered is missed.
A stream may have several followers (a client resuming a stream that is still live): the hub reads it
from the earliest of their positions and gives each what lies past its own.
With a sharded token plane (STREAMS_REDIS_URL lists several servers) the hub reads each shard in a
loop of its own, over a connection of its own, and a follower joins the shard its job lives on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aredis
from weightq.redis_conn import connect_async, raw_xread, xread_streams
from weightq.settings import RedisSettings
from weightq.tasks.contract import STREAM_TICK, TICKS_KEPT, is_end, shard_of, stream_key, tick_entries, tick_streams

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Follower:
    """What the hub handed one follower and it has not taken yet. A list and one future for the wait,
    not an asyncio.Queue: a put and a get per entry cost more than the rest of the hand-over."""

    last_id: str
    idle_s: float | None  # None: no timeout, or its TimeoutError is already given
    seen: float  # loop time of its registration or last entry
    items: list = field(default_factory=list)  # (entry id, fields), and an exception to raise last
    waiter: asyncio.Future | None = None  # set while the follower waits for items

    def give(self, items: list) -> None:
        self.items += items
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


@dataclass(slots=True, eq=False)
class _Shard:
    redis: aredis.Redis
    followers: dict[str, list[_Follower]]  # by stream key
    wake: asyncio.Event
    fresh: set[str] = field(default_factory=set)  # streams followed since the last read: read them next


FULL_EVERY_S = 0.25  # every followed stream is read at least this often (entries written without a tick)
RETRY_S = 0.5  # the pause before reading again after a Redis error
# hiredis decodes the replies in C (decoding them in Python, redis-py's way or per field, is much of the hub's time);
# a token's text is the worker's valid UTF-8, and anything else becomes U+FFFD rather than an error
HUB_CONNECTION = {"socket_timeout": 30, "health_check_interval": 10, "decode_responses": True,
                  "encoding_errors": "replace"}  # fmt: skip


class StreamHub:
    def __init__(self, urls: list[str], conf: RedisSettings, *, block_ms: int = 20, count: int = 256) -> None:
        self._shards = [_Shard(connect_async(url, conf, **HUB_CONNECTION), {}, asyncio.Event()) for url in urls]
        for shard in self._shards:
            raw_xread(shard.redis)
        self.block_ms = block_ms
        self.count = count
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    async def start(self) -> None:
        self._tasks = [
            *(asyncio.create_task(self._read_loop(s), name=f"weightq-hub-{n}") for n, s in enumerate(self._shards)),
            asyncio.create_task(self._watch_idle(), name="weightq-hub-idle"),
        ]

    async def close(self) -> None:
        """Stops both tasks. A cancel alone is not enough: one that lands inside redis-py's XREAD can be
        swallowed there, and the read loop would then wait on `_wake` for good; the flag ends the loops
        at their next turn either way."""
        self._closing = True
        for shard in self._shards:
            shard.wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for shard in self._shards:
            await shard.redis.aclose()

    @property
    def following(self) -> int:
        return sum(len(fs) for shard in self._shards for fs in shard.followers.values())

    async def follow_batches(
        self, job_id: str, last_id: str = "0-0", idle_timeout_s: float | None = None
    ) -> AsyncIterator[list[tuple[str, dict[str, str]]]]:
        """(entry id, fields) of the job's stream after `last_id`, through its end or error entry, as
        lists of all that have arrived by the time the follower looks: a follower that falls behind
        catches up in one write per batch, not one per token. Raises TimeoutError when nothing arrives
        for `idle_timeout_s` (give or take a quarter of it: one watchdog checks every follower, where
        a timer per wait would cost the gateway time on every token)."""
        key = stream_key(job_id)
        me = _Follower(last_id, idle_timeout_s, asyncio.get_running_loop().time())
        shard = self._shards[shard_of(job_id, len(self._shards))]
        shard.followers.setdefault(key, []).append(me)
        shard.fresh.add(key)
        shard.wake.set()
        try:
            while True:
                batch = await me.take()
                for n, item in enumerate(batch):
                    if isinstance(item, BaseException):
                        if n:
                            yield batch[:n]
                        raise item
                    if is_end(item[1]):
                        yield batch[: n + 1]
                        return
                yield batch
        finally:
            others = [f for f in shard.followers.get(key, ()) if f is not me]
            if others:
                shard.followers[key] = others
            else:
                shard.followers.pop(key, None)

    async def _watch_idle(self) -> None:
        """Ends with TimeoutError every follower that heard nothing for its idle timeout."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            followers = [f for shard in self._shards for fs in shard.followers.values() for f in fs]
            timeouts = [f.idle_s for f in followers if f.idle_s is not None]
            await asyncio.sleep(max(0.01, min(0.5, *(t / 4 for t in timeouts))) if timeouts else 0.5)
            now = loop.time()
            for f in followers:
                if f.idle_s is not None and now - f.seen > f.idle_s:
                    f.idle_s = None  # told once
                    f.give([TimeoutError()])

    async def _read_loop(self, shard: _Shard) -> None:
        """Reads the followed streams that the ticks since the last read name and could not stand in
        for (and new followers'), then waits for the next tick or block_ms, whichever comes first.
        Every followed stream is read when the ticks may have been trimmed, and every FULL_EVERY_S:
        entries that other writers add without a tick (a task's attempt marker, a client's cancel of a
        queued job) arrive within that.
        A wait that ends with no tick reads nothing: reading every stream then (every block_ms between
        a worker's writes) would spend Redis' time on reads that find nothing new."""
        loop = asyncio.get_running_loop()
        tick, named, everything, last_full = "0-0", set(), True, 0.0
        while not self._closing:
            if not shard.followers:
                shard.wake.clear()
                await shard.wake.wait()
                continue
            now = loop.time()
            if everything or now - last_full >= FULL_EVERY_S:
                keys, everything, last_full = shard.followers.keys(), False, now
            else:
                keys = [k for k in named | shard.fresh if k in shard.followers]
            shard.fresh.clear()
            streams = {key: min((f.last_id for f in shard.followers[key]), key=_position) for key in keys}
            try:
                full = bool(streams) and self._deliver(shard, await shard.redis.xread(streams, count=self.count), now)
                if full:  # a stream has more than one read's worth: read them all again at once
                    everything = True
                    continue
                woke = await shard.redis.xread({STREAM_TICK: tick}, block=self.block_ms, count=TICKS_KEPT)
                ticks = [entries for _, entries in xread_streams(woke)]
                named = set()
                if not ticks:  # nothing written with a tick; entries without one wait for the full read
                    continue
                tick = ticks[0][-1][0]
                if len(ticks[0]) >= TICKS_KEPT:  # some may have been trimmed
                    everything = True
                    continue
                for _, raw in ticks[0]:
                    streams = tick_streams(_field(raw, "keys"), _field(raw, "data"))
                    if streams is None:  # a writer that names nothing: read everything
                        everything = True
                        continue
                    for key, part in streams:
                        followers = shard.followers.get(key)
                        if followers and not (part and _take(followers, part, now)):
                            named.add(key)  # read it: the tick cannot stand in for it
            except aredis.RedisError as e:  # Redis away: tell nobody yet, retry (followers time out on their own)
                log.warning("stream hub: %s; retrying", e)
                everything = True
                await asyncio.sleep(RETRY_S)

    def _deliver(self, shard: _Shard, resp, now: float) -> bool:
        """Hands a raw XREAD reply to the followers; True when a stream had more than one read's worth."""
        full = False
        for key, entries in xread_streams(resp):
            full = full or len(entries) >= self.count
            followers = shard.followers.get(key)
            if not followers:
                continue
            if len(followers) == 1:
                _give(followers[0], entries, now)
                continue
            for follower in followers:  # each from past its own position
                after = _position(follower.last_id)
                _give(follower, [e for e in entries if _position(e[0]) > after], now)
        return full


def _take(followers: list[_Follower], part: str, now: float) -> bool:
    """Hands the entries a tick carries for one stream to its followers, each from past its own
    position; False when a follower's position is neither where they begin nor among them (the stream
    holds entries it has not seen): then the stream is read, from that position."""
    try:
        before, entries = tick_entries(part)
    except ValueError:  # not a part this reader understands (a writer of another version): read the stream
        return False
    ok = True
    for follower in followers:
        if follower.last_id == before:
            _give(follower, entries, now)
            continue
        at = _position(follower.last_id)
        if at == _position(before):
            _give(follower, entries, now)
        elif entries and at >= _position(entries[-1][0]):
            continue  # it has them (read with the stream, or a resumed follower ahead of them)
        elif positions := [n for n, e in enumerate(entries) if _position(e[0]) == at]:
            _give(follower, entries[positions[0] + 1 :], now)
        else:
            ok = False
    return ok


def _give(follower: _Follower, entries: list, now: float) -> None:
    if not entries:
        return
    items = []
    for entry_id, raw in entries:
        follower.last_id = entry_id
        pairs = iter(raw)
        fields = dict(zip(pairs, pairs, strict=True))
        items.append((entry_id, fields))
        if is_end(fields):
            break
    follower.give(items)
    follower.seen = now


def _field(raw: list, name: str) -> str | None:
    """A field of a raw stream entry (hiredis' flat [name, value, ...] list)."""
    for k in range(0, len(raw) - 1, 2):
        if raw[k] == name:
            return raw[k + 1]
    return None


def _position(entry_id: str) -> tuple[int, int]:
    """A stream entry id ("ms-seq") in the order Redis gives them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
