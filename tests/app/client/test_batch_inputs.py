"""`weightq batch` on the files a user really has: a line that is not UTF-8 is refused by its line,
never run with its bytes replaced, and an output the run would destroy (the input itself, a file
`weightq batch` did not write) or cannot write is refused before anything runs, without a traceback.
A real Redis and a worker process (the simulated device: the outputs do not matter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from weightq.client.batch import run_batch
from weightq.gateway.openai_batch import OpenAIBatchLines
from weightq.tasks.contract import job_key

pytestmark = pytest.mark.service  # real Redis servers and worker processes

ROOT = Path(__file__).resolve().parents[3]
SIM = dict(runner="simulated", sim_step_cost="0.01,0,0")


def batch_jobs(url: str) -> int:
    return sum(1 for _ in redis.Redis.from_url(url).scan_iter(job_key("batch-*"), count=1000))


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, REDIS_URL=url)
    cmd = [sys.executable, "-m", "weightq.cli", "batch", *args, "--no-progress"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_line_that_is_not_utf8_is_refused_never_run_with_its_bytes_replaced(service, tmp_path):
    service.worker(**SIM).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(
        b"\xef\xbb\xbf"  # the byte-order mark some editors write first
        + json.dumps({"id": "utf8", "prompt": "caf\u00e9 \ufffd", "max_new_tokens": 2}).encode() + b"\n"
        + b'{"id": "latin1", "prompt": "caf\xe9", "max_new_tokens": 2}\n'  # saved as Latin-1
        + b'{"custom_id": "oa", "method": "POST", "url": "/v1/completions", "body": {"prompt": "\xff"}}\n'
        + b"\xfe\xff\n"
    )  # fmt: skip
    formats = [OpenAIBatchLines("builtin:tiny")]  # as `weightq batch` reads a file
    summary, interrupted = run_batch(src, out, service.client, progress=False, formats=formats)
    assert not interrupted
    by_id = {r.get("custom_id", r["id"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert set(by_id) == {"latin1", "utf8", "oa", "line-4"}  # a refused line keeps its id when it has one
    for line_id, (n, byte) in {"latin1": (2, "0xe9"), "oa": (3, "0xff"), "line-4": (4, "0xfe")}.items():
        error = by_id[line_id]["error"]
        assert error["field"] == "line" and f"line {n} is not UTF-8 (byte {byte}" in error["message"], error
    assert by_id["utf8"]["result"]["usage"]["completion_tokens"] == 2  # U+FFFD written as such is text
    assert summary["failed"] == 3 and summary["lines_failed"] == 3
    assert batch_jobs(service.url) == 1  # only the UTF-8 line ran


def test_an_output_the_run_would_destroy_or_cannot_write_is_refused_before_anything_runs(service, tmp_path):
    service.worker(**SIM).wait_ready()
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "x", "max_new_tokens": 2}) + "\n")
    data = tmp_path / "eval.jsonl"  # another data set, not a batch output
    data.write_text("".join(json.dumps({"id": f"e{i}", "input": "q", "label": i}) + "\n" for i in range(3)))
    kept = {p: p.read_bytes() for p in (src, data)}

    for output, says in [
        (src, "is the input file"),
        (data, "was not written by weightq batch"),
        (tmp_path / "missing" / "out.jsonl", "no such directory"),
        (tmp_path, "is a directory"),
    ]:
        done = cli(service.url, str(src), "-o", str(output))
        assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert {p: p.read_bytes() for p in kept} == kept  # neither file touched
    assert batch_jobs(service.url) == 0

    done = cli(service.url, str(src), "-o", str(data), "--force")  # the user's word: it is an output
    assert done.returncode == 0, done.stderr[-2000:]
    assert batch_jobs(service.url) == 1


def test_a_lone_surrogate_in_an_id_or_a_column_is_written_and_read_back_as_given(service, tmp_path):
    service.worker(**SIM).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    cut = "an emoji cut in two \ud83d"  # JSON's "\ud83d": valid JSON, not encodable as UTF-8
    lines = [
        {"id": "a", "prompt": "x", "max_new_tokens": 2, "note": cut},
        {"id": cut, "prompt": "y", "max_new_tokens": 2},
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary, _ = run_batch(src, out, service.client, progress=False)
    assert summary["completed"] == 2 and summary["failed"] == 0
    by_id = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(by_id) == {"a", cut} and by_id["a"]["note"] == cut
    again, _ = run_batch(src, out, service.client, progress=False)  # each id found again: nothing reruns
    assert again["skipped"] == 2 and again["requests"] == 0 and batch_jobs(service.url) == 2
