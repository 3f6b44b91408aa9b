"""The whole stack on one machine: `weightq up` (serve until Ctrl-C) and `weightq demo` (show it, exit).

The children (Redis, worker, gateway, Flower) run in their own sessions, so Ctrl-C reaches only this
supervisor, which stops them in order: gateway and Flower, then the worker (warm shutdown: running
generations finish or go back to the queue), then the Redis it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis

from .metrics import HEARTBEATS, live_workers
from .redis_server import EmbeddedRedis
from .settings import Settings


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: IO | None = None


@dataclass
class Stack:
    settings: Settings
    host: str = "127.0.0.1"
    port: int = 8000
    flower_port: int | None = None  # None: no Flower
    log_dir: Path | None = None  # None: children write to this terminal
    worker_name: str = "weightq@%h"
    children: list[Child] = field(default_factory=list)
    redis_server: EmbeddedRedis | None = None
    url: str = ""

    def start(self) -> None:
        s = self.settings
        if s.redis_url:
            self.url = s.redis_url
        else:
            self.redis_server = EmbeddedRedis(s.home / "redis", appendfsync=s.redis_appendfsync)
            self.url = self.redis_server.start()
            (s.home / "redis" / "url").write_text(self.url)
            print(f"weightq: embedded Redis at {self.url} (data in {self.redis_server.data_dir})", flush=True)
        env = dict(os.environ, REDIS_URL=self.url, PYTHONUNBUFFERED="1")
        py = [sys.executable, "-m"]
        self._spawn("worker", [*py, "app.cli", "worker", "-n", self.worker_name, "-l", "INFO"], env)
        gw = [*py, "app.cli", "gateway", "--host", self.host, "--port", str(self.port), "--log-level", "warning"]
        self._spawn("gateway", gw, env)
        if self.flower_port is not None:
            flower = [*py, "celery", "-A", "app", "flower", f"--port={self.flower_port}", f"--address={self.host}"]
            auth = os.environ.get("FLOWER_BASIC_AUTH")
            if auth:
                flower.append(f"--basic-auth={auth}")
            env_f = env if auth else env | {"FLOWER_UNAUTHENTICATED_API": "true"}
            self._spawn("flower", flower, env_f)

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        log = open(self.log_dir / f"{name}.log", "w") if self.log_dir else None  # noqa: SIM115 (closed in stop)
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log or None,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        self.children.append(Child(name, proc, log))

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 300) -> dict:
        """Until a worker's heartbeat is in Redis and the gateway answers; returns the worker's stats."""
        import httpx

        r = redis.Redis.from_url(self.url, socket_timeout=5)
        deadline = time.monotonic() + timeout
        while True:
            self.check_children()
            try:
                workers = live_workers(r.hgetall(HEARTBEATS))
                if workers and httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return next(iter(workers.values()))
            except (redis.RedisError, httpx.TransportError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stack was not ready within {timeout:.0f} s{self._log_hint()}")
            time.sleep(0.2)

    def check_children(self) -> None:
        for c in self.children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"the {c.name} exited with code {c.proc.returncode}{self._log_hint()}")

    def _log_hint(self) -> str:
        return f" (logs in {self.log_dir})" if self.log_dir else ""

    def worker_stats(self) -> dict:
        r = redis.Redis.from_url(self.url, socket_timeout=5)
        workers = live_workers(r.hgetall(HEARTBEATS))
        return next(iter(workers.values()), {})

    def stop(self) -> None:
        order = sorted(self.children, key=lambda c: c.name == "worker")  # front doors first, then the worker
        for c in order:
            if c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGTERM)
            grace = self.settings.shutdown_grace_s + 15 if c.name == "worker" else 15
            try:
                c.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(5)
            if c.log:
                c.log.close()
        self.children.clear()
        if self.redis_server is not None:
            self.redis_server.stop()
            self.redis_server = None

    def serve(self) -> int:
        """Until Ctrl-C (0) or a child dies (1)."""
        try:
            self.wait_ready()
            print(f"weightq: ready. HTTP {self.base} (OpenAI: {self.base}/v1, TGI: {self.base}/generate)", flush=True)
            if self.flower_port is not None:
                print(f"weightq: Flower at http://{self.host}:{self.flower_port}", flush=True)
            print("weightq: Ctrl-C stops everything", flush=True)
            while True:
                self.check_children()
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("\nweightq: stopping", flush=True)
            return 0
        except (RuntimeError, TimeoutError) as e:
            print(f"weightq: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            self.stop()


def stream_chat(base: str, prompt: str, max_tokens: int, headers: dict | None = None) -> dict:
    """Stream one chat completion through the gateway to this terminal; returns the usage."""
    import httpx

    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict = {}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"the gateway answered {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                print(choice["delta"].get("content", ""), end="", flush=True)
            usage = chunk.get("usage") or usage
    print(flush=True)
    return usage
