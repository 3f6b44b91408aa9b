"""The worker's stream writer: the engine's events become job stream entries and final job states
(the keys and entry shapes are the job contract's, tasks/contract.py)."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid

import redis

from app.metrics import EngineMetrics
from app.redis_conn import Durable, NotReplicated, is_transient
from engine import Event, FinishEvent
from tasks.contract import (
    WRITE_BATCH,
    EntryType,
    JobState,
    field_of,
    job_key,
    job_of_stream,
    result_dict,
    stream_key,
    writer_key,
)

log = logging.getLogger(__name__)


SHUTDOWN = "worker shutdown"  # the error of requests the engine stops at a warm shutdown


class StreamPublisher:
    """The engine's event sink: buffers a step's events and writes them in one pipeline.

    `__call__` runs on the engine thread and only appends; `flush()` (end of each step) hands the
    batch to a writer thread, so Redis round trips overlap the next forward pass.
    """

    def __init__(
        self, client: redis.Redis, *, maxlen: int, ttl_s: int, job_ttl_s: int = 86_400, durable: Durable | None = None
    ) -> None:
        self.client = client
        self.durable = durable or Durable(client, 0, 0)
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.job_ttl_s = job_ttl_s
        self._pending: list[tuple[Event, float]] = []
        self._batches: queue.SimpleQueue[list[tuple[Event, float]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="weightq-streams", daemon=True)
        self._writer.start()
        self.annotations: dict[str, dict] = {}  # job id -> fields added to its result (attempt, worker)
        self.requeueing = False  # set at shutdown: jobs the engine stops go back to the queue, so no end entry
        self.metrics: EngineMetrics | None = None
        self.writer_key = writer_key(uuid.uuid4().hex)  # the last batch applied (see _apply)
        self._finals: dict[str, threading.Event] = {}  # job id -> set once its finish is written (see expect)
        self._seq = 0
        self._batch_script = client.register_script(WRITE_BATCH)

    def __call__(self, event: Event, emitted: float | None = None) -> None:
        """`emitted`: the engine's stamp when it runs in a process of its own (else now)."""
        self._pending.append((event, emitted or time.time()))  # readers measure latency from here
        if self.metrics is not None and isinstance(event, FinishEvent):
            self.metrics.observe(event)

    def expect(self, job_id: str) -> threading.Event:
        """An event set once the job's last entry and final state are in Redis (or its finish was
        skipped: a job going back to the queue). Its task must not finish (be acked) before: a worker
        killed in between would leave a job that no redelivery runs again and no reader sees end."""
        written = self._finals[job_id] = threading.Event()
        return written

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self._batches.put(batch)

    def close(self) -> None:
        self.flush()
        self._batches.put(None)
        self._writer.join(10)

    def _write_loop(self) -> None:
        while True:
            batch = self._batches.get()
            if batch is None:
                return
            entries = self._entries(batch)
            self._seq += 1
            while entries:
                try:
                    self._apply(self._seq, entries)
                    break
                except redis.RedisError as e:
                    if is_transient(e):  # Redis restarting or failing over: one line, not a traceback
                        log.warning("writing %d stream entries: %s; retrying", len(entries), e)
                        time.sleep(0.1 if isinstance(e, NotReplicated) else 0.5)
                    else:
                        log.exception("writing %d stream entries failed; retrying", len(entries))
                        time.sleep(0.5)
            for ev, _ in batch:
                if isinstance(ev, FinishEvent) and (written := self._finals.pop(ev.request_id, None)):
                    written.set()

    def _entries(self, batch: list[tuple[Event, float]]) -> list[tuple[str, dict, dict | None]]:
        """(stream key, fields, the job's final state or None) for each event worth writing."""
        out: list[tuple[str, dict, dict | None]] = []
        for ev, emitted in batch:
            key = stream_key(ev.request_id)
            if isinstance(ev, FinishEvent):
                extra = self.annotations.pop(ev.request_id, {})
                if self.requeueing and ev.reason == "cancelled" and ev.error == SHUTDOWN:
                    continue  # requeued (or ended by the REQUEUE script): jobs.py. A client's cancel ends here.
                if ev.reason == "error":
                    message, fld = ev.error or "error", field_of(ev.error)
                    fields = {"type": EntryType.ERROR, "message": message, "field": fld}
                    state = {"state": JobState.DONE, "error": message, "field": fld}
                else:
                    result = json.dumps(result_dict(ev) | extra)
                    fields = {"type": EntryType.END, "reason": ev.reason, "result": result}
                    final = JobState.CANCELLED if ev.reason == "cancelled" else JobState.DONE
                    state = {"state": final, "result": result}
                out.append((key, fields, state))
            else:
                fields = {
                    "type": EntryType.TOKEN,
                    "i": ev.index,
                    "text": ev.text,
                    "id": ev.token_id,
                    "ts": f"{emitted:.6f}",
                }
                if ev.logprobs is not None:  # [token, logprob, top ids, top tokens, top logprobs]
                    fields["lp"] = json.dumps(ev.logprobs.as_json(), separators=(",", ":"))
                out.append((key, fields, None))
        return out

    def _apply(self, seq: int, entries: list[tuple[str, dict, dict | None]]) -> None:
        """One script call per batch, applied at most once: a retry after a lost reply (Redis
        crashed after applying it) is a no-op instead of a second copy of every entry."""
        keys = [self.writer_key]
        index: dict[str, int] = {}

        def slot(key: str) -> int:
            if key not in index:
                keys.append(key)
                index[key] = len(keys)
            return index[key]

        args: list = [self.maxlen, self.ttl_s, self.job_ttl_s, seq]
        for key, fields, state in entries:
            if state is None and len(fields) == 5 and fields["type"] is EntryType.TOKEN:  # the plain token form
                args += [slot(key), 0, fields["i"], fields["text"], fields["id"], fields["ts"]]
                continue
            job = slot(job_key(job_of_stream(key))) if state is not None else 0
            args += [slot(key), len(fields), job, len(state or {})]
            for k, v in fields.items():
                args += [k, v]
            for k, v in (state or {}).items():
                args += [k, v]
        self.durable.run(self._batch_script, keys, args)
