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
from weightq.cli.redis_server import free_port, process_start

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
    assert not (tmp_path / "redis" / "url").exists() and not (tmp_path / "redis" / "pid").exists()
    assert not _redis_servers_in(tmp_path), "the demo left its Redis running"


def _stop_left(procs: list[subprocess.Popen], timeout: float) -> None:
    """A test's processes still running at its end: SIGTERM (their warm shutdown), then SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def stacks():
    """`weightq up` processes a test starts; a failing test's stack is stopped too, not leaked."""
    procs: list[subprocess.Popen] = []
    yield procs
    _stop_left(procs, 180)


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
    url = (tmp_path / "redis" / "url").read_text().strip()
    proc.send_signal(signal.SIGINT)  # what Ctrl-C does to the foreground process
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "stopping" in out
    assert not (tmp_path / "redis" / "url").exists(), "the URL record outlived its Redis"
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
        home = f"WEIGHTQ_HOME={tmp_path / sig.name}\0"  # the stack's children and its Redis carry it
        assert len(_processes_with_env(home)) >= 3, "no children found to watch"
        proc.send_signal(sig)  # as systemd, a container runtime, `timeout` or a closed terminal would
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "stopping" in out, out
        assert _processes_with_env(home) == [], f"children left running after {sig.name}"
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            raise AssertionError(f"the embedded Redis outlived {sig.name}")
        except redis.ConnectionError:
            pass


def test_a_killed_up_takes_its_children_and_the_embedded_redis_with_it(tmp_path, stacks):
    """SIGKILL leaves `weightq up` no chance to stop anything: the kernel SIGTERMs its children (their
    warm shutdown), and the last of them out stops the embedded Redis, so nothing keeps its ports."""
    proc = _start_up(tmp_path, free_port(), stacks)
    home = f"WEIGHTQ_HOME={tmp_path}\0"  # the stack's children and its Redis carry it
    assert len(_processes_with_env(home)) >= 3, "no children found to watch"
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 180
    while _processes_with_env(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with_env(home) == [], "children left running after weightq up was killed"
    while _redis_servers_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _redis_servers_in(tmp_path) == [], "the embedded Redis outlived weightq up and its children"


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


# ----- the embedded Redis: each command holds it while it runs, the last one out stops it ----------------
def _redis_servers_in(home: Path) -> list[int]:
    """Pids of redis-server processes working in a directory under `home` (whoever started them):
    Redis rewrites its command line, but runs in its --dir."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and os.readlink(proc / "exe").endswith("redis-server")
                and os.readlink(proc / "cwd").startswith(str(home))
                and process_start(int(proc.name)) is not None
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture
def commands(tmp_path):
    """weightq commands a test starts; any still running at its end is stopped, and a Redis that a
    failing test left behind in its WEIGHTQ_HOME too."""
    procs: list[subprocess.Popen] = []
    yield procs
    _stop_left(procs, 120)
    for pid in _redis_servers_in(tmp_path):
        os.kill(pid, signal.SIGTERM)


def _command(home: Path, commands: list, *argv: str) -> subprocess.Popen:
    env = clean_env(home) | {"RUNNER": "simulated", "ENGINE_PROCESS": "off", "MAX_BATCH_WEIGHT": "4096"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightq.cli", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    commands.append(proc)
    return proc


def _ready(proc: subprocess.Popen, home: Path, check, timeout: float = 300) -> int:
    """Waits until the command holds the embedded Redis (its holder file) and `check(url)` holds; the
    server's recorded pid."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"exited {proc.returncode}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "not ready in time"
        try:
            url = (home / "redis" / "url").read_text().strip()
            if (home / "redis" / "holders" / str(proc.pid)).exists() and check(url):
                return int((home / "redis" / "pid").read_text().split()[0])
        except (OSError, ValueError, redis.RedisError, httpx.TransportError):
            pass
        time.sleep(0.2)


def _gateway(home: Path, commands: list) -> subprocess.Popen:
    port = free_port()
    proc = _command(home, commands, "gateway", "--port", str(port), "--log-level", "warning")
    _ready(proc, home, lambda url: httpx.get(f"http://127.0.0.1:{port}/live", timeout=2).status_code == 200)
    return proc


def _worker(home: Path, commands: list) -> subprocess.Popen:
    from weightq.tasks.contract import HEARTBEATS

    name = f"w{free_port()}@test"
    proc = _command(home, commands, "worker", "-n", name, "-c", "4")
    _ready(proc, home, lambda url: redis.Redis.from_url(url, socket_timeout=2).hexists(HEARTBEATS, name))
    return proc


def _redis(home: Path, commands: list) -> subprocess.Popen:
    proc = _command(home, commands, "redis")
    _ready(proc, home, lambda url: redis.Redis.from_url(url, socket_timeout=2).ping())
    return proc


def _stop(proc: subprocess.Popen, sig: signal.Signals) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode in (0, 130), f"exited {proc.returncode} after {sig.name}: {out[-3000:]}"
    return out


def _assert_let_go(home: Path, pid: int) -> None:
    """The server is gone, and so are its URL record and its holders."""
    assert process_start(pid) is None, "the embedded Redis outlived the last command that used it"
    assert not _redis_servers_in(home), "a redis-server of this WEIGHTQ_HOME is still running"
    assert not (home / "redis" / "url").exists(), "the URL record points at a stopped server"
    assert not list((home / "redis" / "holders").iterdir()), "holders left behind"


@pytest.mark.parametrize(
    ("start", "sig"),
    [(_gateway, signal.SIGTERM), (_gateway, signal.SIGINT), (_worker, signal.SIGTERM), (_worker, signal.SIGINT),
     (_redis, signal.SIGHUP)],
    ids=["gateway-sigterm", "gateway-sigint", "worker-sigterm", "worker-sigint", "redis-sighup"],
)  # fmt: skip
def test_a_command_that_started_the_embedded_redis_stops_it_when_it_exits(tmp_path, commands, start, sig):
    proc = start(tmp_path, commands)
    pid = int((tmp_path / "redis" / "pid").read_text().split()[0])
    _stop(proc, sig)
    _assert_let_go(tmp_path, pid)


def test_batch_stops_the_embedded_redis_it_started_at_its_end_and_when_it_fails(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": "r{i}", "prompt": "hello {i}", "max_new_tokens": 4}}\n' for i in range(3)))
    env = clean_env(tmp_path) | {"RUNNER": "simulated", "MAX_BATCH_WEIGHT": "4096"}
    run = [sys.executable, "-m", "weightq.cli", "batch", str(src), "--no-progress"]
    # no worker serves the queue: refused (exit 1) after the Redis started
    refused = subprocess.run([*run, "-o", str(tmp_path / "a.jsonl")], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 1 and "no live worker" in refused.stderr, refused.stderr[-3000:]
    assert "started the embedded Redis" in refused.stderr
    assert not _redis_servers_in(tmp_path) and not (tmp_path / "redis" / "url").exists()
    done = subprocess.run([*run, "--local", "-o", str(tmp_path / "b.jsonl")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert len((tmp_path / "b.jsonl").read_text().splitlines()) == 3
    assert not _redis_servers_in(tmp_path) and not (tmp_path / "redis" / "url").exists()


def test_commands_share_one_embedded_redis_and_the_last_one_out_stops_it(tmp_path, commands):
    held = _redis(tmp_path, commands)  # the first holder starts the server
    pid = int((tmp_path / "redis" / "pid").read_text().split()[0])
    url = (tmp_path / "redis" / "url").read_text().strip()
    gateway = _gateway(tmp_path, commands)
    worker = _worker(tmp_path, commands)
    assert int((tmp_path / "redis" / "pid").read_text().split()[0]) == pid, "a second server was started"
    assert len(list((tmp_path / "redis" / "holders").iterdir())) == 3
    for proc, sig in ((held, signal.SIGTERM), (gateway, signal.SIGINT)):  # the one that started it goes first
        _stop(proc, sig)
        assert redis.Redis.from_url(url, socket_timeout=2).ping(), "stopped while others still use it"
        assert (tmp_path / "redis" / "url").read_text().strip() == url
    _stop(worker, signal.SIGTERM)  # the last one out, which did not start it
    _assert_let_go(tmp_path, pid)


def test_a_killed_holder_does_not_keep_the_embedded_redis_running(tmp_path, commands):
    gateway = _gateway(tmp_path, commands)  # starts it
    pid = int((tmp_path / "redis" / "pid").read_text().split()[0])
    held = _redis(tmp_path, commands)
    gateway.kill()  # SIGKILL: no cleanup; its holder file stays behind
    gateway.wait(30)
    assert process_start(pid) is not None
    _stop(held, signal.SIGTERM)
    _assert_let_go(tmp_path, pid)
