"""`weightq batch`: streamed input, results as they complete, failures recorded, resumable, Ctrl-C safe."""

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
from weightq.client.batch import BatchRun, run_batch
from weightq.client.batch_output import done_ids

pytestmark = pytest.mark.service  # real Redis servers and worker processes

ROOT = Path(__file__).resolve().parents[3]


def write_requests(path: Path, n: int, max_new_tokens: int = 8) -> None:
    with open(path, "w") as f:
        for i in range(n):
            if i % 5 == 0:
                rec = {"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
            else:
                rec = {"id": f"q{i}", "prompt": f"prompt number {i}:"}
            f.write(json.dumps(rec | {"max_new_tokens": max_new_tokens}) + "\n")


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_results_errors_and_resume(service, tmp_path):
    service.worker().wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_requests(src, 30)
    with open(src, "a") as f:
        f.write("{not json\n\nnull\n")
        f.write(json.dumps({"id": "bad-field", "prompt": "x", "max_new_tokens": -3}) + "\n")
        f.write(json.dumps({"prompt": "no id given", "max_new_tokens": 4}) + "\n")
        f.write(json.dumps({"id": "too-long", "prompt_token_ids": [5] * 3000}) + "\n")  # refused by the worker
    summary, interrupted = run_batch(src, out, service.client, max_in_flight=8, progress=False)
    assert not interrupted
    records = {r["id"]: r for r in read_output(out)}
    assert len(records) == 35 and len(read_output(out)) == 35  # the blank line is no request
    assert summary["completed"] == 31 and summary["failed"] == 4 and summary["requests"] == 35
    assert records["line-33"]["error"]["field"] == "request"  # null: JSON, but not an object
    assert records["bad-field"]["error"]["field"] == "max_new_tokens"
    assert records["line-31"]["error"]["field"] == "line"
    assert records["too-long"]["error"]["field"] == "prompt"
    assert records["line-35"]["result"]["usage"]["completion_tokens"] <= 4
    assert all(records[f"q{i}"]["result"]["finish_reason"] in ("length", "eos") for i in range(30))
    assert summary["completion_tokens"] == sum(r["result"]["usage"]["completion_tokens"] for r in records.values()
                                               if "result" in r)  # fmt: skip
    # Resume: a torn last line is cut, its id runs again; everything else is skipped.
    lines = out.read_text().splitlines(keepends=True)
    torn = json.loads(lines[-1])["id"]
    out.write_text("".join(lines[:-1]) + lines[-1][:10])
    summary, _ = run_batch(src, out, service.client, max_in_flight=8, progress=False, keep_failed=True)
    assert summary["skipped"] == 34 and summary["requests"] == 1
    assert [r["id"] for r in read_output(out)].count(torn) == 1 and len(read_output(out)) == 35


def test_a_batch_runs_at_the_class_it_is_given(service, tmp_path):
    import redis
    from weightq.tasks.contract import job_key

    service.worker().wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "x", "max_new_tokens": 2}) + "\n"
                   + json.dumps({"id": "b", "prompt": "y", "max_new_tokens": 2, "priority": 7}) + "\n")  # fmt: skip
    summary, _ = run_batch(src, out, service.client, max_in_flight=8, progress=False, priority=1)
    assert summary["completed"] == 2
    r = redis.Redis.from_url(service.url)
    classes = sorted(json.loads(r.hget(k, "request")).get("priority") for k in r.scan_iter(job_key("batch-*")))
    assert classes == [1, 7]  # a line's own class wins


def test_input_is_streamed_with_bounded_jobs_in_flight(service, tmp_path):
    service.worker().wait_ready()
    src = tmp_path / "in.jsonl"
    write_requests(src, 40, max_new_tokens=4)
    out = open(tmp_path / "out.jsonl", "w")  # noqa: SIM115
    run = BatchRun(service.client, out, max_in_flight=6)

    def lines():
        with open(src) as f:
            for n, line in enumerate(f, start=1):
                # Reading line n means at most 6 jobs are queued: the rest of the file is not in memory.
                assert len(run.inflight) <= 6 and n - 1 - run.progress.completed <= 6
                yield n, line

    run.submit_lines(lines(), set())
    out.close()
    assert run.progress.completed == 40 and not run.inflight


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_cancels_the_runs_jobs_leaves_a_valid_file_and_a_rerun_finishes(service, tmp_path, sig):
    """Ctrl-C, or SIGTERM (a scheduler's or a container's stop): the run's queued and running jobs are
    cancelled, none is left to run for nobody, and rerunning resumes."""
    service.worker().wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_requests(src, 80, max_new_tokens=48)
    cmd = [sys.executable, "-m", "weightq.cli", "batch", str(src), "-o", str(out), "--max-in-flight", "16", "--json"]
    env = dict(os.environ, REDIS_URL=service.url)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not out.exists() or len(out.read_text().splitlines()) < 5:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    r = redis.Redis.from_url(service.url)
    deadline = time.monotonic() + 15
    while any(r.hget(k, "state") in (b"queued", b"running") for k in r.scan_iter("weightq:job:*")):
        assert time.monotonic() < deadline, "the interrupted run left jobs queued or running"
        time.sleep(0.2)
    first = read_output(out)  # every line parses
    assert 5 <= len(first) < 80
    summary = json.loads(subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout)
    assert summary["skipped"] == len(first) and summary["failed"] == 0
    ids = [r["id"] for r in read_output(out)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(80))  # each exactly once
    assert done_ids(out) == set(ids)


def test_openai_batch_files_give_openai_shaped_lines(service, tmp_path):
    """200 mixed lines of OpenAI's Batch API format (chat, completions, some invalid), run unchanged."""
    from weightq.gateway.openai_batch import OpenAIBatchLines

    service.worker().wait_ready()
    src, out = tmp_path / "openai.jsonl", tmp_path / "openai-out.jsonl"
    bad = {
        7: ({"url": "/v1/embeddings"}, "url"),
        19: ({"method": "GET"}, "method"),
        23: ({"body": {"prompt": "x", "max_tokens": -2}}, "max_tokens"),
        41: ({"body": {"prompt": "x", "n": 3}}, "n"),
        77: ({"body": {"prompt": "x", "stream": True}}, "stream"),
        99: ({"body": {"prompt": [5] * 3000, "max_tokens": 4}}, "prompt"),  # refused by the worker
    }
    with open(src, "w") as f:
        for i in range(200):
            chat = i % 3 == 0
            body = {"model": "builtin:tiny", "max_tokens": 6, "temperature": 0}
            body |= {"messages": [{"role": "user", "content": f"q{i}"}]} if chat else {"prompt": f"line {i}:"}
            line = {"custom_id": f"req-{i}", "method": "POST", "body": body}
            line["url"] = "/v1/chat/completions" if chat else "/v1/completions"
            change, _ = bad.get(i, ({}, None))
            if "body" in change:
                line["body"] = {"model": "builtin:tiny", **change["body"]}
                line["url"] = "/v1/completions"
            line |= {k: v for k, v in change.items() if k != "body"}
            f.write(json.dumps(line) + "\n")
        f.write("[1, 2]\n")  # JSON, not a request of either kind
    summary, _ = run_batch(src, out, service.client, max_in_flight=32, progress=False,
                           formats=[OpenAIBatchLines("builtin:tiny")])  # fmt: skip
    lines = read_output(out)
    assert len(lines) == 201 and summary["completed"] == 194 and summary["failed"] == 7
    by_id = {r.get("custom_id", r.get("id")): r for r in lines}
    for i in range(200):
        r = by_id[f"req-{i}"]
        assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
        resp = r["response"]
        assert resp["request_id"] and r["id"] == f"batch_req_{resp['request_id']}"
        if i in bad:
            assert resp["status_code"] == 400 and resp["body"]["error"]["param"] == bad[i][1], (i, resp)
            continue
        body = resp["body"]
        assert resp["status_code"] == 200 and body["model"] == "builtin:tiny"
        if i % 3 == 0:
            assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        else:
            assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
        assert 0 < body["usage"]["completion_tokens"] <= 6
    assert by_id["line-201"]["error"]["field"] == "request"  # the native format's record
    summary, _ = run_batch(src, out, service.client, max_in_flight=32, progress=False, keep_failed=True,
                           formats=[OpenAIBatchLines("builtin:tiny")])  # fmt: skip
    assert summary["skipped"] == 201 and len(read_output(out)) == 201  # resume by custom_id


def _openai_line(custom_id: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_without_a_worker_batch_refuses_at_once_naming_the_fix(service, tmp_path):
    import redis

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_requests(src, 3)
    env = dict(os.environ, REDIS_URL=service.url)
    cmd = [sys.executable, "-m", "weightq.cli", "batch", str(src), "-o", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # never waits
    assert done.returncode == 1
    assert "no live worker serves queue 'weightq'" in done.stderr and "`weightq worker`" in done.stderr
    assert "weightq batch --local" in done.stderr
    assert redis.Redis.from_url(service.url).llen("weightq") == 0 and not out.exists()  # nothing was queued


def test_batch_takes_the_model_name_the_workers_advertise(service, tmp_path):
    service.worker(served_model_name="house-model").wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(_openai_line("a", "house-model") + "\n" + _openai_line("b", "builtin:tiny") + "\n")
    env = {k: v for k, v in os.environ.items() if k != "SERVED_MODEL_NAME"} | {"REDIS_URL": service.url}
    cmd = [sys.executable, "-m", "weightq.cli", "batch", str(src), "-o", str(out), "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    status = {r["custom_id"]: r["response"]["status_code"] for r in read_output(out)}
    assert status == {"a": 200, "b": 400}  # the workers' served name, not this process' MODEL
    refusal = {r["custom_id"]: r for r in read_output(out)}["b"]["response"]["body"]["error"]
    assert refusal["param"] == "model" and "(serving 'house-model'; LoRA adapters: none)" in refusal["message"]
    assert done.returncode == 1 and done.stdout.strip().splitlines()[-1].startswith("1 of 2 lines failed")


def test_batch_local_brings_its_own_worker(service, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_requests(src, 6, max_new_tokens=4)
    env = dict(os.environ, REDIS_URL=service.url, WEIGHTQ_HOME=str(tmp_path), MAX_BATCH_WEIGHT="4096",
               ENGINE_PROCESS="off")  # fmt: skip
    cmd = [sys.executable, "-m", "weightq.cli", "batch", str(src), "-o", str(out), "--local", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["completed"] == 6
    import redis
    from weightq.tasks.contract import HEARTBEATS

    assert not redis.Redis.from_url(service.url).hgetall(HEARTBEATS)  # its worker stopped with it
