"""Many token streams read over one Redis connection, for asyncio servers (the HTTP gateway).

A blocked XREAD per HTTP client would need a Redis connection per client; the hub instead keeps one
reader task that XREADs every followed stream at once and hands entries to per-follower queues.
A follower that registers while that XREAD is blocked is picked up on the next round (the block
is short), and it reads from its own `last_id`, so nothing written before it registered is missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import redis.asyncio as aredis

from app.redis_conn import connect_async, raw_xread, xread_streams
from app.settings import Settings
from tasks.contract import is_end, stream_key

log = logging.getLogger(__name__)


class StreamHub:
    def __init__(self, url: str, settings: Settings, *, block_ms: int = 20, count: int = 256) -> None:
        self.redis: aredis.Redis = connect_async(url, settings, socket_timeout=30, health_check_interval=10)
        raw_xread(self.redis)
        self.block_ms = block_ms
        self.count = count
        self._followers: dict[str, tuple[str, asyncio.Queue]] = {}  # stream key -> (last id, queue)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._read_loop(), name="weightq-hub")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.redis.aclose()

    @property
    def following(self) -> int:
        return len(self._followers)

    async def follow_batches(
        self, job_id: str, last_id: str = "0-0", idle_timeout_s: float | None = None
    ) -> AsyncIterator[list[tuple[str, dict[str, str]]]]:
        """(entry id, fields) of the job's stream after `last_id`, through its end or error entry, as
        lists of all that have arrived by the time the follower looks: a follower that falls behind
        catches up in one write per batch, not one per token. Raises TimeoutError when nothing arrives
        for `idle_timeout_s`."""
        key = stream_key(job_id)
        if key in self._followers:
            raise RuntimeError(f"job {job_id} already has a follower on this hub")
        queue: asyncio.Queue = asyncio.Queue()
        self._followers[key] = (last_id, queue)
        self._wake.set()
        try:
            while True:
                if queue.empty():
                    async with asyncio.timeout(idle_timeout_s):
                        first = await queue.get()
                else:
                    first = queue.get_nowait()
                batch = [first]
                while not queue.empty():
                    batch.append(queue.get_nowait())
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
            self._followers.pop(key, None)

    async def _read_loop(self) -> None:
        while True:
            if not self._followers:
                self._wake.clear()
                await self._wake.wait()
                continue
            streams = {key: last for key, (last, _) in self._followers.items()}
            try:
                resp = await self.redis.xread(streams, count=self.count, block=self.block_ms)
            except aredis.RedisError as e:  # Redis away: tell nobody yet, retry (followers time out on their own)
                log.warning("stream hub: %s; retrying", e)
                await asyncio.sleep(0.5)
                continue
            for raw_key, entries in xread_streams(resp):
                key = raw_key.decode()
                follower = self._followers.get(key)
                if follower is None:
                    continue
                queue = follower[1]
                last = follower[0]
                for raw_id, raw in entries:
                    last = raw_id.decode()
                    fields = {k.decode(): v.decode(errors="replace") for k, v in zip(raw[::2], raw[1::2], strict=True)}
                    queue.put_nowait((last, fields))
                    if is_end(fields):
                        break
                self._followers[key] = (last, queue)
