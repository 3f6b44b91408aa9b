"""Offline batch inference: a JSONL file of requests in, a JSONL file of results out.

    weightq batch prompts.jsonl -o results.jsonl

Each input line is a job request (tasks/request.py: prompt, messages or prompt_token_ids, and
sampling parameters, also under OpenAI's and TGI's names: batch_lines.py) with an optional "id"
(default: "line-N"), or a line of another format the caller adds (`formats`: the CLI adds OpenAI's
Batch API lines, app/gateway/openai_batch.py), detected line by line. docs/batch.md is the user's page.

The file is read once before anything runs (two lines with one id are refused: each id names one
record of the output), then streamed, with at most --max-in-flight jobs queued at once. Each result is
written (and flushed) as it completes; a bad line is recorded with its error and the run goes on.
Rerunning with the same output skips ids already there, so an interrupted run resumes: Ctrl-C cancels
the jobs in flight, and the jobs of a client killed outright are collected from Redis (the `Journal`),
never generated twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
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

from weightq.metrics import read_live_workers
from weightq.tasks.contract import JobState, job_key
from weightq.tasks.limits import BATCH_PRIORITY
from weightq.tasks.request import JobRequest, RequestError

from .backlog import Overloaded
from .batch_lines import JobLines, LineFormat
from .batch_output import Journal, RunRecord, foreign_line, json_line, outcomes, write_in_input_order
from .jobs import Client


@dataclass
class Progress:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    skipped: int = 0
    refused: int = 0  # failed before submission (also counted in failed)
    resumed: int = 0  # lines whose job an earlier, killed run had submitted: collected, not run again
    rerun: int = 0  # lines whose earlier job was gone (its record expired) or cancelled: run again
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> dict:
        elapsed = time.monotonic() - self.started
        lat = self.latencies
        return {
            "requests": self.submitted + self.refused + self.resumed,
            "completed": self.completed,
            "failed": self.failed,
            "skipped": self.skipped,
            "resumed_jobs": self.resumed,
            "rerun_jobs": self.rerun,
            "completion_tokens": self.tokens,
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(self.tokens / elapsed, 1) if elapsed > 0 else 0.0,
            "latency_p50_s": round(percentile(lat, 50), 3) if lat else None,
            "latency_p99_s": round(percentile(lat, 99), 3) if lat else None,
        }


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def line_formats(formats: list[LineFormat] | None, served_model: str) -> list[LineFormat]:
    """The kinds of line a run reads, the first that matches a line wins: the caller's, then weightq's own."""
    return [*(formats or []), JobLines(served_model)]


UNDECODED = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as `decoded` keeps it


def identify(line: str, n: int, formats: list[LineFormat]) -> tuple[Any, LineFormat, str, tuple[str, str] | None]:
    """(the parsed line, its format, its id, (message, field) when it is no request at all), `n` counted
    from 1. A line that is not UTF-8 (`decoded`) is refused, keeping its id when it has one: its bytes
    replaced, it would run a prompt other than the file's."""
    error: tuple[str, str] | None = None
    if n == 1:
        line = line.removeprefix("\ufeff")  # the byte-order mark some editors write first: not the line's
    bad = UNDECODED.search(line)
    if bad is not None:
        error = (f"line {n} is not UTF-8 (byte 0x{ord(bad[0]) - 0xDC00:02x} at character {bad.start() + 1}): "
                 "save the file as UTF-8", "line")  # fmt: skip
        line = line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    try:
        obj: Any = json.loads(line)
    except ValueError as e:
        obj, error = None, error or (f"line {n} is not JSON: {e}", "line")
    if not isinstance(obj, dict):
        error = error or (f"request: must be a JSON object (got {type(obj).__name__})", "request")
        return obj, formats[-1], f"line-{n}", error
    fmt = next(f for f in formats if f.matches(obj))
    return (None, formats[-1], fmt.line_id(obj, n), error) if error else (obj, fmt, fmt.line_id(obj, n), None)


def decoded(raw: bytes) -> str:
    """A line of the input as text; a byte that is not UTF-8 stays visible to `identify` (as a lone
    surrogate) instead of becoming U+FFFD, which would run a prompt other than the file's."""
    return raw.decode("utf-8", errors="surrogateescape")


class DuplicateIds(ValueError):
    """Two lines of the input have one id: each would overwrite the other's record. Nothing was run."""


@dataclass
class InputScan:
    sha256: str
    lines: int  # newline-terminated or not, blank ones included (the progress bar's total)
    ids: list[str]  # each request line's id, in input order


def scan_input(path: Path, formats: list[LineFormat]) -> InputScan:
    """One pass over the input before anything runs: its digest (RunRecord), its size, and its line
    ids. Raises DuplicateIds naming the first repeated ids and both of their lines."""
    digest = hashlib.sha256()
    first: dict[str, int] = {}  # id -> the line it is on
    repeated: list[str] = []
    n = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            digest.update(raw)
            line = decoded(raw)
            if not line.strip():
                continue
            line_id = identify(line, n, formats)[2]
            if line_id in first:
                repeated.append(f"id {line_id!r} is on line {first[line_id]} and line {n}")
                continue
            first[line_id] = n
    if repeated:
        more = f" (and {len(repeated) - 3} more)" if len(repeated) > 3 else ""
        raise DuplicateIds(
            f"{path}: {'; '.join(repeated[:3])}{more}. A line's id names its record in the output: give each line "
            'an id of its own (or none: line N is then "line-N"). Nothing was submitted'
        )
    return InputScan(digest.hexdigest(), n, list(first))


def served_name(client: Client) -> str:
    """The model name the live workers of the client's queue advertise ("" when none, or several)."""
    queue = client.settings.queues.queue
    names = {w.served_model for w in read_live_workers(client.redis).values() if w.queue == queue}
    return names.pop() if len(names) == 1 else ""


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
        model: str = "",
        journal: Journal | None = None,
    ) -> None:
        self.client = client
        self.watch = watch  # called while waiting for jobs to end (weightq batch: are there workers?)
        self.out = output
        self.model = model  # the name the workers serve: a line's `model` other than it names an adapter
        self.formats = line_formats(formats, model)
        self.journal = journal  # each submitted line's job, so that a killed run's jobs are collected, not rerun
        self.pending: dict[str, tuple[str, bytes | None]] = {}  # line id -> (an earlier run's job, its state)
        # Set by the SIGINT handler and checked at safe points. A KeyboardInterrupt raised wherever the
        # signal lands can be swallowed (in a Celery AsyncResult.__del__, for one, Python only prints
        # "Exception ignored", and the run goes on to the end).
        self.stop = threading.Event()
        self.max_in_flight = max_in_flight
        # job id -> (line id, submitted at (None: by an earlier run), the line, its format)
        self.inflight: dict[str, tuple[str, float | None, dict, LineFormat]] = {}
        self.progress = Progress()
        self.bar = bar
        self.run_tag = uuid.uuid4().hex[:10]  # job ids are fresh per run: a resumed line never meets its old job
        self.priority = BATCH_PRIORITY if priority is None else priority  # of lines that name none: background
        self.seen: set[str] = set()
        self.order: list[str] = []  # every line's id, in input order (`--ordered`)
        self.retried = 0  # lines whose earlier outcome (a failure) the output holds already

    def write(self, record: dict) -> None:
        self.out.write(json_line(record))
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
        self.pending = self._pending_states(skip)
        for n, line in lines:
            self.check_stop()
            if not line.strip():
                continue
            obj, fmt, line_id, error = identify(line, n, self.formats)
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
            if self._resume(line_id, obj, fmt):
                continue
            job_id = self.client.plane.new_id(name=f"batch-{self.run_tag}-{n}")  # on a shard of its own naming
            try:
                req = replace(fmt.request(obj, self.priority), request_id=job_id)
                self.check_model(req)
                while len(self.inflight) >= self.max_in_flight:
                    self.collect(wait=True)
                if self.journal is not None:
                    self.journal.submitted(line_id, job_id)  # first: a job the journal misses would run twice
                self.submit_paced(req)
            except RequestError as e:
                self.progress.refused += 1
                self.fail(fmt.failed(line_id, obj, job_id, str(e), e.field))
                continue
            self.inflight[job_id] = (line_id, time.monotonic(), obj, fmt)
            self.progress.submitted += 1
        while self.inflight:
            self.collect(wait=True)

    def _pending_states(self, skip: set[str]) -> dict[str, tuple[str, bytes | None]]:
        """The journal's jobs of lines still to run, with their states in Redis (None: no record)."""
        pending = {} if self.journal is None else self.journal.pending()
        lines = [line_id for line_id in pending if line_id not in skip]
        ids = [pending[line_id] for line_id in lines]
        states = self.client.plane.each(ids, lambda pipe, j: pipe.hget(job_key(j), "state")) if ids else []
        return {line_id: (job_id, state) for line_id, job_id, state in zip(lines, ids, states, strict=True)}

    def _resume(self, line_id: str, obj: dict, fmt: LineFormat) -> bool:
        """Whether the line's job from an earlier run is there to collect (taken in flight). One whose
        record expired, or that its run cancelled on the way out, is not: the line runs again."""
        if line_id not in self.pending:
            return False
        job_id, state = self.pending.pop(line_id)
        if state is None or state == JobState.CANCELLED.encode():
            self.progress.rerun += 1
            return False
        while len(self.inflight) >= self.max_in_flight:
            self.collect(wait=True)
        self.inflight[job_id] = (line_id, None, obj, fmt)
        self.progress.resumed += 1
        return True

    def check_model(self, req: JobRequest) -> None:
        """Refuse a LoRA adapter (a line's `model`) that no live worker holds, naming what is served (as
        the gateway does); nothing is known while no worker is live (the job waits for one, as any does)."""
        adapters = self.client.router.adapters() if req.adapter else None
        if adapters is not None and req.adapter not in adapters:
            held = ", ".join(sorted(adapters)) or "none"
            raise RequestError(
                "model", f"model {req.adapter!r} is not served here (serving {self.model!r}; LoRA adapters: {held})"
            )

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
            else:
                res = json.loads(result)
                self.progress.completed += 1
                self.progress.tokens += res.get("usage", {}).get("completion_tokens", 0)
                if t0 is not None:  # a resumed job's start is not known
                    self.progress.latencies.append(time.monotonic() - t0)
                self.write(fmt.done(line_id, obj, job_id, res))
                self._tick()
            if self.journal is not None:
                self.journal.ended(job_id)  # after its outcome: a crash between them collects it once more
        if wait and not ended:
            if self.watch is not None:
                self.watch()
            self.stop.wait(0.05)

    def cancel_inflight(self) -> int:
        n = 0
        for job_id in list(self.inflight):
            self.client.job(job_id).cancel()
            if self.journal is not None:
                self.journal.ended(job_id)
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


class OutputRefused(ValueError):
    """The output is the input, a file `weightq batch` did not write (a rerun rewrites its output), or
    cannot be written. Nothing was run."""


def check_output(input_path: Path, output_path: Path, force: bool) -> None:
    """Refuse, before anything runs, an output the run would destroy or could not write."""
    if output_path.is_dir():
        raise OutputRefused(f"{output_path} is a directory: give the output file's path")
    if output_path.exists():
        if os.path.samefile(input_path, output_path):
            raise OutputRefused(f"{output_path} is the input file: results appended there would overwrite it")
        if not force and not RunRecord.path(output_path).exists() and (n := foreign_line(output_path)):
            raise OutputRefused(
                f"{output_path} was not written by weightq batch (line {n} is no record of it), and a run appends "
                "to its output and may rewrite it. Write to a new output, or pass --force to use it anyway"
            )
        writable = os.access(output_path, os.W_OK)
    else:
        if not output_path.parent.is_dir():
            raise OutputRefused(f"{output_path}: no such directory: {output_path.parent}")
        writable = os.access(output_path.parent, os.W_OK)
    if not writable:
        raise OutputRefused(f"{output_path} cannot be written (permission denied, or a read-only file system)")


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
    """Returns (summary, interrupted). The summary counts this run's lines (`failed`: this run's
    failures) and the output's: `lines` of the input, `lines_failed` whose outcome there is an error.
    `priority`: the class of lines that name none (None: BATCH_PRIORITY, background); `watch`: called
    now and then while jobs run; `model`: the name the workers serve (default: what their heartbeats
    say). Lines whose last outcome in the output is a result are skipped, failed ones run again unless
    `keep_failed`; `ordered` rewrites the output in input order at the end of a whole run (one record
    per line; so does a run that retried lines). Raises OutputRefused (nothing run) for an output that is
    the input, not a batch output (unless `force`) or not writable, DuplicateIds (nothing run) when two
    lines have one id, BatchChanged when the output was started from another input, or with another
    priority or `model`, unless `force`."""
    from tqdm import tqdm

    check_output(input_path, output_path, force)
    served = model or served_name(client)
    scan = scan_input(input_path, line_formats(formats, served))
    record = RunRecord(scan.sha256, BATCH_PRIORITY if priority is None else priority, model)
    earlier = outcomes(output_path)  # line id -> whether its last outcome is a result
    seen = set(earlier)
    if seen and (changes := record.changes_from(output_path)) and not force:
        raise BatchChanged(
            f"{output_path} was started from another run: {'; '.join(changes)}. Write to a new output, or "
            "pass --force to resume it anyway"
        )
    try:
        record.save(output_path)
    except OSError as e:
        raise OutputRefused(f"cannot write {RunRecord.path(output_path)}, the run's record: {e.strerror}") from None
    skip = seen if keep_failed else {line_id for line_id, ok in earlier.items() if ok}
    bar = tqdm(total=scan.lines, unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    interrupted = finished = False
    journal = Journal(output_path)
    with open(output_path, "a", encoding="utf-8") as out, open(input_path, "rb") as f:
        run = BatchRun(
            client,
            out,
            max_in_flight=max_in_flight,
            bar=bar,
            formats=formats,
            priority=priority,
            watch=watch,
            model=served,
            journal=journal,
        )
        try:
            with _stop_signals_set(run.stop):
                lines = ((n, decoded(raw)) for n, raw in enumerate(f, start=1))
                run.submit_lines(lines, skip, seen)  # numbered as scan_input numbers them
            finished = True
        except (Interrupted, KeyboardInterrupt):
            interrupted = True
            n = run.cancel_inflight()
            print(f"\ninterrupted: cancelled {n} jobs in flight; rerun the same command to resume", file=sys.stderr)
        finally:
            bar.close()
            journal.close(finished)  # every line's outcome is in the output: nothing left to collect
    if run.progress.rerun:
        print(
            f"weightq batch: {run.progress.rerun} lines' jobs of an earlier run were gone (their records expire "
            "after RESULT_TTL_S) or cancelled: they ran again",
            file=sys.stderr,
        )
    if not interrupted and (ordered or run.retried):
        write_in_input_order(output_path, run.order if ordered else [])
    last = outcomes(output_path)
    failed = sum(1 for line_id in scan.ids if last.get(line_id) is False)
    summary = run.progress.summary() | {"retried": run.retried, "lines": len(scan.ids), "lines_failed": failed}
    return summary, interrupted


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


def failures_line(s: dict, output: Path) -> str | None:
    """What a terminal's last line says when lines failed: how many of how many, and where."""
    if not s["lines_failed"]:
        return None
    return (
        f"{s['lines_failed']} of {s['lines']} lines failed: their records in {output} hold an error "
        "(\"error\" in weightq's lines; OpenAI's: a response status_code other than 200). Rerun the same command "
        "to run them again"
    )


def format_summary(s: dict) -> str:
    """run_batch's summary as one line for a terminal."""
    lat = "n/a" if s["latency_p50_s"] is None else f"p50 {s['latency_p50_s']:.2f} s, p99 {s['latency_p99_s']:.2f} s"
    return (
        f"{s['requests']} requests: {s['completed']} completed, {s['failed']} failed, {s['skipped']} skipped "
        f"(already done); {s['completion_tokens']} tokens in {s['elapsed_s']:.1f} s = {s['tokens_per_s']:.0f} tok/s; "
        f"latency {lat}"
    )
