"""The gateway's job side, shared by its OpenAI and TGI routes: submit a job, follow its stream (all
streams over one connection, see hub.py), collect its result, answer with an SSE stream, and cancel
the job of a client that went away.

Every job belongs to its caller's tenant (guard.py: an id of its API key). A stream resumed with
Last-Event-ID must be of the caller's tenant (else it is as unknown as an expired one), and only the
request that started a job cancels it when its client goes away: a resumed stream only follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import redis
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Gauge
from weightq.client import Client
from weightq.metrics import BacklogCollector, QueueCollector, WorkerCollector, queue_depths, read_live_workers
from weightq.redis_conn import redacted
from weightq.settings import Settings
from weightq.tasks.contract import DEAD, EntryType, Replay, job_key, outcome, resume_from
from weightq.tasks.heartbeat import Heartbeat
from weightq.tasks.limits import ID_PATTERN, LOCAL_TENANT
from weightq.tasks.request import JobRequest

from .browser import BrowserGuard
from .errors import HTTPError
from .hub import StreamHub
from .intake import Intake
from .limits import DEFAULT_CONCURRENT_PER_KEY, DEFAULT_RATE_PER_KEY, ClientLimits, ServingLimits, resolved
from .priority import key_classes
from .submitter import Submitter

log = logging.getLogger(__name__)
VERSION = "0.1.0"
T = TypeVar("T")
STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}(@\d{1,10})?$")  # "@<i>": a token inside a joined entry
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class Gateway:
    """Shared state of one gateway process: the job client, the stream hub and the metrics."""

    def __init__(self, settings: Settings, url: str | None = None) -> None:
        self.settings = settings
        self.url = url or settings.redis.resolved_url()
        self.client = Client(self.url, settings=settings)
        self.submitter = Submitter(self.client)
        self.model = settings.served.name()
        self.version = VERSION
        self.shutting_down = False
        self.serving = ServingLimits(self.workers)
        self.keys = [k.strip().encode() for k in settings.gateway.api_key.split(",") if k.strip()]
        self.metrics_key = settings.gateway.metrics_key.strip().encode()  # reads the metrics routes, nothing else
        self.key_classes = key_classes(settings.gateway.key_priorities)
        self.browser = None if self.keys else BrowserGuard(settings.gateway.host, settings.gateway.allowed_hosts)
        self.limits = ClientLimits(
            int(resolved(settings.gateway.max_concurrent_per_client, bool(self.keys), DEFAULT_CONCURRENT_PER_KEY)),
            resolved(settings.gateway.rate_limit_per_s, bool(self.keys), DEFAULT_RATE_PER_KEY),
            settings.gateway.rate_burst,
        )
        self.intake = Intake(settings, self.serving, self.key_classes, self.limits, self.client.backpressure)
        self.hub: StreamHub | None = None
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "weightq_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.streams_open = Gauge(
            "weightq_http_streams_open", "Streaming responses in progress", registry=self.registry
        )
        # What every gateway would render alike (from Redis) is exported apart, to be scraped once.
        self.cluster = CollectorRegistry()
        self.cluster.register(WorkerCollector(lambda: {n: w.stats for n, w in self.workers().items()}))
        self.cluster.register(QueueCollector(self.queue_depths))
        self.cluster.register(BacklogCollector(self.client.backpressure.projection, self.client.backpressure.margin))
        dead = Gauge("weightq_dead_letters", "Jobs dead-lettered after too many attempts (weightq:dead)",
                     registry=self.cluster)  # fmt: skip
        dead.set_function(lambda: self._llen(DEAD))

    # ----- plumbing -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.hub = StreamHub(self.client.streams_urls, self.settings.redis)
        await self.hub.start()
        # Ready: what is alive now (libraries, routes) goes to the permanent generation, so full
        # collections scan only what requests create (as the worker does: engine/heap.py).
        gc.collect()
        gc.freeze()
        shards = self.client.streams_urls
        streams = "" if shards == [self.url] else f", streams on {', '.join(map(redacted, shards))}"
        log.info("weightq gateway: Redis %s%s, model %s", redacted(self.url), streams, self.model)
        try:
            yield
        finally:
            await self.hub.close()

    def _llen(self, key: str) -> float:
        """The length of a list every shard of the token plane keeps, summed."""
        try:
            return float(sum(shard.llen(key) for shard in self.client.plane.shards))
        except redis.RedisError:
            return float("nan")

    def queue_depths(self) -> dict[tuple[str, int], int]:
        """Per class, the jobs waiting on this gateway's queue and on every queue a live worker serves."""
        workers = self.workers().values()
        queues = {self.settings.queues.queue, *(w.queue or self.settings.queues.queue for w in workers)}
        own = {w.own_queue: w.queue or self.settings.queues.queue for w in workers if w.own_queue}
        try:
            return queue_depths(self.client.broker, queues, own)  # a worker's own queue counts for its queue
        except redis.RedisError:
            return {}

    def workers(self) -> dict[str, Heartbeat]:
        try:
            return read_live_workers(self.client.redis)
        except redis.RedisError:
            return {}

    def adapters(self) -> set[str]:
        """The LoRA adapters live workers serve now (their heartbeats, read afresh)."""
        return {a for w in self.workers().values() for a in w.adapters}

    async def submit(self, job: JobRequest) -> str:
        return await self.submitter.submit(job)

    async def submit_all(self, jobs: list[JobRequest]) -> list[str]:
        return await self.submitter.submit_all(jobs)

    def cancel_soon(self, job_id: str) -> None:
        """Cancel from a worker thread: also safe inside a cancelled task's cleanup. Not while the
        gateway shuts down: its clients' jobs go on, and a client may resume with Last-Event-ID."""
        if self.shutting_down:
            return
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, self._cancel, job_id)

    def _cancel(self, job_id: str) -> None:
        try:
            state = self.client.job(job_id).cancel()
            log.info("job %s cancelled (client went away; it was %s)", job_id, state)
        except Exception:
            log.exception("cancelling job %s failed", job_id)

    async def events(self, job_id: str, last_id: str = "0-0") -> AsyncIterator[tuple[str, dict]]:
        """Stream entries (each token index once: see Replay), with a timeout when idle."""
        batches = self.batches(job_id, last_id)
        try:
            async for batch in batches:
                for item in batch:
                    yield item
        finally:
            await batches.aclose()

    async def batches(self, job_id: str, last_id: str = "0-0") -> AsyncIterator[list[tuple[str, dict]]]:
        """events() as lists of what had arrived together (a streamed response writes each in one go)."""
        assert self.hub is not None
        replay = Replay()
        last_id, replay.delivered = resume_from(last_id)
        timeout = self.settings.gateway.request_timeout_s
        it = self.hub.follow_batches(job_id, last_id, timeout)
        started = False
        try:
            while True:
                try:
                    batch = await anext(it)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise HTTPError(504, f"job {job_id}: nothing for {timeout} s", None, "timeout") from None
                fresh = [(eid, g) for eid, f in batch if (g := replay.unseen(f)) is not None]
                if not started and any(f.get("type") != EntryType.ATTEMPT for _, f in fresh):
                    started = True
                    self.client.backpressure.first_entry(job_id)  # what the projected wait missed by
                if fresh:
                    yield fresh
        finally:
            await it.aclose()

    async def result(self, request: Request, job_id: str) -> dict:
        """The job's final result."""

        async def collect() -> dict:
            async for _, fields in self.events(job_id):
                if (result := outcome(fields)) is not None:  # raises JobFailed on an error entry
                    return result
            raise HTTPError(500, f"job {job_id}: stream ended without a result", None, "internal_error")

        return await self.wait(request, job_id, collect())

    async def wait(self, request: Request, job_id: str, work: Awaitable[T]) -> T:
        """Await `work` (reading the job's stream); a client that disconnects meanwhile cancels the job."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise asyncio.CancelledError
        except BaseException:
            if not task.done() or task.cancelled():
                self.cancel_soon(job_id)
            task.cancel()
            raise

    async def start(self, request: Request, job: JobRequest, streaming: bool) -> tuple[str, str, bool]:
        """(job id, stream position, whether this request owns the job): a new job, or, for a stream
        re-requested with `Last-Event-ID: <job id>/<entry id>` (the SSE ids we send), the same job of
        the caller's tenant from where the client left off, followed and never cancelled from here."""
        resume = request.headers.get("last-event-id")
        if not resume or not streaming:
            return await self.submit(job), "0-0", True
        job_id, _, last_id = resume.partition("/")
        if not ID_PATTERN.match(job_id) or not STREAM_ID.match(last_id):
            raise HTTPError(400, "Last-Event-ID must be '<job id>/<entry id>' as sent in the stream", "Last-Event-ID")
        hmget = self.client.plane.of(job_id).hmget
        state, tenant = await asyncio.to_thread(hmget, job_key(job_id), ["state", "tenant"])
        owner = tenant.decode() if tenant is not None else LOCAL_TENANT  # a job from before tenants: local
        if state is None or owner != job.tenant:  # another tenant's job is as unknown as an expired one
            raise HTTPError(404, f"job {job_id} is unknown or expired", "Last-Event-ID", "not_found_error")
        return job_id, last_id, False

    async def results(self, request: Request, job_ids: list[str]) -> list[dict]:
        """Every job's result, in order; a failure (or the client leaving) cancels the others."""
        try:
            return list(await asyncio.gather(*(self.result(request, j) for j in job_ids)))
        except BaseException:
            for job_id in job_ids:
                self.cancel_soon(job_id)
            raise
