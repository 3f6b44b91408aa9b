"""The gateway's stream hub on a real Redis: batches in order through the end entry, and the idle
timeout that only a silent stream reaches."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis
from weightq.gateway.hub import StreamHub
from weightq.settings import RedisSettings
from weightq.tasks.contract import STREAM_TICK, TICKS_KEPT, WRITE_BATCH, EntryType, stream_key

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def run(coro):
    return asyncio.run(coro)


async def collect(hub: StreamHub, job_id: str, idle_s: float | None) -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = []
    async for batch in hub.follow_batches(job_id, idle_timeout_s=idle_s):
        out += batch
    return out


def test_follower_gets_every_entry_through_the_end(redis_url):
    sync = redis.Redis.from_url(redis_url)

    async def main():
        hub = StreamHub([redis_url], RedisSettings(url=redis_url))
        await hub.start()
        try:
            reader = asyncio.create_task(collect(hub, "hub-a", idle_s=5))
            for i in range(5):  # slower than the watchdog's check: a live stream never times out
                await asyncio.to_thread(sync.xadd, stream_key("hub-a"), {"type": EntryType.TOKEN, "i": i, "text": "x"})
                await asyncio.sleep(0.05)
            await asyncio.to_thread(sync.xadd, stream_key("hub-a"), {"type": EntryType.END, "result": "{}"})
            await asyncio.to_thread(sync.xadd, stream_key("hub-a"), {"type": EntryType.TOKEN, "i": 9, "text": "late"})
            got = await asyncio.wait_for(reader, 10)
            assert [f.get("i") for _, f in got] == ["0", "1", "2", "3", "4", None]
            assert got[-1][1]["type"] == EntryType.END and hub.following == 0
        finally:
            await hub.close()

    run(main())


@pytest.mark.parametrize("idle_s", [0.4, 1.2])
def test_silent_stream_times_out_near_its_idle_timeout(redis_url, idle_s):
    async def main():
        hub = StreamHub([redis_url], RedisSettings(url=redis_url))
        await hub.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(collect(hub, f"hub-silent-{idle_s}", idle_s=idle_s), 30)
            waited = time.monotonic() - t0
            assert idle_s <= waited, waited  # never early; late by at most a check, plus a busy machine
            assert hub.following == 0
        finally:
            await hub.close()

    run(main())


def test_the_hub_reads_the_streams_its_ticks_name_and_every_stream_now_and_then(redis_url):
    """Under a steady stream of ticks the hub reads only the jobs they name; an entry written without a
    tick naming its job (an attempt marker, a client's cancel of a queued job) still arrives."""
    sync = redis.Redis.from_url(redis_url)

    async def main():
        hub = StreamHub([redis_url], RedisSettings(url=redis_url))
        await hub.start()
        ticking = True

        async def tick_for_others():  # another job's batches, every 10 ms: the hub never times out on a tick
            while ticking:
                other = {"seq": 1, "keys": stream_key("someone-else")}
                await asyncio.to_thread(sync.xadd, STREAM_TICK, other, maxlen=TICKS_KEPT)
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick_for_others())
        try:
            reader = asyncio.create_task(collect(hub, "hub-named", idle_s=10))
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            await asyncio.to_thread(sync.xadd, stream_key("hub-named"), {"type": EntryType.TOKEN, "i": 0, "text": "x"})
            await asyncio.to_thread(sync.xadd, stream_key("hub-named"), {"type": EntryType.END, "result": "{}"})
            got = await asyncio.wait_for(reader, 10)  # no tick names it: the periodic read of every stream
            assert [f["type"] for _, f in got] == ["token", "end"] and time.monotonic() - t0 < 2
            reader = asyncio.create_task(collect(hub, "hub-ticked", idle_s=10))
            await asyncio.sleep(0.1)
            await asyncio.to_thread(sync.xadd, stream_key("hub-ticked"), {"type": EntryType.END, "result": "{}"})
            both = {"seq": 2, "keys": f"{stream_key('a')} {stream_key('hub-ticked')}"}
            await asyncio.to_thread(sync.xadd, STREAM_TICK, both, maxlen=TICKS_KEPT)
            assert [f["type"] for _, f in await asyncio.wait_for(reader, 10)] == ["end"]
        finally:
            ticking = False
            await ticker
            await hub.close()

    run(main())


def test_the_hub_takes_batches_from_their_ticks_and_reads_a_stream_only_where_a_tick_cannot_stand_in(redis_url):
    """A batch comes from its tick (an entry only the tick holds is delivered); an entry written without a
    tick before a batch is read from the stream first, in order; a follower resumed inside a batch gets
    what lies past its own position. Every entry once."""
    sync = redis.Redis.from_url(redis_url, decode_responses=True)
    write = sync.register_script(WRITE_BATCH)
    key = stream_key("hub-carried")

    def batch(seq: int, *texts: str) -> None:  # WRITE_BATCH's plain tokens, as a worker's writer sends them
        args: list = [1000, 600, 600, seq, 0, 0]  # no fences, no last ids
        for text in texts:
            args += [3, 0, int(text[1:]), text, 5, "1.0"]
        write(keys=[f"writer-{redis_url}", STREAM_TICK, key], args=args)

    async def follow(last_id: str, out: list) -> None:
        async for entries in hub.follow_batches("hub-carried", last_id, idle_timeout_s=10):
            out += [(i, f.get("text", f["type"])) for i, f in entries]

    async def until(out: list, n: int) -> None:
        for _ in range(500):
            if len(out) >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{len(out)} of {n} entries: {out}")

    hub = StreamHub([redis_url], RedisSettings(url=redis_url))

    async def main():
        await hub.start()
        first: list = []
        try:
            reader = asyncio.create_task(follow("0-0", first))
            await asyncio.sleep(0.1)
            await asyncio.to_thread(batch, 1, "t0", "t1")
            await until(first, 2)
            await asyncio.to_thread(sync.xadd, key, {"type": EntryType.TOKEN, "i": 2, "text": "t2"})  # no tick
            await asyncio.to_thread(batch, 2, "t3")
            await until(first, 4)
            middle: list = []  # resumes after t0: t1 (and what follows) past its own position
            second = asyncio.create_task(follow(first[0][0], middle))
            await until(middle, 3)
            await asyncio.to_thread(batch, 3, "t4", "t5")
            await until(first, 6)
            # a part this reader cannot take apart: it reads the stream instead (nothing new there)
            broken = {"seq": 4, "keys": key, "data": "[not json"}
            await asyncio.to_thread(sync.xadd, STREAM_TICK, broken, maxlen=TICKS_KEPT)
            # an end entry only this tick holds: delivered from the tick, not from the stream
            last = first[-1][0]
            end = f"{int(last.split('-')[0]) + 1}-0"
            part = json.dumps([last, end, ["type", "end", "result", "{}"]])
            await asyncio.to_thread(sync.xadd, STREAM_TICK, {"seq": 5, "keys": key, "data": part}, maxlen=TICKS_KEPT)
            await asyncio.wait_for(asyncio.gather(reader, second), 10)
            assert [t for _, t in first] == ["t0", "t1", "t2", "t3", "t4", "t5", "end"]
            assert [t for _, t in middle] == ["t1", "t2", "t3", "t4", "t5", "end"]
            assert [i for i, _ in first[:-1]] == [i for i, _ in sync.xrange(key)]
        finally:
            await hub.close()

    run(main())
