"""What a request asks of the gateway, read and checked before any job exists: its body (within a
size and a deadline), its job requests (sizes first, then each prompt parsed once, on a thread when
the body is large) and the concurrent generations its choices hold."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any

from fastapi import Request
from weightq.client.backlog import Overloaded
from weightq.client.jobs import check_servable
from weightq.client.pressure import Backpressure
from weightq.settings import Settings
from weightq.tasks.limits import LOCAL_TENANT, Door
from weightq.tasks.request import JobRequest, parse_request
from weightq.tasks.sizes import check_request_size

from .errors import HTTPError
from .limits import ClientLimits, ServingLimits
from .priority import caller_priority
from .turns import Turns

MAX_DEADLINE_S = 7 * 86_400
OFF_LOOP_BYTES = 64 * 1024  # bodies past this are decoded and checked on a thread, not the event loop
# What a route asks for: its job requests (one per prompt, in the contract's names) and how many
# samples of each (n; sample i of a seeded request draws with seed + i).
Asked = tuple[list[dict], int]


DEADLINE_HEADER = "x-deadline-s"  # seconds from now: the jobs must start by then, or are refused / end unrun


def resumes(request: Request, streaming: bool) -> bool:
    """Whether the request resumes a job's stream (core.Gateway.start) rather than asking for a job."""
    return streaming and bool(request.headers.get("last-event-id"))


def deadline_in(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_DEADLINE_S:
        message = f"X-Deadline-S must be seconds in (0, {MAX_DEADLINE_S}] (got {value[:32]!r})"
        raise HTTPError(400, message, "X-Deadline-S")
    return time.time() + seconds


class Intake:
    def __init__(
        self,
        settings: Settings,
        serving: ServingLimits,
        key_classes: dict[str, int],
        limits: ClientLimits,
        pressure: Backpressure,
    ) -> None:
        self.settings, self.serving, self.key_classes, self.limits = settings, serving, key_classes, limits
        self.pressure = pressure
        self.turns = Turns()

    def turn(self, request: Request, streaming: bool = False) -> AbstractAsyncContextManager[None]:
        """The caller's tenant's turn from its read body to its submitted jobs (turns.py): parse and
        submit inside it, read the body and answer outside. A stream resumed by Last-Event-ID
        submits nothing and takes none."""
        if resumes(request, streaming):
            return nullcontext()
        return self.turns.turn(getattr(request.state, "tenant", LOCAL_TENANT), request.is_disconnected)

    async def body(self, request: Request) -> Any:
        """The request's JSON body, read within BODY_TIMEOUT_S (a body trickled a byte at a time holds
        a connection no longer) and decoded off the event loop when it is large."""
        limit = self.settings.gateway.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
            raise HTTPError(413, f"request body of {declared[:20]} bytes exceeds {limit}", "body")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.settings.gateway.body_timeout_s):
                async for chunk in request.stream():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        raise HTTPError(413, f"request body exceeds {limit} bytes", "body")
        except TimeoutError:
            raise HTTPError(
                408, f"request body not received within {self.settings.gateway.body_timeout_s} s", "body", "timeout"
            ) from None
        raw = b"".join(chunks)
        request.state.body_bytes = size
        try:
            return await asyncio.to_thread(json.loads, raw) if size > OFF_LOOP_BYTES else json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, absurd nesting
            raise HTTPError(400, f"body is not valid JSON: {str(e)[:200]}", "body") from None

    async def parse(
        self,
        request: Request,
        asked: Callable[[], Asked],
        door: Door,
        prompt_field: str = "prompt",
        streaming: bool = False,
    ) -> list[JobRequest]:
        """A route's job requests, parsed once per prompt with the door's defaults, at the caller's
        priority class and tenant, and refused (by field) when no live worker's max_total_tokens leaves
        room for them. Sizes are checked before any work per prompt or per token; a large body is
        checked on a thread, so the event loop serves everyone else meanwhile. Choice i of prompt p
        is at p x n + i. A stream resumed by Last-Event-ID (`streaming` and one job) is not
        admitted against the queue's wait: its job exists, and refusing it would orphan the stream."""
        priority = caller_priority(request, self.key_classes, self.settings.gateway.open_max_priority)
        limit = self.serving.max_total_tokens()
        extra: dict[str, Any] = {"tenant": getattr(request.state, "tenant", LOCAL_TENANT)}
        if priority is not None:
            extra["priority"] = priority
        if (within := request.headers.get(DEADLINE_HEADER)) is not None:
            extra["deadline"] = deadline_in(within)

        def work() -> list[JobRequest]:
            jobs, n = asked()
            check_request_size(jobs, n, prompt_field)
            parsed = [parse_request(job | extra, door, max_total_tokens=limit) for job in jobs]
            adapters = self.serving.adapters({job.adapter for job in parsed if job.adapter})
            queue, served = self.settings.queues.queue, self.settings.served.name()
            check_servable(parsed, self.serving.structured(), queue, adapters, served_model=served)
            seeded = lambda job, i: job.with_seed(job.seed + i) if i and job.seed is not None else job  # noqa: E731
            return [seeded(job, i) for job in parsed for i in range(n)]

        jobs = await asyncio.to_thread(work) if getattr(request.state, "body_bytes", 0) > OFF_LOOP_BYTES else work()
        if len(jobs) == 1 and resumes(request, streaming):
            return jobs
        if self.settings.queues.max_queue_wait_s > 0 or "deadline" in extra:
            try:  # the projection may replay thousands of queued jobs: off the event loop
                await asyncio.to_thread(self.pressure.admit, jobs)
            except Overloaded as e:
                raise HTTPError(429, str(e), e.field or None, "rate_limit_error", str(e.retry_after_s)) from None
        return jobs

    def hold(self, request: Request, choices: int) -> None:
        """A request of several choices holds that many of its client's concurrent generations."""
        client = getattr(request.state, "limited_as", None)
        if client is None or choices <= 1:
            return
        most = self.limits.max_concurrent
        if most and choices > most:
            raise HTTPError(400, f"{choices} choices exceeds this client's {most} concurrent generations", "n")
        if not self.limits.hold(client, choices - 1):
            raise HTTPError(429, "too many generations in progress; retry in 1 s", None, "rate_limit_error", "1")
        request.state.held = choices
