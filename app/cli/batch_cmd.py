"""The `weightq batch` command: app/client/batch.py run on a file, against the workers' Redis, or
(`--local`) with a worker of its own for the one-command case."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from weightq.client import Client
from weightq.client.batch import (
    BatchChanged,
    DuplicateIds,
    OutputRefused,
    check_output,
    failures_line,
    format_summary,
    run_batch,
)
from weightq.gateway.openai_batch import OpenAIBatchLines
from weightq.metrics import read_live_workers
from weightq.redis_conn import redacted
from weightq.settings import Settings
from weightq.tasks.heartbeat import Heartbeat

from .redis_server import redis_for

WATCH_S = 5.0  # how often a running batch looks for the workers of its queue


def batch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="run a JSONL file of requests through the workers, writing results as they complete",
        description="Offline batch inference. Each input line is a request: prompt, messages or prompt_token_ids, "
        "sampling parameters (also under OpenAI's and TGI's names: max_tokens, model, ...), optional \"id\", and "
        "columns of your own, carried to its output line; or a line of OpenAI's Batch API (custom_id, method, url, "
        "body), answered with OpenAI's batch output line. Two lines with one id are refused before anything runs. "
        "Rerun the same command to resume: ids already in the output are skipped, jobs a killed run left are "
        "collected. Exits 1 when a line failed, 130 when interrupted. Refuses at once when no live worker serves "
        "QUEUE (unless --local). See docs/batch.md.",
    )
    p.add_argument("input", help="JSONL file of requests")
    p.add_argument("-o", "--output", required=True, help="JSONL file of results (appended; resumable)")
    p.add_argument("--max-in-flight", type=int, default=256, help="jobs queued at once (default 256)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="priority class 0-9 of lines that name none (default 2: background, below 5, yields to interactive work)",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="start a worker of its own on MODEL (and the embedded Redis unless REDIS_URL) for this run, then stop it",
    )
    p.add_argument(
        "--keep-failed", action="store_true", help="on a rerun, skip lines that failed too (default: run them again)"
    )
    p.add_argument(
        "--ordered", action="store_true", help="at the end, rewrite the output in input order, one line per request"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="resume an output started from another input, priority or model, or holding other data",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    src = Path(args.input)
    if not src.is_file():
        raise SystemExit(f"weightq batch: no such file: {src}")
    if args.max_in_flight < 1:
        raise SystemExit("weightq batch: --max-in-flight must be >= 1")
    if args.priority is not None and not 0 <= args.priority <= 9:
        raise SystemExit("weightq batch: --priority must be an integer in [0, 9]")
    try:
        check_output(src, Path(args.output), args.force)  # before Redis or a --local worker starts
    except OutputRefused as e:
        raise SystemExit(f"weightq batch: {e}") from None
    if args.local:
        from .stack import require_worker_extra

        require_worker_extra("batch --local")
    with (
        redis_for("weightq batch", settings.redis) as url,  # the embedded Redis is held until the batch ends
        local_worker(url, settings) if args.local else contextlib.nullcontext(),
    ):
        client = Client(url, settings=settings)
        served = served_model(client, settings.queues.queue, url)
        try:
            summary, interrupted = run_batch(
                src,
                Path(args.output),
                client,
                max_in_flight=args.max_in_flight,
                progress=not args.no_progress,
                formats=[OpenAIBatchLines(settings.served.served_model_name or served)],
                priority=args.priority,
                watch=WorkerWatch(client, settings.queues.queue),
                keep_failed=args.keep_failed,
                ordered=args.ordered,
                force=args.force,
                model=settings.served.served_model_name or served,
            )
        except (BatchChanged, DuplicateIds, OutputRefused) as e:
            raise SystemExit(f"weightq batch: {e}") from None
    failures = failures_line(summary, Path(args.output))
    if args.json:  # the JSON stays stdout's last line, for scripts
        print(json.dumps(summary))
        if failures:
            print(failures, file=sys.stderr)
    else:
        print(format_summary(summary))
        if failures:
            print(failures)
    return 130 if interrupted else 1 if failures else 0


def queue_workers(client: Client, queue: str) -> dict[str, Heartbeat]:
    """The live workers that consume `queue`, by name, from their heartbeats."""
    return {name: w for name, w in read_live_workers(client.redis).items() if w.queue == queue}


def served_model(client: Client, queue: str, url: str) -> str:
    """The model name the queue's workers advertise; refuses (exit 1, naming the fix) when none serves
    it, or when they disagree (a queue serves one model)."""
    workers = queue_workers(client, queue)
    if not workers:
        raise SystemExit(
            f"weightq batch: no live worker serves queue {queue!r} on {redacted(url)}, so the jobs would "
            "wait forever. Start one with `weightq worker` (the same REDIS_URL and QUEUE), or run the file with a "
            "worker of its own: `weightq batch --local ...`"
        )
    names = sorted({w.served_model for w in workers.values()})
    if len(names) > 1:
        raise SystemExit(
            f"weightq batch: the workers of queue {queue!r} serve different models ({', '.join(names)}); "
            "give each model a QUEUE of its own"
        )
    return names[0]


class WorkerWatch:
    """Called while a batch waits: says once when its queue loses its last worker, and when one is back
    (the jobs wait in Redis meanwhile; a rerun resumes)."""

    def __init__(self, client: Client, queue: str) -> None:
        self.client, self.queue = client, queue
        self.at = time.monotonic()
        self.serving = True

    def __call__(self) -> None:
        if time.monotonic() - self.at < WATCH_S:
            return
        self.at = time.monotonic()
        serving = bool(queue_workers(self.client, self.queue))
        if serving != self.serving:
            self.serving = serving
            print(
                f"\nweightq batch: a worker serves queue {self.queue!r} again"
                if serving
                else f"\nweightq batch: no live worker serves queue {self.queue!r} now; the jobs wait in Redis "
                "until one starts (`weightq worker`); Ctrl-C stops here, a rerun resumes",
                file=sys.stderr,
                flush=True,
            )


@contextlib.contextmanager
def local_worker(url: str, settings: Settings) -> Iterator[None]:
    """A `weightq worker` child on the same Redis, ready before the batch starts and stopped (warm
    shutdown) after it, whatever happens."""
    from .processes import WorkerProcess

    name = f"batch-local-{int(time.time())}@{socket.gethostname()}"
    home = settings.redis.home / "batch-local"
    home.mkdir(parents=True, exist_ok=True)
    print(
        f"weightq batch: starting a local worker on {settings.served.model} (log: {home})", file=sys.stderr, flush=True
    )
    worker = WorkerProcess(url, name, home)
    try:
        try:
            worker.wait_ready(timeout=900)
        except (RuntimeError, TimeoutError) as e:
            raise SystemExit(f"weightq batch --local: the worker did not start: {e}") from None
        yield
    finally:
        try:
            worker.stop()
        finally:
            worker.kill()
