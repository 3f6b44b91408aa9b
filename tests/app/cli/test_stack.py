"""`weightq up` and `weightq demo` as a user runs them: subprocesses, embedded Redis, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from weightq.cli.redis_server import free_port

pytestmark = pytest.mark.service  # real Redis servers and worker processes

ROOT = Path(__file__).resolve().parents[3]


def clean_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "API_KEY")}
    return env | {"WEIGHTQ_HOME": str(home), "PYTHONUNBUFFERED": "1"}


def test_demo_runs_the_whole_stack_and_exits_cleanly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "weightq.cli", "demo"], cwd=ROOT, env=clean_env(tmp_path), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for expected in ("embedded Redis", "one chat completion", "200 requests: 200 completed, 0 failed", "engine:"):
        assert expected in out, out
    assert len((tmp_path / "demo" / "results.jsonl").read_text().splitlines()) == 200
    url = (tmp_path / "redis" / "url").read_text().strip()
    try:
        redis.Redis.from_url(url, socket_timeout=1).ping()
        raise AssertionError("the demo left its Redis running")
    except redis.ConnectionError:
        pass


@pytest.fixture
def stacks():
    """`weightq up` processes a test starts; a failing test's stack is stopped too, not leaked."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(180)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_up_serves_until_ctrl_c_then_stops_everything(tmp_path, stacks):
    port, flower_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightq.cli", "up", "--port", str(port), "--flower", "--flower-port", str(flower_port)],
        cwd=ROOT, env=clean_env(tmp_path) | {"FLOWER_UNAUTHENTICATED_API": "true"},  # on loopback, opted in
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    stacks.append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    r = httpx.post(base + "/v1/completions", json={"prompt": "hello", "max_tokens": 5}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    flower = f"http://127.0.0.1:{flower_port}"
    while True:  # Flower lists the worker (its API opened on loopback: FLOWER_UNAUTHENTICATED_API)
        try:
            workers = httpx.get(flower + "/api/workers?refresh=1", timeout=10).json()
            if workers:
                break
        except (httpx.TransportError, ValueError):
            pass
        assert time.monotonic() < deadline, "flower never listed the worker"
        time.sleep(0.3)
    assert any("weightq" in name for name in workers)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C does to the foreground process
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "stopping" in out
    url = (tmp_path / "redis" / "url").read_text().strip()
    probes = (
        lambda: httpx.get(base + "/health", timeout=1),
        lambda: httpx.get(flower + "/healthcheck", timeout=1),
        lambda: redis.Redis.from_url(url).ping(),
    )
    for probe in probes:
        try:
            probe()
            raise AssertionError("something still answers after Ctrl-C")
        except (httpx.TransportError, redis.ConnectionError):
            pass


def _processes_with_env(needle: str) -> list[int]:
    """Pids whose environment holds `needle` (the stack's children carry its REDIS_URL)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle.encode() in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def _start_up(tmp_path, port: int, stacks: list) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightq.cli", "up", "--port", str(port)], cwd=ROOT, env=clean_env(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    stacks.append(proc)
    for line in proc.stdout:
        if "weightq: ready" in line:
            return proc
    raise AssertionError(f"weightq up exited ({proc.wait()}) before it was ready")


def test_sigterm_and_sighup_stop_everything_as_ctrl_c_does(tmp_path, stacks):
    for sig in (signal.SIGTERM, signal.SIGHUP):
        port = free_port()
        proc = _start_up(tmp_path / sig.name, port, stacks)
        url = (tmp_path / sig.name / "redis" / "url").read_text().strip()
        assert _processes_with_env(f"REDIS_URL={url}"), "no children found to watch"
        proc.send_signal(sig)  # as systemd, a container runtime, `timeout` or a closed terminal would
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "stopping" in out, out
        assert _processes_with_env(f"REDIS_URL={url}") == [], f"children left running after {sig.name}"
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            raise AssertionError(f"the embedded Redis outlived {sig.name}")
        except redis.ConnectionError:
            pass


def test_up_and_gateway_refuse_a_port_in_use_before_saying_ready(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for cmd in (["up", "--port", str(port)], ["gateway", "--port", str(port)]):
            proc = subprocess.run(
                [sys.executable, "-m", "weightq.cli", *cmd], cwd=ROOT, env=clean_env(tmp_path), capture_output=True,
                text=True, timeout=120,
            )  # fmt: skip
            assert proc.returncode != 0, proc.stdout
            assert "ready" not in proc.stdout and f"127.0.0.1:{port} (gateway) is already in use" in proc.stderr
            assert not (tmp_path / "redis" / "url").exists(), "it started the embedded Redis first"
