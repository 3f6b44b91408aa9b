"""The job contract: how a client, the gateway and a worker meet in Redis. Readers and the writer
import it; nothing else spells a key, an entry type or the task name.

Keys (all expire; see Settings):
  weightq:stream:{id}  a Redis Stream of the job's entries, oldest first:
      {"type": "attempt", "attempt": n, "from": k}       written first by every run of the job: it
                                                         resumes after the k tokens already in the stream
      {"type": "token", "i": index, "text": delta, "id": token id, "ts": engine emit time (unix s)}
          and, when the request asks for logprobs, "lp": JSON [token text, logprob, top ids, top
          tokens, top logprobs] (the model's log_softmax, best first)
      {"type": "end", "reason": ..., "result": JSON}     the last entry of a finished job
      {"type": "error", "message": ..., "field": ...}    the last entry of a failed job
  weightq:job:{id}     a hash: state (queued | running | done | cancelled), tenant (whose job it is),
                       attempt (runs begun: the fence of stream writes), crashes (worker deaths charged
                       to it), run and owner (the run and worker instance that began it last), charged
                       (the last dead run counted), cancel, result, error and field (a failed job),
                       request and queued_at (for recovery)
  weightq:queued       a sorted set: ids of jobs submitted and not yet started, by submission time
  weightq:started-hw   a hash: per priority class, the latest submission time of a job of that class
                       that has started (FIFO high-water marks: the broker keeps a list per class)
  weightq:dead         a list: JSON records of dead-lettered jobs (too many attempts), newest first
  weightq:workers      a hash: each worker's heartbeat (its stats as JSON, with "ts", "queue" and
                       "served_model")
  weightq:leases       a hash: each worker instance (hostname/random) that may hold jobs -> its hostname
  weightq:lease:{instance}         a key that lives while the instance renews it (LEASE_TTL_S)
  weightq:held:{instance}          a set: the delivery tags of the messages the instance holds
  weightq:engine-jobs:{instance}   a set: the jobs inside the instance's engine (charged if it dies)
  weightq:resuming     a set: jobs a dead worker's reaper sent back, until a run of them begins
  weightq:cancel       a pub/sub channel: a running job's id, published when a client cancels it

A reader reads the stream from 0-0, so attaching late misses nothing. A job that runs again after its
worker died (or went back to the queue) resumes: its new attempt entry says how many tokens the stream
holds, the run continues from them at the next index, and stream writes of any earlier run are refused
from the moment the new one begins (WRITE_BATCH's fence). So every index is written once and the
tokens' texts join into the result's text; `Replay` only guards readers against anything else.

The task `TASK_NAME` takes a request's JSON (tasks/request.py: `JobRequest.to_json()`) and returns
`result_dict`'s shape (with "logprobs", one "lp" list per output token, and "prompt_logprobs" with
"prompt_token_ids", when the request asks for them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .results import Finished

TASK_NAME = "weightq.generate"

STREAM_PREFIX = "weightq:stream:"
JOB_PREFIX = "weightq:job:"
CANCEL_CHANNEL = "weightq:cancel"
QUEUED = "weightq:queued"
STARTED_HW = "weightq:started-hw"
DEAD = "weightq:dead"
HEARTBEATS = "weightq:workers"
RECOVER_LOCK = "weightq:recover-lock"
LEASES = "weightq:leases"
RESUMING = "weightq:resuming"
# One entry (MAXLEN 1) per batch of stream entries a worker writes: a reader following many streams
# blocks on this one key and then reads them all, where a blocked XREAD of hundreds of keys cost a
# full command to send and Redis 6 answered it with just the stream that woke it.
STREAM_TICK = "weightq:stream-tick"
RUNNING_STREAM_TTL_S = 86_400  # a running job's stream lives a day; once it ends, STREAM_TTL_S
SINGLETONS = (CANCEL_CHANNEL, QUEUED, STARTED_HW, DEAD, HEARTBEATS, RECOVER_LOCK, STREAM_TICK, LEASES, RESUMING)


def stream_key(job_id: str) -> str:
    return STREAM_PREFIX + job_id


def job_key(job_id: str) -> str:
    return JOB_PREFIX + job_id


def job_of_stream(key: str) -> str:
    return key.removeprefix(STREAM_PREFIX)


def lease_key(instance: str) -> str:
    return f"weightq:lease:{instance}"


def held_key(instance: str) -> str:
    return f"weightq:held:{instance}"


def engine_jobs_key(instance: str) -> str:
    return f"weightq:engine-jobs:{instance}"


def writer_key(token: str) -> str:
    """A stream writer's record of the last batch it applied (see WRITE_BATCH)."""
    return f"weightq:writer:{token}"


class EntryType(StrEnum):
    ATTEMPT = "attempt"
    TOKEN = "token"
    END = "end"
    ERROR = "error"


END_TYPES = frozenset({EntryType.END, EntryType.ERROR})


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


class JobFailed(RuntimeError):
    """The job ended with an error entry; `field` names the request field when the request was bad."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def decode_fields(raw: Mapping) -> dict[str, str]:
    """A stream entry's fields as str (redis-py returns bytes unless decode_responses is set)."""
    return {
        k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v for k, v in raw.items()
    }


def args_repr(request: Mapping[str, Any]) -> str:
    """The job message's `argsrepr` (what Flower and `celery inspect` show): the request with its token
    lists and long texts summarised. Celery's own saferepr walks every token id, which was a quarter
    of a submission's time."""
    shown = {
        k: f"<{len(v)} items>"
        if isinstance(v, list)
        else (v[:200] + "...")
        if isinstance(v, str) and len(v) > 200
        else v
        for k, v in request.items()
    }
    return repr([shown])


def is_end(fields: Mapping[str, str]) -> bool:
    return fields.get("type") in END_TYPES


def outcome(fields: Mapping[str, str]) -> dict | None:
    """The job's result if this is its end entry; raises JobFailed on its error entry; else None."""
    kind = fields.get("type")
    if kind == EntryType.END:
        return json.loads(fields["result"])
    if kind == EntryType.ERROR:
        raise JobFailed(fields.get("message") or "error", fields.get("field") or "")
    return None


class Replay:
    """Drops a token whose index a reader already has. Runs resume rather than restart and fenced
    writes never double an index, so nothing is dropped today; it keeps readers exact regardless."""

    __slots__ = ("delivered",)

    def __init__(self) -> None:
        self.delivered = 0

    def fresh(self, fields: Mapping[str, str]) -> bool:
        if fields.get("type") != EntryType.TOKEN:
            return True
        i = int(fields.get("i", 0))
        if i < self.delivered:
            return False
        self.delivered = i + 1
        return True


@dataclass(slots=True)
class Emitted:
    """What a job's stream says its runs have emitted so far, in index order: the token ids, their
    texts, and their log-probabilities as streamed ("lp" JSON, when the request asked for them)."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[str] = field(default_factory=list)

    def add(self, fields: Mapping[str, str]) -> None:
        """A token entry; one at an index already held replaces it and what follows (a run that
        restarted from there, as runs of older versions did)."""
        i = int(fields["i"])
        if i > len(self.token_ids):
            raise ValueError(f"token {i} follows token {len(self.token_ids) - 1}: the stream was trimmed")
        for held in (self.token_ids, self.texts, self.logprobs):
            del held[i:]
        self.token_ids.append(int(fields["id"]))
        self.texts.append(fields.get("text", ""))
        if "lp" in fields:
            self.logprobs.append(fields["lp"])


def emitted_tokens(entries: list[Mapping[str, str]]) -> Emitted:
    """The tokens a job's stream holds (its entries' fields, oldest first)."""
    out = Emitted()
    for fields in entries:
        if fields.get("type") == EntryType.TOKEN:
            out.add(fields)
    return out


def field_of(message: str | None) -> str:
    """The request field an engine error names (its "field: ..." prefix), or ""."""
    head = (message or "").split(":", 1)[0]
    return head if head.isidentifier() else ""


def cancelled_result(job_id: str) -> dict[str, Any]:
    """The result of a job cancelled before it ever ran."""
    return {
        "id": job_id,
        "text": "",
        "finish_reason": "cancelled",
        "token_ids": [],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        "timings": {},
    }


def result_dict(ev: Finished) -> dict[str, Any]:
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
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
        },
        "timings": {"queue_s": round(ev.queue_s, 6), "ttft_s": round(ev.ttft_s, 6), "total_s": round(ev.total_s, 6)},
        **({"logprobs": [lp.as_json() for lp in ev.logprobs]} if ev.logprobs is not None else {}),
        **(
            {
                "prompt_logprobs": [lp.as_json() for lp in ev.prompt_logprobs],
                "prompt_token_ids": list(ev.prompt_token_ids or ()),
            }
            if ev.prompt_logprobs is not None
            else {}
        ),
    }


# ----- the scripts that change a job's state (atomic in Redis) ------------------------------------

# Submit: the job's state, tenant and request (kept so that a job whose message is lost can be sent
# again) and its place in the queued set; a known id keeps what it has.
# KEYS: job hash, queued set. ARGV: request JSON, now, job ttl, job id, tenant.
SUBMIT = """
redis.call('HSETNX', KEYS[1], 'state', 'queued')
redis.call('HSETNX', KEYS[1], 'tenant', ARGV[5])
redis.call('HSETNX', KEYS[1], 'request', ARGV[1])
redis.call('HSETNX', KEYS[1], 'queued_at', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[4])
"""

# Back to the queue at a worker's shutdown, listed as queued since `since` (see JobRunner._requeue);
# unless its client cancelled it meanwhile (the flag is set even if the engine never heard of it):
# then it ends here, cancelled, with what it had generated. Returns 1 when it ended, 0 when requeued,
# 2 when a later run has begun (this one's worker was taken for dead: nothing to do).
# KEYS: job hash, queued set, stream. ARGV: since, job id, result JSON, stream maxlen, stream ttl, attempt.
REQUEUE = """
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[6] then return 2 end
if redis.call('HGET', KEYS[1], 'cancel') then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'result', ARGV[3])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'type', 'end', 'reason', 'cancelled', 'result', ARGV[3])
  redis.call('EXPIRE', KEYS[3], ARGV[5])
  return 1
end
redis.call('HSET', KEYS[1], 'state', 'queued')
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[2])
return 0
"""

# Start (or resume) a run: refuse a cancelled or finished job; dead-letter one charged with
# `max attempts` worker crashes (the last while it ran alone: see app/worker/reaper.py); else bump the
# attempt (the fence: stream writes of any earlier run are refused from now on), record the run and
# the worker instance, and mark the stream with where this run resumes (the index after its last
# token). A job still 'running' from a run nobody charged, whose worker instance is still registered
# (kombu's visibility timeout brought it back before any reaper saw that worker die), is charged here;
# once a reaper has handled an instance (charged or released its jobs, then unregistered it), its
# runs are never charged again. A retry of the same run's BEGIN (its reply was lost, or replicas did
# not confirm it) is a no-op answering the same: retries never count. Warm-shutdown requeues and
# redeliveries are runs, never crashes.
# KEYS: job hash, stream, queued set, high-water mark, dead list, the instance's held tags, RESUMING,
# LEASES.
# ARGV: stream maxlen, stream ttl, job ttl, max attempts, now, worker name, job id, cancelled result,
# run id (unique per run), the job's priority class, worker instance, delivery tag ('' if none).
# Returns {attempt, '', the job's submission stamp, crashes, resumed from} for a run that starts, else
# {code < 0, the stored result or the dead letter's message}: -1 cancelled, -2 done, -3 dead-lettered.
BEGIN = """
local state = redis.call('HGET', KEYS[1], 'state')
redis.call('ZREM', KEYS[3], ARGV[7])
redis.call('SREM', KEYS[7], ARGV[7])
if state == 'cancelled' or redis.call('HGET', KEYS[1], 'cancel') then
  if state ~= 'cancelled' then  -- cancelled while its worker died: end it here, once
    redis.call('HSET', KEYS[1], 'state', 'cancelled')
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'end', 'reason', 'cancelled', 'result', ARGV[8])
    redis.call('EXPIRE', KEYS[2], ARGV[2])
  end
  return {-1, ''}
end
if state == 'done' then return {-2, redis.call('HGET', KEYS[1], 'result') or ''} end
local run = redis.call('HGET', KEYS[1], 'run')
local crashes = tonumber(redis.call('HGET', KEYS[1], 'crashes') or '0')
local submitted = redis.call('HGET', KEYS[1], 'queued_at') or ''
if state == 'running' and run == ARGV[9] then
  return {tonumber(redis.call('HGET', KEYS[1], 'attempt')), '', submitted, crashes,
    tonumber(redis.call('HGET', KEYS[1], 'from'))}
end
if ARGV[12] ~= '' then
  redis.call('SADD', KEYS[6], ARGV[12])
  redis.call('EXPIRE', KEYS[6], 86400)
end
local q = tonumber(redis.call('HGET', KEYS[1], 'queued_at') or '0')
if q > tonumber(redis.call('HGET', KEYS[4], ARGV[10]) or '0') then redis.call('HSET', KEYS[4], ARGV[10], q) end
local owner = redis.call('HGET', KEYS[1], 'owner')
if state == 'running' and run and redis.call('HGET', KEYS[1], 'charged') ~= run and owner
    and redis.call('HEXISTS', KEYS[8], owner) == 1 then
  crashes = redis.call('HINCRBY', KEYS[1], 'crashes', 1)
  redis.call('HSET', KEYS[1], 'charged', run)
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if crashes >= tonumber(ARGV[4]) then
  local msg = 'dead-lettered: its worker died ' .. crashes .. ' times while running it, the last time with ' ..
    'no other job (the limit is ' .. ARGV[4] .. '); it may crash the worker'
  redis.call('HSET', KEYS[1], 'state', 'done', 'error', msg, 'field', '')
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'error', 'message', msg, 'field', '')
  redis.call('EXPIRE', KEYS[2], ARGV[2])
  redis.call('LPUSH', KEYS[5], cjson.encode({id = ARGV[7], attempts = crashes, at = tonumber(ARGV[5]),
    worker = ARGV[6], request = redis.call('HGET', KEYS[1], 'request') or ''}))
  return {-3, msg}
end
local n = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
local from, before = 0, '+'
while true do  -- the last token entry (a few attempt entries may follow it)
  local rows = redis.call('XREVRANGE', KEYS[2], before, '-', 'COUNT', 16)
  for _, row in ipairs(rows) do
    local f = row[2]
    for j = 1, #f, 2 do
      if f[j] == 'type' and f[j + 1] == 'token' then
        for k = 1, #f, 2 do if f[k] == 'i' then from = tonumber(f[k + 1]) + 1 end end
      end
    end
    if from > 0 then break end
    before = '(' .. row[1]
  end
  if from > 0 or #rows < 16 then break end
end
redis.call('HSET', KEYS[1], 'state', 'running', 'run', ARGV[9], 'owner', ARGV[11], 'from', from)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'attempt', 'attempt', n, 'from', from)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {n, '', submitted, crashes, from}
"""

# The jobs of a worker instance found dead (app/worker/reaper.py): those inside its engine are charged
# a crash, the others it held are released uncharged; each dead run once, however many reapers race.
# Each is listed in RESUMING until a run of it begins (BEGIN), so that the lost-job sweep re-sends it
# should its message be lost on the way (a worker killed between taking it and recording it).
# KEYS: RESUMING, then job hashes. ARGV: the instance, then per job 1 (inside its engine) or 0 and its id.
# Returns the hash keys of the jobs charged.
CHARGE = """
local out = {}
for i = 2, #KEYS do
  local key = KEYS[i]
  local run = redis.call('HGET', key, 'run')
  if run and redis.call('HGET', key, 'state') == 'running' and redis.call('HGET', key, 'owner') == ARGV[1]
      and redis.call('HGET', key, 'charged') ~= run then
    if ARGV[2 * i - 2] == '1' then
      redis.call('HINCRBY', key, 'crashes', 1)
      out[#out + 1] = key
    end
    redis.call('HSET', key, 'charged', run)
    redis.call('SADD', KEYS[1], ARGV[2 * i - 1])
  end
end
return out
"""

# Fail a job before it runs (a refused request): once, however often it is retried or redelivered.
# Or fail a run that raised (ARGV[7], its attempt: a no-op once a later run has begun).
# KEYS: job hash, stream, queued set. ARGV: stream maxlen, stream ttl, job ttl, message, field, job id, attempt or ''.
FAIL = """
if redis.call('HGET', KEYS[1], 'state') == 'done' then return 0 end
if ARGV[7] ~= '' and redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[7] then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'error', 'message', ARGV[4], 'field', ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'done', 'error', ARGV[4], 'field', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[6])
return 1
"""

# End a running job with an error entry when a worker cannot write its stream (a non-transient error,
# e.g. OOM under maxmemory) instead of retrying for ever. Its first write (HDEL of the stored request,
# which a finished job no longer needs) frees memory and is not refused under maxmemory; Redis then
# lets the script's other writes through (a script that has begun writing is not stopped midway).
# Fenced as WRITE_BATCH is: a job that has begun a later run than the writer's is not its to end (2).
# KEYS: job hash, stream. ARGV: stream maxlen, stream ttl, job ttl, message, the writer's attempt ('': any).
ABORT = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'done' or state == 'cancelled' then return 0 end
if ARGV[5] ~= '' and redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[5] then return 2 end
redis.call('HDEL', KEYS[1], 'request')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'error', 'message', ARGV[4], 'field', '')
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'done', 'error', ARGV[4], 'field', '')
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# A step's stream entries, applied at most once per (writer, seq). A job's last entry and its final
# state go together, so a worker that dies after writing the end never leaves a 'running' job that a
# redelivery would run again. Fenced: a stream whose job has begun a later run than the writer's
# (its worker was paused, taken for dead, and the job resumed elsewhere) gets nothing.
# Then one STREAM_TICK entry, after them all (readers block on it).
# KEYS: the writer's key, STREAM_TICK, then streams and job hashes. ARGV: maxlen, stream ttl, job ttl, seq,
# the number of fences, per fence its stream index, job index (into KEYS) and the writer's attempt;
# then per entry its stream index and either 0 and a plain token's four values (index, text,
# token id, emit stamp: most entries, in half the arguments) or the number of field pairs, the job
# index (0: none), the number of job-state pairs, the field pairs, the job-state pairs.
# Returns the job hashes fenced off.
WRITE_BATCH = """
if tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[4]) then return {} end
redis.call('SET', KEYS[1], ARGV[4], 'EX', 86400)
local maxlen = ARGV[1]
local fenced, out = {}, {}
local i = 6
for _ = 1, tonumber(ARGV[5]) do
  local job = KEYS[tonumber(ARGV[i + 1])]
  if redis.call('HGET', job, 'attempt') ~= ARGV[i + 2] then
    fenced[tonumber(ARGV[i])] = true
    out[#out + 1] = job
  end
  i = i + 3
end
while i <= #ARGV do
  local key = KEYS[tonumber(ARGV[i])]
  local skip = fenced[tonumber(ARGV[i])]
  local n = tonumber(ARGV[i + 1])
  if n == 0 then
    if not skip then
      redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'type', 'token', 'i', ARGV[i + 2], 'text', ARGV[i + 3],
        'id', ARGV[i + 4], 'ts', ARGV[i + 5])
    end
    i = i + 6
  elseif skip then
    i = i + 4 + 2 * n + 2 * tonumber(ARGV[i + 3])
  else
    local job, m = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    local cmd = {'XADD', key, 'MAXLEN', '~', maxlen, '*'}
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
end
redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'seq', ARGV[4])
return out
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
