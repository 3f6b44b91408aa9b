"""Token streams and job state in Redis.

Keys (all expire; see Settings):
  weightq:stream:{id}  a Redis Stream of the job's entries, oldest first:
      {"type": "attempt", "attempt": n}                  written first by every run of the job
      {"type": "token", "i": index, "text": delta, "id": token id, "ts": engine emit time (unix s)}
      {"type": "end", "reason": ..., "result": JSON}     the last entry of a finished job
      {"type": "error", "message": ..., "field": ...}    the last entry of a failed job
  weightq:job:{id}     a hash: state (queued | running | done | cancelled), attempt, cancel, result,
                       error and field (a failed job), request and queued_at (for recovery)
  weightq:queued       a sorted set: ids of jobs submitted and not yet started, by submission time
  weightq:started_hw   the latest submission time of any job that has started (FIFO high-water mark)
  weightq:dead         a list: JSON records of dead-lettered jobs (too many attempts), newest first
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
import uuid

import redis

from engine import Event, FinishEvent

from .metrics import EngineMetrics

log = logging.getLogger(__name__)


def stream_key(job_id: str) -> str:
    return f"weightq:stream:{job_id}"


def job_key(job_id: str) -> str:
    return f"weightq:job:{job_id}"


CANCEL_CHANNEL = "weightq:cancel"

QUEUED = "weightq:queued"
STARTED_HW = "weightq:started_hw"
DEAD = "weightq:dead"

# Start (or restart) a run: refuse a cancelled or finished job; dead-letter one that has been started
# too often (a poison job that kills its worker every time); else bump the attempt and mark it.
# KEYS: job hash, stream, queued set, high-water mark, dead list.
# ARGV: stream maxlen, stream ttl, job ttl, max attempts, now, worker name, job id, cancelled result.
BEGIN = """
local state = redis.call('HGET', KEYS[1], 'state')
redis.call('ZREM', KEYS[3], ARGV[7])
if state == 'cancelled' or redis.call('HGET', KEYS[1], 'cancel') then
  if state ~= 'cancelled' then  -- cancelled while its worker died: end it here, once
    redis.call('HSET', KEYS[1], 'state', 'cancelled')
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'end', 'reason', 'cancelled', 'result', ARGV[8])
    redis.call('EXPIRE', KEYS[2], ARGV[2])
  end
  return {-1, ''}
end
if state == 'done' then return {-2, redis.call('HGET', KEYS[1], 'result') or ''} end
local q = tonumber(redis.call('HGET', KEYS[1], 'queued_at') or '0')
if q > tonumber(redis.call('GET', KEYS[4]) or '0') then redis.call('SET', KEYS[4], q) end
local n = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('EXPIRE', KEYS[1], ARGV[3])
if n > tonumber(ARGV[4]) then
  local msg = 'dead-lettered: started ' .. (n - 1) .. ' times without finishing (the limit is ' .. ARGV[4] ..
    '); its worker may crash on it'
  redis.call('HSET', KEYS[1], 'state', 'done', 'error', msg, 'field', '')
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'error', 'message', msg, 'field', '')
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('LPUSH', KEYS[5], cjson.encode({id = ARGV[7], attempts = n - 1, at = tonumber(ARGV[5]),
    worker = ARGV[6], request = redis.call('HGET', KEYS[1], 'request') or ''}))
  return {-3, msg}
end
redis.call('HSET', KEYS[1], 'state', 'running')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'attempt', 'attempt', n)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {n, ''}
"""

# Fail a job before it runs (a refused request): once, however often it is retried or redelivered.
# KEYS: job hash, stream, queued set. ARGV: stream maxlen, stream ttl, job ttl, message, field, job id.
FAIL = """
if redis.call('HGET', KEYS[1], 'state') == 'done' then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'error', 'message', ARGV[4], 'field', ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'done', 'error', ARGV[4], 'field', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[6])
return 1
"""

# A step's stream entries, applied at most once per (writer, seq). A job's last entry and its final
# state go together, so a worker that dies after writing the end never leaves a 'running' job that a
# redelivery would run again.
# KEYS: the writer's key, then streams and job hashes. ARGV: maxlen, stream ttl, job ttl, seq, then
# per entry: stream index (into KEYS), job index (0: none), number of field pairs, number of job-state
# pairs, the field pairs, the job-state pairs.
WRITE_BATCH = """
if tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[4]) then return 0 end
redis.call('SET', KEYS[1], ARGV[4], 'EX', 86400)
local i = 5
while i <= #ARGV do
  local key = KEYS[tonumber(ARGV[i])]
  local job = tonumber(ARGV[i + 1])
  local n, m = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local cmd = {'XADD', key, 'MAXLEN', '~', ARGV[1], '*'}
  for j = 1, 2 * n do cmd[#cmd + 1] = ARGV[i + 3 + j] end
  redis.call(unpack(cmd))
  if job > 0 then
    redis.call('EXPIRE', key, ARGV[2])
    local h = {'HSET', KEYS[job]}
    for j = 1, 2 * m do h[#h + 1] = ARGV[i + 3 + 2 * n + j] end
    if m > 0 then redis.call(unpack(h)) end
    redis.call('EXPIRE', KEYS[job], ARGV[3])
  end
  i = i + 4 + 2 * n + 2 * m
end
return 1
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
redis.call('ZREM', KEYS[3], ARGV[5])
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

    def __init__(self, client: redis.Redis, *, maxlen: int, ttl_s: int, job_ttl_s: int = 86_400) -> None:
        self.client = client
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.job_ttl_s = job_ttl_s
        self._pending: list[tuple[Event, float]] = []
        self._batches: queue.SimpleQueue[list[tuple[Event, float]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="weightq-streams", daemon=True)
        self._writer.start()
        self.annotations: dict[str, dict] = {}  # job id -> fields added to its result (attempt, worker)
        self.requeueing = False  # set at shutdown: cancelled jobs go back to the queue, so no end entry
        self.metrics: EngineMetrics | None = None
        self.writer_key = f"weightq:writer:{uuid.uuid4().hex}"  # the last batch applied (see _apply)
        self._finals: dict[str, threading.Event] = {}  # job id -> set once its finish is written (see expect)
        self._seq = 0
        self._batch_script = client.register_script(WRITE_BATCH)

    def __call__(self, event: Event) -> None:
        self._pending.append((event, time.time()))  # stamped at emission: readers measure latency from here
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
                except redis.RedisError:
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
                if self.requeueing and ev.reason == "cancelled":
                    continue
                if ev.reason == "error":
                    message, fld = ev.error or "error", field_of(ev.error)
                    fields = {"type": "error", "message": message, "field": fld}
                    state = {"state": "done", "error": message, "field": fld}
                else:
                    result = json.dumps(result_dict(ev) | extra)
                    fields = {"type": "end", "reason": ev.reason, "result": result}
                    state = {"state": "cancelled" if ev.reason == "cancelled" else "done", "result": result}
                out.append((key, fields, state))
            else:
                fields = {"type": "token", "i": ev.index, "text": ev.text, "id": ev.token_id, "ts": f"{emitted:.6f}"}
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
            job = slot(job_key(key.removeprefix("weightq:stream:"))) if state is not None else 0
            args += [slot(key), job, len(fields), len(state or {})]
            for k, v in fields.items():
                args += [k, v]
            for k, v in (state or {}).items():
                args += [k, v]
        self._batch_script(keys=keys, args=args, client=self.client)


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
