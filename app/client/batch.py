"""Offline batch inference: a JSONL file of requests in, a JSONL file of results out.

    weightq batch prompts.jsonl -o results.jsonl

Each input line is a job request (tasks/request.py: prompt, messages or prompt_token_ids, and
sampling parameters) with an optional "id" (default: "line-N"), or a line of another format the
caller adds (`formats`: the CLI adds OpenAI's Batch API lines, app/gateway/openai_batch.py), detected
line by line. The file is streamed, with at most
--max-in-flight jobs queued at once, so its size does not matter. Each result is written (and
flushed) as it completes; a bad line is recorded with its error and the run goes on. Rerunning with
the same output skips ids already there, so an interrupted run resumes; Ctrl-C cancels the jobs in
flight and leaves a valid file.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from weightq.tasks.contract import job_key
from weightq.tasks.limits import BATCH_PRIORITY
from weightq.tasks.request import JobRequest, RequestError

from .backlog import Overloaded
from .batch_lines import JobLines, LineFormat
from .batch_output import RunRecord, done_ids, write_in_input_order
from .jobs import Client


@dataclass
class Progress:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    skipped: int = 0
    refused: int = 0  # failed before submission (also counted in failed)
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> dict:
        elapsed = time.monotonic() - self.started
        lat = self.latencies
        return {
            "requests": self.submitted + self.refused,
            "completed": self.completed,
            "failed": self.failed,
            "skipped": self.skipped,
            "completion_tokens": self.tokens,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(self.tokens / elapsed, 1) if elapsed > 0 else 0.0,
            "latency_p50_s": round(percentile(lat, 50), 3) if lat else None,
            "latency_p99_s": round(percentile(lat, 99), 3) if lat else None,
        }


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
    return n


class Interrupted(Exception):
    """Ctrl-C was pressed: raised at the run's next safe point, never inside a write."""


class BatchRun:
    def __init__(
        self,
        client: Client,
        output: IO[str],
        *,
        max_in_flight: int,
        bar=None,
        formats: list[LineFormat] | None = None,
        priority: int | None = None,
        watch: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.watch = watch  # called while waiting for jobs to end (weightq batch: are there workers?)
        self.out = output
        self.formats: list[LineFormat] = [*(formats or []), JobLines()]  # the first that matches a line
        # Set by the SIGINT handler and checked at safe points. A KeyboardInterrupt raised wherever the
        # signal lands can be swallowed (in a Celery AsyncResult.__del__, for one, Python only prints
        # "Exception ignored", and the run goes on to the end).
        self.stop = threading.Event()
        self.max_in_flight = max_in_flight
        # job id -> (line id, submitted at, the line, its format)
        self.inflight: dict[str, tuple[str, float, dict, LineFormat]] = {}
        self.progress = Progress()
        self.bar = bar
        self.run_tag = uuid.uuid4().hex[:10]  # job ids are fresh per run: a resumed line never meets its old job
        self.priority = BATCH_PRIORITY if priority is None else priority  # of lines that name none: background
        self.order: list[str] = []  # every line's id, in input order (`--ordered`)
        self.retried = 0  # lines whose earlier outcome (a failure) the output holds already

    def write(self, record: dict) -> None:
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()

    def fail(self, record: dict) -> None:
        self.progress.failed += 1
        self.write(record)
        self._tick()

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise Interrupted

    def submit_lines(self, lines, skip: set[str], seen: set[str] | None = None) -> None:
        """Run every line not in `skip` (ids whose outcome the output holds); `seen`: every id the
        output holds an outcome for, failures included (a line run again supersedes its record)."""
        self.seen = seen or set()
        for n, line in lines:
            self.check_stop()
            if not line.strip():
                continue
            error: tuple[str, str] | None = None
            try:
                obj: Any = json.loads(line)
            except ValueError as e:
                obj, error = None, (f"line {n} is not JSON: {e}", "line")
            else:
                if not isinstance(obj, dict):
                    error = (f"request: must be a JSON object (got {type(obj).__name__})", "request")
            fmt = next(f for f in self.formats if f.matches(obj)) if error is None else self.formats[-1]
            line_id = fmt.line_id(obj, n) if error is None else f"line-{n}"
            self.order.append(line_id)
            if line_id in skip:
                self.progress.skipped += 1
                self._tick()
                continue
            self.retried += line_id in self.seen
            if error is not None:
                self.progress.refused += 1
                self.fail(fmt.failed(line_id, None, None, *error))
                continue
            job_id = self.client.plane.new_id(name=f"batch-{self.run_tag}-{n}")  # on a shard of its own naming
            try:
                req = replace(fmt.request(obj, self.priority), request_id=job_id)
                while len(self.inflight) >= self.max_in_flight:
                    self.collect(wait=True)
                self.submit_paced(req)
            except RequestError as e:
                self.progress.refused += 1
                self.fail(fmt.failed(line_id, obj, job_id, str(e), e.field))
                continue
            self.inflight[job_id] = (line_id, time.monotonic(), obj, fmt)
            self.progress.submitted += 1
        while self.inflight:
            self.collect(wait=True)

    def submit_paced(self, req: JobRequest) -> None:
        """A batch is background work: past MAX_QUEUE_WAIT_S it waits for the backlog (collecting
        what ends meanwhile) instead of failing its lines."""
        while True:
            try:
                self.client.submit_many([req])
                return
            except Overloaded as e:
                self.collect(wait=False)
                self.check_stop()
                time.sleep(min(float(e.retry_after_s), 1.0))

    def collect(self, wait: bool) -> None:
        """Record every in-flight job that has ended; with wait, sleep briefly if none has."""
        self.check_stop()
        ids = list(self.inflight)
        fields = ("state", "result", "error", "field")
        states = self.client.plane.each(ids, lambda pipe, j: pipe.hmget(job_key(j), *fields))
        ended = 0
        for job_id, (state, result, error, fld) in zip(ids, states, strict=True):
            if state not in (b"done", b"cancelled"):
                continue
            ended += 1
            line_id, t0, obj, fmt = self.inflight.pop(job_id)
            if result is None:
                message = error.decode(errors="replace") if error else "the job ended without a result"
                self.fail(fmt.failed(line_id, obj, job_id, message, fld.decode() if fld else None))
                continue
            res = json.loads(result)
            self.progress.completed += 1
            self.progress.tokens += res.get("usage", {}).get("completion_tokens", 0)
            self.progress.latencies.append(time.monotonic() - t0)
            self.write(fmt.done(line_id, obj, job_id, res))
            self._tick()
        if wait and not ended:
            if self.watch is not None:
                self.watch()
            self.stop.wait(0.05)

    def cancel_inflight(self) -> int:
        n = 0
        for job_id in list(self.inflight):
            self.client.job(job_id).cancel()
            n += 1
        self.inflight.clear()
        return n

    def _tick(self) -> None:
        if self.bar is None:
            return
        p = self.progress
        elapsed = max(time.monotonic() - p.started, 1e-9)
        self.bar.update(1)
        self.bar.set_postfix(done=p.completed, failed=p.failed, tok_s=f"{p.tokens / elapsed:.0f}", refresh=False)


class BatchChanged(ValueError):
    """The output was started from another input or with other parameters (RunRecord)."""


def run_batch(
    input_path: Path,
    output_path: Path,
    client: Client,
    *,
    max_in_flight: int = 256,
    progress: bool = True,
    formats: list[LineFormat] | None = None,
    priority: int | None = None,
    watch: Callable[[], None] | None = None,
    keep_failed: bool = False,
    ordered: bool = False,
    force: bool = False,
    model: str = "",
) -> tuple[dict, bool]:
    """Returns (summary, interrupted). `priority`: the class of lines that name none (None:
    BATCH_PRIORITY, background); `watch`: called now and then while jobs run. Lines whose last outcome
    in the output is a result are skipped, failed ones run again unless `keep_failed`; `ordered`
    rewrites the output in input order at the end of a whole run (one record per line; so does a
    run that retried lines). Raises BatchChanged when the output was started from another input, or
    with another priority or `model`, unless `force`."""
    from tqdm import tqdm

    record = RunRecord.of(input_path, BATCH_PRIORITY if priority is None else priority, model)
    seen = done_ids(output_path)
    if seen and (changes := record.changes_from(output_path)) and not force:
        raise BatchChanged(
            f"{output_path} was started from another run: {'; '.join(changes)}. Write to a new output, or "
            "pass --force to resume it anyway"
        )
    record.save(output_path)
    skip = seen if keep_failed else done_ids(output_path, failed=False)
    total = count_lines(input_path)
    bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    interrupted = False
    with open(output_path, "a", encoding="utf-8") as out, open(input_path, encoding="utf-8", errors="replace") as f:
        run = BatchRun(
            client, out, max_in_flight=max_in_flight, bar=bar, formats=formats, priority=priority, watch=watch
        )
        try:
            with _stop_signals_set(run.stop):
                run.submit_lines(enumerate(f, start=1), skip, seen)
        except (Interrupted, KeyboardInterrupt):
            interrupted = True
            n = run.cancel_inflight()
            print(f"\ninterrupted: cancelled {n} jobs in flight; rerun the same command to resume", file=sys.stderr)
        finally:
            bar.close()
    if not interrupted and (ordered or run.retried):
        write_in_input_order(output_path, run.order if ordered else [])
    return run.progress.summary() | {"retried": run.retried}, interrupted


@contextlib.contextmanager
def _stop_signals_set(stop: threading.Event):
    """While inside, the first SIGINT (Ctrl-C) or SIGTERM (a scheduler's or a container's stop) sets
    `stop`: the run cancels its jobs in flight and leaves a resumable output. A second one raises
    KeyboardInterrupt as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, was in previous.items():
            signal.signal(sig, was)


def format_summary(s: dict) -> str:
    """run_batch's summary as one line for a terminal."""
    lat = "n/a" if s["latency_p50_s"] is None else f"p50 {s['latency_p50_s']:.2f} s, p99 {s['latency_p99_s']:.2f} s"
    return (
        f"{s['requests']} requests: {s['completed']} completed, {s['failed']} failed, {s['skipped']} skipped "
        f"(already done); {s['completion_tokens']} tokens in {s['elapsed_s']:.1f} s = {s['tokens_per_s']:.0f} tok/s; "
        f"latency {lat}"
    )
