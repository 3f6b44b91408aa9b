"""The gateway's streamed answers: Server-Sent Events of one job's entries, or of several jobs' (the
choices of one request) interleaved as they come. The first entry of every job is read before
answering, so a request the worker refuses is still a 4xx."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse
from weightq.tasks.contract import EntryType, is_end, outcome

if TYPE_CHECKING:
    from .core import Gateway


# nginx buffers a proxied response unless told not to: a stream would arrive in bursts, or at its end
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def stream(
    gw: Gateway, job_id: str, chunks: Callable[[str, dict], list[str]], last_id: str = "0-0", *, owner: bool = True
) -> StreamingResponse:
    """An SSE response whose event ids are `<job id>/<entry id>`; the first entry is read before
    answering, so a job the worker refuses is still a 4xx. Only the `owner` (the request that started
    the job) cancels it when its client goes away; a resumed stream follows it and nothing more."""
    batches = gw.batches(job_id, last_id)
    try:
        first = await anext(batches)
        while first and first[0][1].get("type") == EntryType.ATTEMPT:
            first = first[1:] or await anext(batches)
    except BaseException:
        await batches.aclose()
        if owner:
            gw.cancel_soon(job_id)
        raise
    if first[0][1].get("type") == EntryType.ERROR and last_id == "0-0":
        await batches.aclose()
        outcome(first[0][1])  # raises JobFailed: a refused request answers 4xx, not a stream

    async def body() -> AsyncIterator[str]:
        finished = False
        gw.streams_open.inc()
        try:
            batch = first
            while True:
                lines: list[str] = []
                for eid, f in batch:
                    lines += chunks(f"{job_id}/{eid}", f)
                    if is_end(f):
                        finished = True
                        break
                if lines:
                    yield "".join(lines)  # one write for every entry that was waiting
                if finished:
                    return
                batch = await anext(batches)
        finally:
            gw.streams_open.dec()
            await batches.aclose()
            if not finished and owner:
                gw.cancel_soon(job_id)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def stream_many(
    gw: Gateway, job_ids: list[str], chunks: Callable[[int, str, dict], list[str]], tail: Callable[[], list[str]]
) -> StreamingResponse:
    """One SSE response for several jobs (the choices of one request), their entries interleaved
    as they come: `chunks(choice index, SSE id, entry)`, then `tail()` once every job has ended.
    Every job's first entry is read before answering, so a refused request is still a 4xx."""
    its = [gw.batches(job_id) for job_id in job_ids]
    firsts: list[list[tuple[str, dict]]] = []

    async def close_all(cancel: bool) -> None:
        for it in its:
            await it.aclose()
        if cancel:
            for job_id in job_ids:
                gw.cancel_soon(job_id)

    try:
        for it in its:
            first = await anext(it)
            while first and first[0][1].get("type") == EntryType.ATTEMPT:
                first = first[1:] or await anext(it)
            if first[0][1].get("type") == EntryType.ERROR:
                outcome(first[0][1])  # raises JobFailed: a 4xx, not a stream
            firsts.append(first)
    except BaseException:
        await close_all(cancel=True)
        raise
    queue: asyncio.Queue[tuple[int, list[tuple[str, dict]] | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            await queue.put((i, firsts[i]))
            if not any(is_end(f) for _, f in firsts[i]):
                async for batch in its[i]:
                    await queue.put((i, batch))
                    if any(is_end(f) for _, f in batch):
                        break
        finally:
            await queue.put((i, None))

    async def body() -> AsyncIterator[str]:
        pumps = [asyncio.ensure_future(pump(i)) for i in range(len(its))]
        open_jobs, finished = len(its), set()
        gw.streams_open.inc()
        try:
            while open_jobs:
                i, batch = await queue.get()
                if batch is None:
                    open_jobs -= 1
                    continue
                lines: list[str] = []
                for eid, f in batch:
                    if i in finished:
                        break
                    lines += chunks(i, f"{job_ids[i]}/{eid}", f)
                    if is_end(f):
                        finished.add(i)
                if lines:
                    yield "".join(lines)
            if len(finished) == len(its):
                yield "".join(tail())
        finally:
            gw.streams_open.dec()
            for t in pumps:
                t.cancel()
            await close_all(cancel=len(finished) < len(its))

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


def sse(data: dict | str, event_id: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"id: {event_id}\n" if event_id else "") + f"data: {payload}\n\n"
