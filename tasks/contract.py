"""The job contract: how a client, the gateway and a worker meet in Redis. Readers and the writer
import it; nothing else spells a key, an entry type or the task name.

Keys (all expire; see Settings), every one on the token plane's Redis (STREAMS_REDIS_URL, else REDIS_URL);
Celery's own keys (the queue's lists, unacked messages, results) stay on the broker's (REDIS_URL).
STREAMS_REDIS_URL may list several servers (shards): a job's stream and hash live on `shard_of(id)`,
beside that shard's own QUEUED, STARTED_HW, RESUMING, DEAD, engine-jobs and held sets, lease copies
and STREAM_TICK, so every Lua script below runs on one server; the pool's keys (heartbeats, leases,
worker queues, LoRA, the recovery lock) live on the first, the home (app/token_plane.py).
  weightq:stream:{id}  a Redis Stream of the job's entries, oldest first:
      {"type": "attempt", "attempt": n, "from": k}       written first by every run of the job: it
                                                         resumes after the k tokens already in the stream
      {"type": "token", "i": index, "text": delta, "id": token id, "ts": engine emit time (unix s)}
          and, when the request asks for logprobs, "lp": JSON [token text, logprob, top ids, top
          tokens, top logprobs] (the model's log_softmax, best first)
      {"type": "token", "i": first index, "n": count, "text": the deltas joined, "id": "5,6,7",
       "len": each delta's length in Unicode code points, "5,0,2", "ts": the first one's emit time}
          several tokens of a job in one entry (a worker holds a stream's tokens up to
          STREAM_FLUSH_MS: fewer entries per token for Redis and readers);
          `token_parts` splits it into the one-token form; tokens with "lp" are never joined
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
import zlib
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

# the stream entries' types and their readers (`token_parts`, `Replay` …) are part of the contract: importable from here
from .entries import (  # noqa: F401
    END_TYPES,
    Emitted,
    EntryType,
    Replay,
    emitted_tokens,
    part_id,
    resume_from,
    token_count,
    token_parts,
)

# the atomic state changes, in Lua (scripts.py, queue_scripts.py), are part of the contract: importable from here
from .queue_scripts import FORGET_FAIR, MOVE_QUEUED, RELEASE, STAGE  # noqa: F401
from .results import Finished
from .scripts import (  # noqa: F401
    ABORT,
    BEGIN,
    CANCEL,
    CHARGE,
    FAIL,
    REQUEUE,
    SUBMIT,
    WRITE_BATCH,
    Aborted,
    Begun,
    Requeued,
)  # fmt: skip

# what a STREAM_TICK entry carries (ticks.py), and how a reader takes it apart
from .ticks import tick_entries, tick_streams  # noqa: F401

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
# One entry per batch of stream entries a worker writes (WRITE_BATCH; FAIL too), the last 64 kept, its
# "keys" the streams written to (space-separated) and its "data" what was written to each (tasks/ticks.py):
# a reader following many streams blocks on this one key, takes the entries it carries, and reads only
# the streams where it cannot (a blocked XREAD of hundreds of keys costs a full command to send, and
# Redis 6 answers it with just the stream that woke it). An entry without "keys": read them all.
STREAM_TICK = "weightq:stream-tick"
TICKS_KEPT = 64  # its length (the scripts' MAXLEN): a reader that reads this many may have missed some
# Prefix affinity: each worker's own queue, by queue name: {"queue": the shared queue, "instance",
# "hostname"}. Whoever finds the instance's lease lapsed moves what waits there to the shared queue.
WORKER_QUEUES = "weightq:worker-queues"
# LoRA adapters loaded and unloaded at run time for the whole pool (the gateway's /v1/load_lora_adapter
# and /v1/unload_lora_adapter): name -> path ("" once unloaded). Every worker follows within a second
# (app/worker/adapters.py) and reports a load that failed in LORA_ERRORS (name -> "worker: why").
LORA_ADAPTERS = "weightq:lora"
LORA_ERRORS = "weightq:lora-errors"
RUNNING_STREAM_TTL_S = 86_400  # a running job's stream lives a day; once it ends, STREAM_TTL_S
# A worker instance's sets (held_key, engine_jobs_key): each write renews the expiry, so a dead instance's
# sets go a day after its last write, long after a reaper has handled it (BEGIN's Lua spells it as 86400).
INSTANCE_SETS_TTL_S = 86_400


SHARD_TAG = ".s"  # a job id made on a sharded plane ends with its shard: "<hex>.s<k>" (`on_shard`)


def shard_of(job_id: str, shards: int) -> int:
    """The token-plane shard that holds the job's keys (of STREAMS_REDIS_URL's list), from the id alone,
    so every client, gateway and worker finds it without a directory. An id that names its shard
    (`on_shard`: every id weightq draws on a sharded plane) stays there when shards are added to the
    end of the list; any other (a caller's own `request_id`, an id drawn on one Redis) is hashed, CRC32
    as Redis Cluster's slots are (stable across processes and Python versions, unlike hash()), and
    moves when the list grows. A named shard beyond the list (a process whose list is older than the
    id's maker's) hashes too: the README's rollout order keeps that from happening."""
    if shards <= 1:
        return 0
    _, tag, k = job_id.rpartition(SHARD_TAG)
    if tag and k.isdigit() and len(k) <= 4 and (n := int(k)) < shards:
        return n
    return zlib.crc32(job_id.encode()) % shards


def on_shard(name: str, shard: int) -> str:
    """`name` as the id of a job whose keys live on `shard` (whatever the list's length, `shard_of`)."""
    return f"{name}{SHARD_TAG}{shard}"


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


OWN_QUEUE_MARK = ".w."  # a QUEUE name may not hold it (settings.py checks)


def worker_queue(queue: str, hostname: str) -> str:
    """A worker's own queue (prefix affinity): jobs routed to it, consumed before the shared `queue`."""
    return f"{queue}{OWN_QUEUE_MARK}{hostname}"


def served_queue(name: str) -> str:
    """The shared queue a worker's own queue serves (a shared queue serves itself): where a message
    that goes back (a dead worker's, a warm shutdown's, a visibility timeout's) is restored, so that any
    worker takes it."""
    name = name.removesuffix(STAGED_MARK)
    head, mark, _ = name.partition(OWN_QUEUE_MARK)
    return head if mark else name


# Fair staging (FAIR_QUEUE): a client sends a job to `staged_queue(target)` and the transport files it
# in the target's staged sets instead of the lists Celery consumes; a worker releases staged jobs into
# its own queue only as fast as it can start them (RELEASE), so the queue's order is the scheduler's.
STAGED_MARK = "~staged"  # a QUEUE name may not hold it either
PRIORITY_LEVELS = 10  # kombu's priority steps 0-9 (celery_config.py): one list, and one staged set, each


def staged_queue(target: str) -> str:
    """The name a client sends a job to so that it is staged for `target` (a queue Celery consumes)."""
    return target + STAGED_MARK


def staged_target(name: str) -> str | None:
    """The queue a staged name stages for; None for a queue Celery consumes directly."""
    return name.removesuffix(STAGED_MARK) if name.endswith(STAGED_MARK) else None


def staged_sets(target: str) -> list[str]:
    """The sorted sets of jobs staged for `target`, one per broker priority, in the order kombu takes
    its lists (priority 0, the most urgent class, first). Each member is a kombu message as kombu would
    have pushed it; its score, its start tag in the target's fair order (STAGE)."""
    return [f"{target}{STAGED_MARK}:{p}" for p in range(PRIORITY_LEVELS)]


def fair_key(target: str) -> str:
    """The target's fair-order state (STAGE, RELEASE): `v:<priority>` each class's virtual clock,
    `t:<tenant>` each tenant's finish tag, in weight units (prompt + new tokens)."""
    return f"{target}{STAGED_MARK}:fair"


def writer_key(token: str) -> str:
    """A stream writer's record of the last batch it applied (see WRITE_BATCH)."""
    return f"weightq:writer:{token}"


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


class JobExpired(JobFailed):
    """The job's deadline passed before it could start: it ended unrun (its error names `deadline`)."""


class JobNotFound(LookupError):
    """No job has this id: never submitted, or its record expired (RESULT_TTL_S after it ended)."""


class StreamExpired(LookupError):
    """The job ended and its token stream expired (STREAM_TTL_S after its end): its tokens can no
    longer be read; its result can, until RESULT_TTL_S (`Job.result`)."""


def decode_fields(raw: Mapping) -> dict[str, str]:
    """A stream entry's fields as str (redis-py returns bytes unless decode_responses is set)."""
    return {
        k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v for k, v in raw.items()
    }


def args_repr(request: Mapping[str, Any]) -> str:
    """The job message's `argsrepr` (what Flower and `celery inspect` show): the request with its token
    lists and long texts summarised. Celery's own saferepr walks every token id, a large share of a
    submission's time."""
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
        field = fields.get("field") or ""
        raise (JobExpired if field == "deadline" else JobFailed)(fields.get("message") or "error", field)
    return None


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
