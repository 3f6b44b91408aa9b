"""The `weightq batch` command: app/client/batch.py run on a file, against the workers' Redis."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from weightq.client import Client
from weightq.client.batch import run_batch
from weightq.gateway.openai_batch import OpenAIBatchLines
from weightq.settings import Settings

from .redis_server import ensure_redis


def batch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="run a JSONL file of requests through the workers, writing results as they complete",
        description="Offline batch inference. Each input line is a request: prompt, messages or prompt_token_ids, "
        'sampling parameters, optional "id"; or a line of OpenAI\'s Batch API (custom_id, method, url, body), '
        "answered with OpenAI's batch output line. Rerun the same command to resume: ids already in the output "
        "are skipped.",
    )
    p.add_argument("input", help="JSONL file of requests")
    p.add_argument("-o", "--output", required=True, help="JSONL file of results (appended; resumable)")
    p.add_argument("--max-in-flight", type=int, default=256, help="jobs queued at once (default 256)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--priority", type=int, default=None, help="priority class 0-9 of lines that name none (background: below 5)"
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
    client = Client(ensure_redis(settings), settings=settings)
    openai_lines = OpenAIBatchLines(settings.served_model_name or settings.model)
    summary, interrupted = run_batch(
        src,
        Path(args.output),
        client,
        max_in_flight=args.max_in_flight,
        progress=not args.no_progress,
        formats=[openai_lines],
        priority=args.priority,
    )
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
    return 130 if interrupted else 0


def format_summary(s: dict) -> str:
    lat = "n/a" if s["latency_p50_s"] is None else f"p50 {s['latency_p50_s']:.2f} s, p99 {s['latency_p99_s']:.2f} s"
    return (
        f"{s['requests']} requests: {s['completed']} completed, {s['failed']} failed, {s['skipped']} skipped "
        f"(already done); {s['completion_tokens']} tokens in {s['elapsed_s']:.1f} s = {s['tokens_per_s']:.0f} tok/s; "
        f"latency {lat}"
    )
