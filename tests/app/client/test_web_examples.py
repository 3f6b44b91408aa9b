"""The web-app examples (examples/: Flask, Django, FastAPI, and the browser page they serve), each run
by its own server as a user would, against a real Redis and worker: tokens arrive as JSON data events
that join into the result, the stream ends with an `end` event (or an `error` event naming what went
wrong), and a client that goes away cancels its job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from weightq.cli.redis_server import free_port
from weightq.client.sse import event

pytestmark = pytest.mark.service  # real Redis servers and worker processes

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SERVERS = {
    "flask": lambda port: [sys.executable, "-m", "flask", "--app", "flask_app", "run", "--port", str(port)],
    "django": lambda port: [sys.executable, "django_app.py", "runserver", str(port), "--noreload"],
    "fastapi": lambda port: [sys.executable, "-m", "uvicorn", "fastapi_app:app", "--port", str(port)],
}


@pytest.fixture(params=sorted(SERVERS))
def example(request, service, tmp_path):
    # 20 ms a step: a 256-token answer takes ~5 s, time enough to leave in the middle
    service.worker(runner="simulated", sim_step_cost="0.02,0,0", max_total_tokens=300).wait_ready()
    port = free_port()
    env = dict(os.environ, REDIS_URL=service.url, PYTHONUNBUFFERED="1")
    log = open(tmp_path / f"{request.param}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(SERVERS[request.param](port), cwd=EXAMPLES, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(base + "/", timeout=2)
            break
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{request.param}.log").read_text()
            time.sleep(0.2)
    yield base, redis.Redis.from_url(service.url)
    proc.terminate()
    proc.wait(10)


def events(lines) -> list[tuple[str, dict]]:
    out, name = [], "message"
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
            name = "message"
    return out


def test_the_page_and_an_answer_streamed_to_its_end(example):
    base, _ = example
    assert "EventSource" in httpx.get(base + "/", timeout=10).text  # the browser side
    with httpx.stream("GET", base + "/ask", params={"q": "Hi there"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = events(r.iter_lines())
    *tokens, (last, result) = got
    assert all(name == "message" for name, _ in tokens) and last == "end"
    assert "".join(t["text"] for _, t in tokens) == result["text"] and result["usage"]["completion_tokens"] > 0


def test_a_client_that_goes_away_cancels_its_job(example):
    base, r = example
    with httpx.stream("GET", base + "/ask", params={"q": "a long answer, please"}, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is generating
    deadline = time.monotonic() + 30  # the answer alone would take ~5 s more
    while (states := [r.hget(k, "state") for k in r.scan_iter("weightq:job:*")]) != [b"cancelled"]:
        assert time.monotonic() < deadline, f"the job went on without its client: {states}"
        time.sleep(0.2)


def test_an_error_ends_the_stream_with_an_error_event(example):
    base, _ = example  # a prompt over the worker's 300-token context: refused by the engine, after submission
    with httpx.stream("GET", base + "/ask", params={"q": "x " * 400}, timeout=60) as resp:
        got = events(resp.iter_lines())
    (name, data) = got[-1]
    assert name == "error" and data["field"] in ("prompt", "max_new_tokens"), got


def test_a_token_holding_a_newline_is_one_data_line():
    text = event({"text": "a\nb\n\ndata: c"})
    assert text.count("\n") == 2 and json.loads(text.removeprefix("data: "))["text"] == "a\nb\n\ndata: c"
    assert event({"message": "no"}, "error").startswith("event: error\ndata: {")
