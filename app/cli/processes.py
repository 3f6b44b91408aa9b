"""One worker or gateway as a child process, waited on until it serves: what the test suites and the
benchmarks start (`weightq up` supervises a whole stack: stack.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
from weightq.redis_conn import connect_streams
from weightq.settings import Settings
from weightq.tasks.contract import HEARTBEATS

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """`weightq worker` in a subprocess, ready once its heartbeat appears in Redis."""

    def __init__(self, url: str, name: str, home: Path, *, argv: tuple[str, ...] = (), **settings: object) -> None:
        """`argv`: more of `weightq worker`'s options (e.g. `-c 4`); `settings`: its environment."""
        self.name = name
        self.log_path = home / f"{name.split('@')[0]}.log"
        env = dict(os.environ, REDIS_URL=url, WEIGHTQ_HOME=str(home), PYTHONUNBUFFERED="1")
        env.update({k.upper(): str(v) for k, v in settings.items()})
        with open(self.log_path, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightq.cli", "worker", "-n", name, "-l", "INFO", *argv],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.redis = connect_streams(Settings.from_env(env).redis)  # heartbeats live with the streams

    def wait_ready(self, timeout: float = 300) -> WorkerProcess:
        deadline = time.monotonic() + timeout
        while not self.redis.hexists(HEARTBEATS, self.name):
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.name} not ready:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        return self

    def stats(self) -> dict:
        import json

        raw = self.redis.hget(HEARTBEATS, self.name)
        return json.loads(raw) if raw else {}

    def wait_stats(self, ok=lambda s: True, timeout: float = 60) -> dict:
        """The first heartbeat written from now on that satisfies `ok` (heartbeats come about once a
        second, later on a busy machine: a test never assumes when)."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.get("ts", 0) > since and ok(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {self.name}: no heartbeat satisfied the condition in {timeout} s: {s}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        with contextlib.suppress(redis.RedisError):
            self.redis.hdel(HEARTBEATS, self.name)

    def stop(self, timeout: float = 120) -> int:
        """Warm shutdown (SIGTERM); a worker that hangs is killed and the test fails."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"worker {self.name} hung on warm shutdown:\n{self.log()[-3000:]}") from None
        return self.proc.returncode


class GatewayProcess:
    """`weightq gateway` in a subprocess on a free port, ready once it answers /health."""

    def __init__(self, url: str, home: Path, **settings: object) -> None:
        from weightq.cli.redis_server import free_port

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = home / f"gateway-{self.port}.log"
        env = dict(os.environ, REDIS_URL=url, WEIGHTQ_HOME=str(home), PYTHONUNBUFFERED="1")
        env.update({k.upper(): str(v) for k, v in settings.items()})
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightq.cli", "gateway", "--port", str(self.port), "--log-level", "warning"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 120) -> GatewayProcess:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                httpx.get(self.base + "/health", timeout=2)
                return self
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gateway not ready:\n{self.log()[-3000:]}") from None
                time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
