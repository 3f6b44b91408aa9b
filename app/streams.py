"""Token streams and job state in Redis.

Keys (all expire; see Settings):
  weightq:stream:{id}  a Redis Stream of the job's entries, oldest first:
      {"type": "attempt", "attempt": n}                  written first by every run of the job
      {"type": "token", "i": index, "text": delta, "id": token id, "ts": engine emit time (unix s)}
      {"type": "end", "reason": ..., "result": JSON}     the last entry of a finished job
      {"type": "error", "message": ..., "field": ...}    the last entry of a failed job
  weightq:job:{id}     a hash: state (queued | running | done | cancelled), attempt, cancel, result
  weightq:cancel       a pub/sub channel: a running job's id, published when a client cancels it

A reader reads the stream from 0-0, so attaching late misses nothing; on an attempt marker after
tokens it drops what it had (a worker died and the job is running again elsewhere).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

import redis

from engine import Event, FinishEvent

from .metrics import EngineMetrics

log = logging.getLogger(__name__)


def stream_key(job_id: str) -> str:
    return f"weightq:stream:{job_id}"


def job_key(job_id: str) -> str:
    return f"weightq:job:{job_id}"


CANCEL_CHANNEL = "weightq:cancel"

# Start (or restart) a run: refuse a cancelled or finished job, else bump the attempt and mark it.
BEGIN = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'cancelled' or redis.call('HGET', KEYS[1], 'cancel') then return {-1, ''} end
if state == 'done' then return {-2, redis.call('HGET', KEYS[1], 'result') or ''} end
local n = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'state', 'running')
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'attempt', 'attempt', n)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {n, ''}
"""

# Cancel from a client: a queued job ends here and now; a running one is flagged for its worker.
CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'done' or state == 'cancelled' then return state end
if state == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  redis.call('PUBLISH', ARGV[4], ARGV[5])
  return 'running'
end
redis.call('HSET', KEYS[1], 'state', 'cancelled')
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'end', 'reason', 'cancelled', 'result', ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 'queued'
"""


class StreamPublisher:
    """The engine's event sink: buffers a step's events and writes them in one pipeline.

    `__call__` runs on the engine thread and only appends; `flush()` (end of each step) hands the
    batch to a writer thread, so Redis round trips overlap the next forward pass.
    """

    def __init__(self, client: redis.Redis, *, maxlen: int, ttl_s: int) -> None:
        self.client = client
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self._pending: list[tuple[Event, float]] = []
        self._batches: queue.SimpleQueue[list[tuple[Event, float]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="weightq-streams", daemon=True)
        self._writer.start()
        self.annotations: dict[str, dict] = {}  # job id -> fields added to its result (attempt, worker)
        self.requeueing = False  # set at shutdown: cancelled jobs go back to the queue, so no end entry
        self.metrics: EngineMetrics | None = None

    def __call__(self, event: Event) -> None:
        self._pending.append((event, time.time()))  # stamped at emission: readers measure latency from here
        if self.metrics is not None and isinstance(event, FinishEvent):
            self.metrics.observe(event)

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
            while True:
                try:
                    self._write(batch)
                    break
                except redis.RedisError:
                    log.exception("writing %d stream entries failed; retrying", len(batch))
                    time.sleep(0.5)

    def _write(self, batch: list[tuple[Event, float]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for ev, emitted in batch:
            key = stream_key(ev.request_id)
            if isinstance(ev, FinishEvent):
                extra = self.annotations.pop(ev.request_id, {})
                if self.requeueing and ev.reason == "cancelled":
                    continue
                if ev.reason == "error":
                    fields = {"type": "error", "message": ev.error or "error", "field": field_of(ev.error)}
                else:
                    result = result_dict(ev) | extra
                    fields = {"type": "end", "reason": ev.reason, "result": json.dumps(result)}
                pipe.xadd(key, fields, maxlen=self.maxlen, approximate=True)
                pipe.expire(key, self.ttl_s)
            else:
                fields = {"type": "token", "i": ev.index, "text": ev.text, "id": ev.token_id, "ts": f"{emitted:.6f}"}
                pipe.xadd(key, fields, maxlen=self.maxlen, approximate=True)
        pipe.execute()


def field_of(message: str | None) -> str:
    head = (message or "").split(":", 1)[0]
    return head if head.isidentifier() else ""


def cancelled_result(job_id: str) -> dict:
    """The result of a job cancelled before it ever ran."""
    return {
        "id": job_id,
        "text": "",
        "finish_reason": "cancelled",
        "token_ids": [],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        "timings": {},
    }


def result_dict(ev: FinishEvent) -> dict:
    """The JSON result of a generation (the task's return value)."""
    return {
        "id": ev.request_id,
        "text": ev.text,
        "finish_reason": ev.reason,
        "token_ids": list(ev.token_ids),
        "usage": {
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        },
        "timings": {"queue_s": round(ev.queue_s, 6), "ttft_s": round(ev.ttft_s, 6), "total_s": round(ev.total_s, 6)},
    }
