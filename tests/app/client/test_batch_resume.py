"""`weightq batch` as a data tool that is never silently wrong: a killed client's jobs are collected by
the rerun (each line generated once), duplicate ids are refused before anything runs, failed lines set
the exit status, and a line's settings under OpenAI's names (max_tokens, model) run as asked. A real
Redis and worker processes (the simulated device where the outputs do not matter)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from weightq.client.batch import run_batch
from weightq.client.batch_output import Journal
from weightq.tasks.contract import job_key

pytestmark = pytest.mark.service  # real Redis servers and worker processes

ROOT = Path(__file__).resolve().parents[3]
SIM = dict(runner="simulated", sim_step_cost="0.01,0,0")


def write(path: Path, lines: list[dict | str]) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def batch_jobs(url: str) -> int:
    """Jobs submitted by batch runs: each has a record in Redis (kept RESULT_TTL_S)."""
    return sum(1 for _ in redis.Redis.from_url(url).scan_iter(job_key("batch-*"), count=1000))


def cli(url: str, *args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, REDIS_URL=url)
    cmd = [sys.executable, "-m", "weightq.cli", "batch", *args, "--no-progress"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, **kw)


def test_a_killed_runs_jobs_are_collected_by_the_rerun_never_generated_twice(service, tmp_path):
    service.worker(**SIM).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = 48
    write(src, [{"id": f"q{i}", "prompt": f"p{i}", "max_new_tokens": 30, "ignore_eos": True, "row": i}
                for i in range(lines)])  # fmt: skip
    cmd = [sys.executable, "-m", "weightq.cli", "batch", str(src), "-o", str(out), "--max-in-flight", "16",
           "--no-progress", "--json"]  # fmt: skip
    env = dict(os.environ, REDIS_URL=service.url)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not out.exists() or len(out.read_text().splitlines()) < 4:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # no handler runs: its jobs in flight go on in the worker
    proc.communicate(timeout=30)
    written = len(records(out))
    assert written < lines
    in_flight = Journal(out).pending()
    assert in_flight and not set(in_flight) & {r["id"] for r in records(out)}

    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["skipped"] == written
    assert summary["resumed_jobs"] + summary["rerun_jobs"] == len(in_flight) and summary["resumed_jobs"] >= 1
    final = records(out)
    assert sorted(r["id"] for r in final) == sorted(f"q{i}" for i in range(lines))  # each line once
    assert all(r["result"]["usage"]["completion_tokens"] == 30 and r["row"] == int(r["id"][1:]) for r in final)
    assert batch_jobs(service.url) == lines  # one job per line: none generated twice
    assert not Journal.of(out).exists()  # a finished run leaves nothing to collect


def test_a_journaled_job_is_collected_or_run_again_when_gone(service, tmp_path):
    """The rerun's two cases, without timing: a job that ended while its client was dead is written from
    its record; one whose record expired (or was never sent) runs again, and the summary says so."""
    service.worker(**SIM).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, [{"id": f"q{i}", "prompt": f"p{i}", "max_new_tokens": 3, "ignore_eos": True} for i in range(3)])
    earlier = service.client.submit(prompt="p0", max_new_tokens=3, ignore_eos=True, request_id="batch-earlier-1")
    text = earlier.result(timeout=60)["text"]
    journal = Journal(out)
    journal.submitted("q0", "batch-earlier-1")
    journal.submitted("q1", "batch-expired-2")
    journal.close(finished=False)
    summary, _ = run_batch(src, out, service.client, progress=False)
    assert summary["resumed_jobs"] == 1 and summary["rerun_jobs"] == 1 and summary["completed"] == 3
    by_id = {r["id"]: r for r in records(out)}
    assert by_id["q0"]["result"]["id"] == "batch-earlier-1" and by_id["q0"]["result"]["text"] == text
    assert by_id["q1"]["result"]["id"] != "batch-expired-2"
    assert batch_jobs(service.url) == 3  # the earlier one, and q1 and q2 now


def test_duplicate_ids_are_refused_before_anything_runs_and_failures_set_the_exit_status(service, tmp_path):
    service.worker(**SIM).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"prompt": "z"}, {"id": "b", "prompt": "w"}])
    done = cli(service.url, str(src), "-o", str(out))
    assert done.returncode == 1 and "id 'b' is on line 2 and line 4" in done.stderr, done.stderr[-2000:]
    assert batch_jobs(service.url) == 0 and not out.exists()  # nothing submitted, nothing written

    write(src, [{"id": "a", "prompt": "x", "max_tokens": 2}, {"id": "b", "prompt": "y", "max_tokens": -1},
                {"id": "c", "prompt": "z", "max_tokens": 2}])  # fmt: skip
    done = cli(service.url, str(src), "-o", str(out))
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith(f"1 of 3 lines failed: their records in {out} hold an error"), last
    assert {r["id"]: r for r in records(out)}["b"]["error"]["field"] == "max_tokens"
    done = cli(service.url, str(src), "-o", str(out), "--keep-failed", "--json")  # the failure is still there
    assert done.returncode == 1 and json.loads(done.stdout)["lines_failed"] == 1
    assert "1 of 3 lines failed" in done.stderr.strip().splitlines()[-1]

    write(src, [{"id": "a", "prompt": "x", "max_tokens": 2}, {"id": "c", "prompt": "z", "max_tokens": 2}])
    done = cli(service.url, str(src), "-o", str(tmp_path / "fine.jsonl"))
    assert done.returncode == 0 and "lines failed" not in done.stdout, done.stdout


def test_openai_names_in_weightqs_lines_run_as_asked(service, tmp_path):
    service.worker(**SIM).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, [
        {"id": "mt", "prompt": "x", "max_tokens": 5, "ignore_eos": True, "metadata": {"row": 1}},
        {"id": "mct", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "ignore_eos": True},
        {"id": "both", "prompt": "x", "max_tokens": 5, "max_new_tokens": 6},
        {"id": "base", "prompt": "x", "max_tokens": 2, "model": "sim-model"},
        {"id": "lora", "prompt": "x", "max_tokens": 2, "model": "support"},
        {"id": "n", "prompt": "x", "n": 2},
    ])  # fmt: skip
    summary, _ = run_batch(src, out, service.client, progress=False, model="sim-model")
    by_id = {r["id"]: r for r in records(out)}
    assert by_id["mt"]["result"]["usage"]["completion_tokens"] == 5 and by_id["mt"]["metadata"] == {"row": 1}
    assert "max_tokens" not in by_id["mt"]  # a setting, not a column
    assert by_id["mct"]["result"]["usage"]["completion_tokens"] == 3
    assert by_id["both"]["error"]["field"] == "max_tokens" and "5 vs 6" in by_id["both"]["error"]["message"]
    assert by_id["base"]["result"]["usage"]["completion_tokens"] <= 2
    lora = by_id["lora"]["error"]
    assert lora["field"] == "model" and "(serving 'sim-model'; LoRA adapters: none)" in lora["message"]
    assert by_id["n"]["error"]["field"] == "n"
    assert summary["lines_failed"] == 3 and summary["lines"] == 6
    assert batch_jobs(service.url) == 3  # the refused lines never reached the queue


def test_a_lines_model_names_the_lora_adapter_it_runs_on(service, tiny_path, tmp_path):
    from tests.engine.test_lora import make_adapter

    ada = make_adapter(tiny_path, tmp_path / "ada", 8, 11)
    worker = service.worker(lora_modules=f"ada={ada}", compile="off")
    worker.wait_ready()
    worker.wait_stats(lambda s: s.get("adapters") == ["ada"])
    ids = [11, 220, 305, 17, 42, 990, 7]
    want = {
        name: service.client.submit(prompt_token_ids=ids, adapter=name, max_new_tokens=8, ignore_eos=True).result(
            timeout=120
        )["text"]
        for name in ("", "ada")
    }
    assert want[""] != want["ada"]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"prompt_token_ids": ids, "max_tokens": 8, "ignore_eos": True}
    write(src, [line | {"id": "a", "model": "ada"}, line | {"id": "b", "model": "builtin:tiny"},
                line | {"id": "c", "model": "nope"}])  # fmt: skip
    run_batch(src, out, service.client, progress=False)  # the served name: from the workers' heartbeats
    by_id = {r["id"]: r for r in records(out)}
    assert by_id["a"]["result"]["text"] == want["ada"] and by_id["b"]["result"]["text"] == want[""]
    assert "(serving 'builtin:tiny'; LoRA adapters: ada)" in by_id["c"]["error"]["message"]
