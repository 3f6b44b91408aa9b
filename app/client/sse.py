"""A job as server-sent events, for a web app's own endpoint (Flask, Django, FastAPI: examples/).

Each text delta is `data: {"text": ...}` (JSON: a token holding a newline would otherwise end the SSE
field early and the browser would drop the rest), then one `event: end` with the job's result, or
one `event: error` with {"message", "field"}: a browser knows the stream ended rather than broke, and
closes its EventSource instead of reconnecting to ask again. When the client goes away the server
closes the generator (Flask, Django) or cancels the task (FastAPI, Starlette): the job is cancelled,
so no worker keeps generating for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from weightq.tasks.contract import EntryType, JobFailed, Replay, outcome


class Job(Protocol):
    """What sse() reads of a job (client.jobs.Job): its stream's events, and a way to cancel it."""

    def events(self, timeout: float | None = None) -> Iterator[Any]: ...

    def cancel(self) -> Any: ...


HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy holds the events back


def event(data: object, name: str | None = None) -> str:
    """One SSE event, its data as one line of JSON."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse(job: Job, timeout: float | None = None) -> Iterator[str]:
    """The job's events as SSE text; closing the generator before its end cancels the job."""
    ended = False
    try:
        replay = Replay()
        for ev in job.events(timeout):
            if ev.type == EntryType.TOKEN:
                if replay.fresh(ev.data) and ev.text:
                    yield event({"text": ev.text})
                continue
            try:
                result = outcome(ev.data)
            except JobFailed as e:
                ended = True
                yield event({"message": str(e), "field": e.field or None}, "error")
                return
            if result is not None:
                ended = True
                yield event(result, "end")
                return
    except TimeoutError as e:
        yield event({"message": str(e), "field": None}, "error")  # and the job is cancelled below
    finally:
        if not ended:
            with contextlib.suppress(Exception):  # Redis gone too: nothing more to do from here
                job.cancel()


async def asse(job: Job, timeout: float | None = None) -> AsyncIterator[str]:
    """sse() for an async framework (the blocking reads on a thread); a cancelled response (the client
    went away) cancels the job."""
    it = sse(job, timeout)
    loop = asyncio.get_running_loop()
    try:
        while (item := await loop.run_in_executor(None, next, it, None)) is not None:
            yield item
    finally:
        try:
            it.close()  # its own finally: cancels an unfinished job
        except ValueError:  # still running a read on the thread: cancel from here
            with contextlib.suppress(Exception):
                job.cancel()
