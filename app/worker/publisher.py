"""The worker's stream writer: the engine's events become job stream entries and final job states
(the keys and entry shapes are the job contract's, tasks/contract.py)."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

import redis
from weightq.engine import Event, FinishEvent, TokenEvent
from weightq.metrics import EngineMetrics
from weightq.redis_conn import Durable, NotReplicated, is_transient
from weightq.tasks.contract import (
    ABORT,
    STREAM_TICK,
    WRITE_BATCH,
    Aborted,
    EntryType,
    JobState,
    field_of,
    job_key,
    job_of_stream,
    result_dict,
    stream_key,
    writer_key,
)
from weightq.token_plane import TokenPlane

from .coalesce import Holding, take_all
from .runs import RunBook

log = logging.getLogger(__name__)


SHUTDOWN = "worker shutdown"  # the error of requests the engine stops at a warm shutdown
# A write Redis refuses for a reason a retry cannot fix (OOM under maxmemory, a script error) is tried
# this many times, then its jobs end with an error entry (ABORT) and the writer goes on.
REFUSED_TRIES = 3
TOPS_KEPT = 65_536  # streams whose last id a writer remembers (WRITE_BATCH), at most
RETRY_S = 0.5  # the pause before a write Redis failed or refused is tried again
REPLICA_RETRY_S = 0.1  # ... one the master applied but its replicas had not confirmed yet
WRITER_JOIN_S = 10.0  # how long close() waits for each writer thread to finish what it holds


class StreamPublisher:
    """The engine's event sink: buffers a step's events and writes them in one script call per shard.

    `__call__` runs on the engine thread and only appends; `flush()` (end of each step) hands the
    batch to the writer threads, one per token-plane shard, so Redis round trips overlap the next
    forward pass, and a shard that is down or refusing holds up or fails only its own jobs' streams.
    """

    def __init__(
        self, plane: TokenPlane, *, maxlen: int, ttl_s: int, job_ttl_s: int = 86_400, flush_s: float = 0.0
    ) -> None:
        self.plane = plane
        self.flush_s = flush_s  # a stream's tokens are held at most this long, its first token not at all (`Holding`)
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.job_ttl_s = job_ttl_s
        self._pending: list[tuple[Event | list[tuple], float]] = []  # events, or a step's token tuples
        # per shard, a step's events with the fences of that moment (see flush)
        self._batches: list[queue.SimpleQueue[tuple[list, dict[str, int]] | None]] = [
            queue.SimpleQueue() for _ in plane.shards
        ]
        self._writers = [
            threading.Thread(target=self._write_loop, args=(n,), name=f"weightq-streams-{n}", daemon=True)
            for n in range(len(plane.shards))
        ]
        for writer in self._writers:
            writer.start()
        self.runs = RunBook()  # each job's run here: its fence, result fields, end (shared with JobRunner)
        self.requeueing = False  # set at shutdown: jobs the engine stops go back to the queue, so no end entry
        self.metrics: EngineMetrics | None = None
        self.writer_key = writer_key(uuid.uuid4().hex)  # the last batch applied (see _apply_on)
        self.on_superseded: Callable[[str], None] | None = None  # told each such job once (to stop it)
        self._batch_script = plane.home.register_script(WRITE_BATCH)  # run on each shard (Script takes a client)
        self._abort_script = plane.home.register_script(ABORT)
        # a job whose stream could not be written: its entries are dropped from then on, the job ends
        # with an error (RunBook.refuse; JobRunner reads it), and `on_write_failed` stops it in the engine
        self.on_write_failed: Callable[[str], None] | None = None

    def __call__(self, event: Event, emitted: float | None = None) -> None:
        """`emitted`: the engine's stamp when it runs in a process of its own (else now)."""
        stamp = emitted or time.time()
        self._pending.append((event, stamp))  # readers measure latency from here
        if self.metrics is not None and isinstance(event, FinishEvent):
            self.metrics.observe(event, stamp)

    def tokens(self, tokens: list[tuple], emitted: float) -> None:
        """A step's tokens from an engine process, as its (request id, index, token id, text,
        logprobs) tuples, kept as they came until the writer thread formats them: no event object
        and no fields dict per token on the thread that reads the engine's messages."""
        self._pending.append((tokens, emitted))

    def flush(self) -> None:
        """The step's events go to the writer with the fences of now, while their runs are current:
        a batch that Redis refuses for a while is retried under the attempt it was written by, even
        once its task has given up and dropped the job's fence."""
        if self._pending:
            batch, self._pending = self._pending, []
            fences = self.runs.fences()
            if len(self._batches) == 1:
                self._batches[0].put((batch, fences))
                return
            for shard, part in self._by_shard(batch).items():
                self._batches[shard].put((part, fences))

    def _by_shard(self, batch: list[tuple[Event | list[tuple], float]]) -> dict[int, list]:
        """A step's events split by the shard of their job (a step's token tuples too)."""
        parts: dict[int, list] = {}
        index = self.plane.index
        for ev, stamp in batch:
            if isinstance(ev, list):
                tuples: dict[int, list[tuple]] = {}
                for t in ev:
                    tuples.setdefault(index(t[0]), []).append(t)
                for shard, mine in tuples.items():
                    parts.setdefault(shard, []).append((mine, stamp))
            else:
                parts.setdefault(index(ev.request_id), []).append((ev, stamp))
        return parts

    def close(self) -> None:
        self.flush()
        for batches in self._batches:
            batches.put(None)
        for writer in self._writers:
            writer.join(WRITER_JOIN_S)

    def _write_loop(self, shard: int) -> None:
        """Each pass: the steps that arrived, held per stream (`Holding`), then what is due."""
        durable, seq, holding, closing = self.plane.durables[shard], 0, Holding(self.flush_s), False
        tops: dict[str, str] = {}  # stream key -> the id of the entry this writer last wrote there (WRITE_BATCH)
        while not closing:
            finished: list[str] = []
            for item in take_all(self._batches[shard], holding.wait_s()):
                if item is None:
                    closing = True
                    continue
                batch, fences = item
                holding.add(self._entries(batch), fences)
                for ev, _ in batch:
                    if isinstance(ev, FinishEvent):
                        finished.append(ev.request_id)
                        holding.end(stream_key(ev.request_id))
            for entries, fences in holding.due(everything=closing):
                seq += 1
                self._write(durable, seq, entries, fences, tops)
            for job_id in finished:  # a finished job's stream is never held: it was written above
                self.runs.written(job_id)
                tops.pop(stream_key(job_id), None)
            if len(tops) > TOPS_KEPT:  # jobs that left without a finish here (requeued, superseded)
                tops.clear()  # a stream's next write looks its last id up instead

    def _write(
        self, durable: Durable, seq: int, entries: list[tuple], fences: dict[str, int], tops: dict[str, str]
    ) -> None:
        refused = 0
        while entries:
            entries = self.runs.drop_abandoned(entries)
            if gone := entries and self.runs.refused_jobs():  # refused while its tokens were held
                entries = [e for e in entries if job_of_stream(e[0]) not in gone]
            if not entries:
                return
            try:
                self._apply_on(durable, seq, entries, fences, tops)
                return
            except redis.RedisError as e:
                if is_transient(e):  # Redis restarting or failing over: one line, not a traceback
                    log.warning("writing %d stream entries: %s; retrying", len(entries), e)
                    time.sleep(REPLICA_RETRY_S if isinstance(e, NotReplicated) else RETRY_S)
                    continue
                refused += 1
                if refused >= REFUSED_TRIES:
                    self._abort(entries, e, fences)
                    return
                log.warning("writing %d stream entries refused: %s; retrying", len(entries), e)
                time.sleep(RETRY_S)

    def _abort(self, entries: list[tuple], error: redis.RedisError, fences: dict[str, int] | None = None) -> None:
        """Redis keeps refusing this batch: its jobs end with an error entry (ABORT, which gets
        through under maxmemory) and stop in the engine; the other jobs' streams go on."""
        jobs = {j for j in {job_of_stream(entry[0]) for entry in entries} if not self.runs.refused(j)}
        message = f"the worker cannot write this job's stream: Redis refused it ({str(error)[:200]})"
        log.error("%s: ending %d jobs with an error", message, len(jobs))
        for job_id in jobs:
            ended = Aborted.ENDED
            try:
                keys = [job_key(job_id), stream_key(job_id)]
                attempt = self.runs.fence(job_id) if fences is None else fences.get(job_id)
                attempt = "" if attempt is None else attempt
                args = [self.maxlen, self.ttl_s, self.job_ttl_s, message, attempt]
                ended = Aborted(self.plane.durable(job_id).run(self._abort_script, keys, args))
            except redis.RedisError as e:
                log.error("job %s: its error entry was refused too (%s)", job_id, e)
            if ended == Aborted.SUPERSEDED:  # fenced off: a later run owns the job, not this run's to end
                self._supersede(job_id)
                continue
            self.runs.refuse(job_id, message)
            if self.on_write_failed is not None:
                self.on_write_failed(job_id)

    def _entries(self, batch: list[tuple[Event | list[tuple], float]]) -> list[tuple]:
        return entries_of(batch, self.runs.refused_jobs(), self.runs.annotations, self.requeueing)

    def _apply_on(
        self, durable: Durable, seq: int, entries: list[tuple], fenced: dict[str, int], tops: dict[str, str]
    ) -> None:
        """One script call, applied at most once per (writer, shard, seq): a retry after a lost reply
        (Redis crashed after applying it) is a no-op instead of a second copy of every entry. `tops`:
        the id this writer last wrote to each stream, told to the script and updated from its answer
        (a stale one costs the script a look-up, never a wrong tick)."""
        keys, call = batch_call(self.writer_key, entries, fenced, tops)
        reply = durable.run(self._batch_script, keys, [self.maxlen, self.ttl_s, self.job_ttl_s, seq, *call])
        if not reply:  # applied before (a retry after a lost reply)
            return
        superseded, written = reply
        for n in range(0, len(written), 2):
            top = written[n + 1]
            tops[keys[written[n] - 1]] = top.decode() if isinstance(top, bytes) else top
        for key in superseded:
            self._supersede((key.decode() if isinstance(key, bytes) else key).removeprefix(job_key("")))

    def _supersede(self, job_id: str) -> None:
        """A later run of the job began elsewhere (this worker was taken for dead): this run's
        writes are refused from now on, and it stops."""
        if self.runs.supersede(job_id):
            log.warning("job %s resumed on another worker: this run's writes are refused; stopping it", job_id)
            if self.on_superseded is not None:
                self.on_superseded(job_id)


def entries_of(
    batch: list[tuple[Event | list[tuple], float]],
    failed: set[str],
    annotations: Callable[[str], dict],
    requeueing: bool,
) -> list[tuple]:
    """What to write for each event worth writing: (stream key, (index, text, token id, stamp))
    for a plain token, else (stream key, fields, the job's final state or None)."""
    out: list[tuple] = []
    for ev, emitted in batch:
        if isinstance(ev, list):  # a step's token tuples (tokens()), all with the step's stamp
            ts = f"{emitted:.6f}"
            for rid, index, token_id, text, logprobs in ev:
                if not failed or rid not in failed:
                    out.append(_token_entry(rid, index, token_id, text, logprobs, ts))
            continue
        if failed and ev.request_id in failed:
            continue  # its stream ended with an error entry (_abort)
        if isinstance(ev, TokenEvent):
            out.append(_token_entry(ev.request_id, ev.index, ev.token_id, ev.text, ev.logprobs, f"{emitted:.6f}"))
            continue
        key = stream_key(ev.request_id)
        extra = annotations(ev.request_id)
        if requeueing and ev.reason == "cancelled" and ev.error == SHUTDOWN:
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
    return out


def _token_entry(rid: str, index: int, token_id: int, text: str, logprobs, ts: str) -> tuple:
    if logprobs is None:
        return stream_key(rid), (index, text, token_id, ts)
    fields = {"type": EntryType.TOKEN, "i": index, "text": text, "id": token_id, "ts": ts}
    fields["lp"] = json.dumps(logprobs.as_json(), separators=(",", ":"))  # [token, logprob, top ids, tokens, lps]
    return stream_key(rid), fields, None


def batch_call(writer: str, entries: list[tuple], fenced: dict[str, int], tops: dict[str, str]) -> tuple[list, list]:
    """WRITE_BATCH's keys, and its arguments after the header (maxlen, ttls, seq): the fences of the
    streams written, the last ids the writer knows of them (`tops`), and the entries."""
    keys = [writer, STREAM_TICK]
    index: dict[str, int] = {}
    fences: list = []

    def slot(key: str) -> int:
        if key not in index:
            keys.append(key)
            index[key] = len(keys)
            job_id = job_of_stream(key)
            if key != job_id and (attempt := fenced.get(job_id)) is not None:
                fences.extend((index[key], slot(job_key(job_id)), attempt))
        return index[key]

    args: list = []
    for entry in entries:
        if len(entry) == 2:  # plain tokens: WRITE_BATCH's short forms, their values only
            key, values = entry
            args.append(slot(key))
            args.append(0 if len(values) == 4 else -1)  # one token, or several joined (`Holding`)
            args += values
            continue
        key, fields, state = entry
        job = slot(job_key(job_of_stream(key))) if state is not None else 0
        args += [slot(key), len(fields), job, len(state or {})]
        for k, v in fields.items():
            args += [k, v]
        for k, v in (state or {}).items():
            args += [k, v]
    last = [v for key, n in index.items() if (top := tops.get(key)) is not None for v in (n, top)]
    return keys, [len(fences) // 3, *fences, len(last) // 2, *last, *args]
