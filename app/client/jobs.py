"""The client API: enqueue a generation, read its tokens as they come, get the result, cancel it.

    from weightq.client import Client
    job = Client().submit("Once upon a time", max_new_tokens=64)
    for text in job.stream():
        print(text, end="")
    print(job.result(timeout=60)["usage"])

Any process that can reach the Redis URL can do this; the worker may be on another machine. The
client loads no engine (no torch): `pip install weightq` is all a web app needs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import redis
from weightq.celery_config import own_transport
from weightq.redis_conn import check_reachable, connect, retrying
from weightq.settings import Settings
from weightq.tasks.contract import (
    CANCEL,
    CANCEL_CHANNEL,
    END_TYPES,
    QUEUED,
    SUBMIT,
    TASK_NAME,
    EntryType,
    JobFailed,
    JobNotFound,
    JobState,
    Replay,
    StreamExpired,
    args_repr,
    cancelled_result,
    decode_fields,
    job_key,
    outcome,
    part_id,
    resume_from,
    staged_queue,
    stream_key,
    token_parts,
)
from weightq.tasks.limits import BATCH_PRIORITY, BULK_JOBS, broker_priority
from weightq.tasks.request import JobRequest, RequestError, parse_request
from weightq.tasks.results import TokenLogprobs
from weightq.tasks.sizes import job_weight
from weightq.token_plane import TokenPlane
from weightq.transport import TENANT_HEADER, WEIGHT_HEADER, publish_batch

from .pressure import Backpressure
from .routing import Router

__all__ = ["Client", "Job", "JobFailed", "StreamEvent", "submit"]

READ_COUNT = 512  # stream entries one XREAD of a job's stream takes at most
READ_BLOCK_MS = 1000  # how long one XREAD waits for an entry (the clients' socket timeout stays well above it)
RECONNECT_S = 1.0  # the pause before reading again when Redis is away (restarting)


def check_servable(
    jobs: Sequence[JobRequest],
    structured: bool | None,
    queue: str,
    adapters: set[str] | None = None,
    *,
    served_model: str,
) -> None:
    """Refuse, before anything is written, structured output when the live workers of `queue` have no
    grammar engine, and a LoRA adapter none of them holds: each would fail the job after it waited its
    turn. None: no worker live (jobs wait). A refused model's message names `served_model` (the name
    clients send: SERVED_MODEL_NAME or MODEL) and the adapters."""
    if structured is False and any(job.guided is not None for job in jobs):
        raise RequestError("guided", NO_STRUCTURED.format(queue=queue))
    if adapters is not None:
        for job in jobs:
            if job.adapter and job.adapter not in adapters:
                raise RequestError("model", not_served(job.adapter, served_model, adapters))


def not_served(model: object, served_model: str, adapters: set[str] | None = None) -> str:
    """The refusal of a model name, naming what is served: the model, and its LoRA adapters when known."""
    held = "" if adapters is None else f"; LoRA adapters: {', '.join(sorted(adapters)) or 'none'}"
    return f"model {str(model)[:64]!r} is not served here (serving {served_model!r}{held})"


NO_STRUCTURED = (
    "structured output: no worker of queue {queue!r} has xgrammar installed (`pip install weightq[worker]` "
    "alone has none): install the `structured` extra on the workers (CUDA), or on the CPU "
    "`pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2` (the project's images have it)"
)


@dataclass(slots=True)
class StreamEvent:
    """One stream entry: type is "attempt", "token", "end" or "error"."""

    type: str
    entry_id: str
    data: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.data.get("text", "")

    @property
    def logprobs(self) -> TokenLogprobs | None:
        """A token's log-probability and top alternatives, when the job asked (`logprobs=k`)."""
        raw = self.data.get("lp")
        return TokenLogprobs.from_json(raw) if raw else None


def _decode(entry_id, raw: dict) -> StreamEvent:
    data = decode_fields(raw)
    eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return StreamEvent(data.get("type", ""), eid, data)


class Job:
    def __init__(self, client: Client, job_id: str) -> None:
        self.client = client
        self.id = job_id

    def events(self, timeout: float | None = None, last_id: str = "0-0") -> Iterator[StreamEvent]:
        """Every stream entry after `last_id`, until the end (or error) entry, one event per token
        (a joined entry's tokens before its last have ids "<entry id>@<index>": resuming from any
        event's id goes on after it). Raises JobNotFound for an id no job has, StreamExpired for a
        job whose stream has expired."""
        self.client.first_contact()
        r = self.client.readers.of(self.id)
        key = stream_key(self.id)
        last_id, skip = resume_from(last_id)  # "<entry id>@<i>": a token inside a joined entry
        waited = 0.0
        block_ms = 0  # the first read does not block: a stream not there yet is looked into at once
        while True:
            try:
                resp = r.xread({key: last_id}, count=READ_COUNT, block=block_ms or None)
            except redis.ConnectionError:  # Redis restarting: the stream is durable, read on once it is back
                time.sleep(RECONNECT_S)
                resp = None
            if not resp and not block_ms:
                self._check_stream()
            waited_now, block_ms = block_ms / 1000, READ_BLOCK_MS
            if not resp:
                waited += waited_now
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"job {self.id}: no stream entry for {timeout} s")
                continue
            waited = 0.0
            for entry_id, raw in resp[0][1]:
                ev = _decode(entry_id, raw)
                last_id = ev.entry_id
                if ev.type != EntryType.ATTEMPT:
                    self.client.backpressure.first_entry(self.id)  # the projection's error (cheap past the first)
                if "n" in ev.data:  # several tokens in one entry: one event each, its last with the entry's id
                    for part in token_parts(ev.data):
                        if int(part["i"]) >= skip:
                            yield StreamEvent(ev.type, part_id(ev.entry_id, part, ev.data), dict(part))
                    continue
                yield ev
                if ev.type in END_TYPES:
                    return

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """Text deltas of the job, each token once: a job whose worker died resumes elsewhere after
        the tokens it had streamed, so the deltas join into the result's text."""
        replay = Replay()
        for ev in self.events(timeout):
            if ev.type == EntryType.TOKEN:
                if replay.fresh(ev.data) and ev.text:
                    yield ev.text
            else:
                outcome(ev.data)  # raises JobFailed on an error entry

    def result(self, timeout: float | None = None) -> dict:
        """The final JSON result (from the stream's end entry, so it needs no result backend; once the
        stream has expired, from the job's record, kept RESULT_TTL_S). Raises JobNotFound for an id no
        job has, JobFailed (JobExpired) for a job that ended with an error."""
        try:
            for ev in self.events(timeout):
                if (result := outcome(ev.data)) is not None:
                    return result
        except StreamExpired:
            return self._stored_outcome()
        raise RuntimeError("unreachable: events() ends at an end or error entry")

    def _check_stream(self) -> None:
        """The stream is not there (yet): raise unless the job is still to start."""
        pipe = self.client.readers.of(self.id).pipeline(transaction=False)
        pipe.exists(stream_key(self.id))
        pipe.hget(job_key(self.id), "state")
        exists, state = pipe.execute()
        if exists:
            return
        if state is None:
            raise JobNotFound(f"no job {self.id!r}: never submitted, or its record expired (RESULT_TTL_S)")
        if (state.decode() if isinstance(state, bytes) else state) in (JobState.DONE, JobState.CANCELLED):
            raise StreamExpired(
                f"job {self.id}: it ended and its stream expired (STREAM_TTL_S); result() still reads it"
            )

    def _stored_outcome(self) -> dict:
        """The ended job's result from its record; raises its error as the end entry would have."""
        stored = decode_fields(self.client.readers.of(self.id).hgetall(job_key(self.id)))
        if not stored:
            raise JobNotFound(f"no job {self.id!r}: its record expired (RESULT_TTL_S)")
        if "result" in stored:
            return json.loads(stored["result"])
        outcome({"type": EntryType.ERROR, "message": stored.get("error", "error"), "field": stored.get("field", "")})
        raise RuntimeError("unreachable: outcome() raises on an error entry")

    def cancel(self) -> str:
        """Cancel: a queued job ends at once; a running one is stopped by its worker within a step.
        Returns the state the job was in ("queued", "running", "done" or "cancelled")."""
        self.client.first_contact()
        s = self.client.settings
        end = json.dumps(cancelled_result(self.id))
        state = self.client.plane.durable(self.id).run(
            self.client.cancel_script,
            [job_key(self.id), stream_key(self.id), QUEUED],
            [s.stream.maxlen, s.stream.ttl_s, end, CANCEL_CHANNEL, self.id],
        )
        state = state.decode() if isinstance(state, bytes) else state
        if state in (JobState.QUEUED, JobState.RUNNING):
            self.client.app.control.revoke(self.id)
        return state

    def sse(self, timeout: float | None = None) -> Iterator[str]:
        """The job as server-sent events for a browser (sse.py: JSON data, an end or error event;
        closing it early cancels the job)."""
        from .sse import sse

        return sse(self, timeout)

    def asse(self, timeout: float | None = None) -> AsyncIterator[str]:
        """sse() for an async framework (FastAPI, Starlette, Django's async views)."""
        from .sse import asse

        return asse(self, timeout)

    async def astream(self, timeout: float | None = None) -> AsyncIterator[str]:
        """The asyncio variant of stream() (runs the blocking reads in a thread)."""
        it = self.stream(timeout)
        loop = asyncio.get_running_loop()
        sentinel = object()
        while True:
            item = await loop.run_in_executor(None, next, it, sentinel)
            if item is sentinel:
                return
            yield item

    async def aresult(self, timeout: float | None = None) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self.result, timeout)


class Client:
    """`redis_url` is the broker's (default REDIS_URL); the jobs' state and streams are on
    STREAMS_REDIS_URL's Redis (or its shards) when the settings name one, else on the broker's: `plane`
    and `readers` (for blocking reads) reach them, `redis` the plane's home (heartbeats), `broker` the
    queue."""

    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env()
        url = redis_url or self.settings.redis.resolved_url()
        self.url, self.streams_urls = url, self.settings.redis.streams_urls(url)
        self.streams_url = self.streams_urls[0]  # the plane's home
        self.plane = TokenPlane.connect(self.settings.redis, url, socket_timeout=30)
        self.redis = self.plane.home
        # XREAD blocks up to READ_BLOCK_MS, and redis-py's socket timeout bounds a blocked read too: keep
        # the timeout well above it.
        self.readers = TokenPlane.connect(self.settings.redis, url, socket_timeout=30)
        self.broker = self.redis if self.streams_url == url else connect(url, self.settings.redis, socket_timeout=30)
        self.backpressure = Backpressure(self.redis, self.broker, self.settings.queues)
        self.submit_script = self.redis.register_script(SUBMIT)
        self.cancel_script = self.redis.register_script(CANCEL)
        self.router = Router(self.redis, self.broker, self.settings.queues)  # which queue each job goes to (AFFINITY)
        # Fair staging (FAIR_QUEUE): jobs wait in their queue's staged sets, in the scheduler's order,
        # until a worker that can start them releases them (app/worker/intake.py)
        self.stages = self.settings.queues.fair_queue and own_transport(url)
        self._app = None
        self._reached = False

    def ping(self) -> None:
        """Reach every Redis this client uses (the broker's and the token plane's), one quick try each:
        raises RedisUnreachable (a redis.ConnectionError) naming the URL and the fix. Building a client
        contacts nothing (a web app imports without Redis, e.g. to collect static files); the first
        call that needs Redis checks, so a Redis that never answered fails in seconds, not after
        REDIS_RETRY_S, which is for one that answered and went away. Call it at start-up to fail there."""
        for url in dict.fromkeys([self.url, *self.streams_urls]):
            check_reachable(url, self.settings.redis)
        self._reached = True

    def first_contact(self) -> None:
        """ping() until it has passed once."""
        if not self._reached:
            self.ping()

    @property
    def app(self):
        """The client's Celery app, built (and Celery imported) when the first job is sent."""
        if self._app is None:
            from .celery_app import client_celery

            self._app = client_celery(self.settings, self.url)
        return self._app

    def submit(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        expires: float | datetime | None = None,
        **params,
    ) -> Job:
        """Check and enqueue (the fields of tasks/request.py's JobRequest); raises RequestError (naming
        the field) for a bad request, Overloaded when MAX_QUEUE_WAIT_S is set and the job would wait
        longer for a worker. `expires` (Celery's word: seconds from now, or a datetime) sets its
        `deadline`: a job that could not start by then is refused (DeadlineUnreachable) or ends
        unrun (its result raises JobExpired)."""
        request = {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "request_id": request_id, **params}
        if expires is not None:
            request["deadline"] = expires.timestamp() if isinstance(expires, datetime) else time.time() + expires
        return self.submit_many([request])[0]

    def submit_many(
        self, requests: Sequence[JobRequest | Mapping], *, checked: bool = False, background: bool | None = None
    ) -> list[Job]:
        """Enqueue several requests in two Redis round trips, however many: one pipeline records every
        job, one publishes every message. A JobRequest was checked when it was built; a dict (the
        submit() fields) is parsed here, and a bad one raises RequestError before anything is written.
        The gateway sends the requests that arrive together this way. `background`: dicts that name no
        priority run at BATCH_PRIORITY (None: when there are BULK_JOBS or more of them, offline work)."""
        self.first_contact()
        if background is None:
            background = len(requests) >= BULK_JOBS
        if background:
            requests = [
                r if isinstance(r, JobRequest) or "priority" in r else {**r, "priority": BATCH_PRIORITY}
                for r in requests
            ]
        jobs = [r if isinstance(r, JobRequest) else parse_request(r) for r in requests]
        if not checked and any(job.guided is not None or job.adapter for job in jobs):  # the gateway: Intake.parse
            structured = retrying(self.router.structured, self.settings.redis.retry_s, pause_s=0.2)
            adapters = self.router.adapters() if any(job.adapter for job in jobs) else None
            check_servable(
                jobs, structured, self.settings.queues.queue, adapters, served_model=self.settings.served.name()
            )
        if not checked:  # the gateway checks once per HTTP request, before its choices are parsed apart
            self.backpressure.admit(jobs)
        s = self.settings
        queues = retrying(lambda: self.router.queues(jobs), s.redis.retry_s, pause_s=0.2)
        shards = len(self.plane)
        ids = [
            job.request_id or self.plane.new_id(self.router.shard_span(queue, shards))
            for job, queue in zip(jobs, queues, strict=True)
        ]
        self.backpressure.submitted(ids, jobs)
        wire = [job.to_json() for job in jobs]
        now = repr(time.time())
        calls: dict[int, list] = {}
        for job_id, r, job in zip(ids, wire, jobs, strict=True):
            call = ([job_key(job_id), QUEUED], [json.dumps(r), now, s.stream.result_ttl_s, job_id, job.tenant])
            calls.setdefault(self.plane.index(job_id), []).append(call)
        # The request is kept with the job so that a worker can re-send a job whose message is lost
        # (app/worker/recovery.py): once this write is in, the job is accepted.
        # A restart or failover is waited out (REDIS_RETRY_S): once the job is recorded, giving up on its
        # message would leave it to the lost-job sweep. As with any broker, a publish retried after a
        # lost reply may deliver a message twice: delivery is at least once.
        for shard, shard_calls in calls.items():  # a retry re-runs a shard's calls: SUBMIT is idempotent
            run = self.plane.durables[shard].run_many
            retrying(lambda run=run, c=shard_calls: run(self.submit_script, c), s.redis.retry_s, pause_s=0.2)
        retrying(lambda: self._publish(ids, jobs, wire, queues), s.redis.retry_s, pause_s=0.2)
        return [Job(self, job_id) for job_id in ids]

    def _publish(self, ids: list[str], jobs: list[JobRequest], requests: list[dict], queues: list[str]) -> None:
        app = self.app
        with app.producer_or_acquire() as producer, publish_batch(producer, 4 * len(ids)):
            for job_id, job, request, queue in zip(ids, jobs, requests, queues, strict=True):
                staged = {"headers": {TENANT_HEADER: job.tenant, WEIGHT_HEADER: job_weight(job)}} if self.stages else {}
                app.send_task(
                    TASK_NAME,
                    args=[request],
                    task_id=job_id,
                    queue=staged_queue(queue) if self.stages else queue,
                    argsrepr=args_repr(request),
                    kwargsrepr="{}",
                    producer=producer,
                    priority=broker_priority(request["priority"]),
                    **staged,
                )

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)


def submit(prompt: str | None = None, **params) -> Job:
    """Enqueue with settings from the environment (REDIS_URL, or the embedded Redis)."""
    return Client().submit(prompt, **params)
