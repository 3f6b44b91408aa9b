"""The HTTP gateway: OpenAI- and TGI-compatible routes in front of the Celery queue.

    weightq gateway            # or: uvicorn --factory app.gateway:create_app

Every generation request becomes a `weightq.generate` job; streaming responses follow the job's
Redis stream (all of them over one connection, see hub.py). A client that disconnects cancels its
job. Bad input is a 4xx whose JSON names the field; the gateway holds no model and no GPU, so any
number of gateways can front the same Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kombu.exceptions import OperationalError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from tasks.schema import ID_PATTERN, RequestError

from . import openai_api, tgi_api
from .client import Client
from .guard import Guard, error_response
from .http_errors import HTTPError, JobError
from .hub import StreamHub
from .limits import ClientLimits
from .metrics import HEARTBEATS, WorkerCollector, live_workers
from .settings import Settings
from .streams import DEAD, job_key

log = logging.getLogger(__name__)
VERSION = "0.1.0"
T = TypeVar("T")
STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")


class Gateway:
    """Shared state of one gateway process: the job client, the stream hub and the metrics."""

    def __init__(self, settings: Settings, url: str | None = None) -> None:
        self.settings = settings
        self.url = url or settings.resolved_redis_url()
        self.client = Client(self.url, settings=settings)
        self.model = settings.served_model_name or settings.model
        self.version = VERSION
        self.shutting_down = False
        self.keys = [k.strip().encode() for k in settings.api_key.split(",") if k.strip()]
        self.limits = ClientLimits(settings.max_concurrent_per_client, settings.rate_limit_per_s, settings.rate_burst)
        self.hub: StreamHub | None = None
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "weightq_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.streams_open = Gauge(
            "weightq_http_streams_open", "Streaming responses in progress", registry=self.registry
        )
        self.registry.register(WorkerCollector(self.workers))
        dead = Gauge("weightq_dead_letters", "Jobs dead-lettered after too many attempts (weightq:dead)",
                     registry=self.registry)  # fmt: skip
        dead.set_function(lambda: self._llen(DEAD))

    # ----- plumbing -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.hub = StreamHub(self.url)
        await self.hub.start()
        log.info("weightq gateway: Redis %s, model %s", self.url, self.model)
        try:
            yield
        finally:
            await self.hub.close()

    def _llen(self, key: str) -> float:
        try:
            return float(self.client.redis.llen(key))
        except redis.RedisError:
            return float("nan")

    def workers(self) -> dict[str, dict]:
        try:
            return live_workers(self.client.redis.hgetall(HEARTBEATS))
        except redis.RedisError:
            return {}

    def check_key(self, authorization: str) -> str | None:
        """The caller's key (None when the gateway has none); every key is compared in constant time."""
        if not self.keys:
            return None
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode()
        matched = None
        for key in self.keys:  # no early exit: the time taken says nothing about which key was close
            if hmac.compare_digest(given, key) and scheme.lower() == "bearer":
                matched = key.decode()
        if matched is None:
            raise HTTPError(
                401, "missing or wrong API key (send Authorization: Bearer <key>)", None, "authentication_error"
            )
        return matched

    async def body(self, request: Request) -> Any:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"request body of {declared} bytes exceeds {limit}", "body")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise HTTPError(413, f"request body exceeds {limit} bytes", "body")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, absurd nesting
            raise HTTPError(400, f"body is not valid JSON: {str(e)[:200]}", "body") from None

    async def submit(self, job: dict) -> str:
        j = await asyncio.to_thread(self.client.submit, **job)
        return j.id

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
        """Stream entries, with a restarted job's repeated tokens dropped and a timeout when idle."""
        assert self.hub is not None
        delivered = 0
        it = self.hub.follow(job_id, last_id).__aiter__()
        try:
            while True:
                try:
                    entry_id, fields = await asyncio.wait_for(it.__anext__(), self.settings.request_timeout_s)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise HTTPError(504, f"job {job_id}: nothing for {self.settings.request_timeout_s} s", None,
                                    "timeout") from None  # fmt: skip
                kind = fields.get("type")
                if kind == "token":
                    i = int(fields.get("i", 0))
                    if i < delivered:
                        continue  # a redelivered job regenerates what was already sent
                    delivered = i + 1
                yield entry_id, fields
        finally:
            await it.aclose()

    async def result(self, request: Request, job_id: str) -> dict:
        """The job's final result."""

        async def collect() -> dict:
            async for _, fields in self.events(job_id):
                if fields.get("type") == "end":
                    return json.loads(fields["result"])
                if fields.get("type") == "error":
                    raise JobError(fields)
            raise HTTPError(500, f"job {job_id}: stream ended without a result", None, "internal_error")

        return await self.wait(request, job_id, collect())

    async def wait(self, request: Request, job_id: str, work: Awaitable[T]) -> T:
        """Await `work` (reading the job's stream); a client that disconnects meanwhile cancels the job."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise asyncio.CancelledError
        except BaseException:
            if not task.done() or task.cancelled():
                self.cancel_soon(job_id)
            task.cancel()
            raise

    async def start(self, request: Request, job: dict, streaming: bool) -> tuple[str, str]:
        """(job id, stream position): a new job, or, for a stream re-requested with `Last-Event-ID:
        <job id>/<entry id>` (the SSE ids we send), the same job from where the client left off."""
        resume = request.headers.get("last-event-id")
        if not resume or not streaming:
            return await self.submit(job), "0-0"
        job_id, _, last_id = resume.partition("/")
        if not ID_PATTERN.match(job_id) or not STREAM_ID.match(last_id):
            raise HTTPError(400, "Last-Event-ID must be '<job id>/<entry id>' as sent in the stream", "Last-Event-ID")
        if not await asyncio.to_thread(self.client.redis.exists, job_key(job_id)):
            raise HTTPError(404, f"job {job_id} is unknown or expired", "Last-Event-ID", "not_found_error")
        return job_id, last_id

    async def stream(
        self, job_id: str, chunks: Callable[[str, dict], list[str]], last_id: str = "0-0"
    ) -> StreamingResponse:
        """An SSE response whose event ids are `<job id>/<entry id>`; the first entry is read before
        answering, so a job the worker refuses is still a 4xx."""
        events = self.events(job_id, last_id)
        try:
            entry_id, fields = await anext(events)
            while fields.get("type") == "attempt":
                entry_id, fields = await anext(events)
        except BaseException:
            await events.aclose()
            self.cancel_soon(job_id)
            raise
        if fields.get("type") == "error" and last_id == "0-0":
            await events.aclose()
            raise JobError(fields)

        async def body() -> AsyncIterator[str]:
            finished = False
            self.streams_open.inc()
            try:
                current = (entry_id, fields)
                while True:
                    eid, f = current
                    for line in chunks(f"{job_id}/{eid}", f):
                        yield line
                    if f.get("type") in ("end", "error"):
                        finished = True
                        return
                    current = await anext(events)
            finally:
                self.streams_open.dec()
                await events.aclose()
                if not finished:
                    self.cancel_soon(job_id)

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def sse(data: dict | str, event_id: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return (f"id: {event_id}\n" if event_id else "") + f"data: {payload}\n\n"


def create_app(settings: Settings | None = None, url: str | None = None) -> FastAPI:
    gw = Gateway(settings or Settings.from_env(), url)
    app = FastAPI(title="weightq gateway", version=VERSION, lifespan=gw.lifespan)
    app.state.gateway = gw
    app.add_middleware(Guard, gateway=gw)

    @app.exception_handler(HTTPError)
    async def on_http_error(request: Request, e: HTTPError) -> Response:
        return error_response(request.url.path, e)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, e: RequestError) -> Response:
        return error_response(request.url.path, HTTPError(400, str(e), e.field))

    @app.exception_handler(JobError)
    async def on_job_error(request: Request, e: JobError) -> Response:
        return error_response(request.url.path, HTTPError(e.status, str(e), e.field))

    @app.exception_handler(redis.RedisError)
    @app.exception_handler(OperationalError)
    async def on_broker_down(request: Request, e: Exception) -> Response:
        log.warning("queue unavailable: %s", e)
        return error_response(request.url.path, HTTPError(503, f"queue unavailable: {e}", None, "unavailable"))

    openai_api_routes(app, gw)
    tgi_api.routes(app, gw, sse)

    @app.get("/health")
    def health() -> Response:
        try:
            gw.client.redis.ping()
        except redis.RedisError as e:
            return JSONResponse({"status": "redis unreachable", "error": str(e)}, status_code=503)
        n = len(gw.workers())
        return JSONResponse({"status": "ok" if n else "no workers", "workers": n}, status_code=200 if n else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def openai_api_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/v1/models")
    def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": gw.model, "object": "model", "created": 0, "owned_by": "weightq"}],
        }

    async def completions(request: Request, chat: bool) -> Response:
        body = await gw.body(request)
        job = openai_api.chat_job(body, gw.model) if chat else openai_api.completion_job(body, gw.model)
        job_id, last_id = await gw.start(request, job, bool(body.get("stream")))
        if not body.get("stream"):
            result = await gw.result(request, job_id)
            return JSONResponse(openai_api.completion_response(job_id, gw.model, result, chat=chat))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        writer = openai_api.ChunkWriter(job_id, gw.model, chat=chat, resumed=last_id != "0-0")

        def chunks(entry_id: str, f: dict) -> list[str]:
            kind = f.get("type")
            if kind == "token":
                return [sse(writer.delta(f.get("text", "")), entry_id)] if f.get("text") else []
            if kind == "end":
                result = json.loads(f["result"])
                out = [sse(writer.finish(result), entry_id)]
                if include_usage:
                    out.append(sse(writer.usage(result)))
                return [*out, sse("[DONE]")]
            if kind == "error":
                err = {"error": {"message": f.get("message", "error"), "type": "server_error", "param": f.get("field")}}
                return [sse(err, entry_id), sse("[DONE]")]
            return []

        return await gw.stream(job_id, chunks, last_id)

    @app.post("/v1/completions")
    async def completion(request: Request) -> Response:
        return await completions(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completion(request: Request) -> Response:
        return await completions(request, chat=True)
