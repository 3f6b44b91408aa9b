"""The whole stack on one machine: `weightq up` (serve until Ctrl-C) and `weightq demo` (show it, exit).

The children (Redis, worker, gateway, Flower) run in their own sessions, so Ctrl-C reaches only this
supervisor, which stops them in order: gateway and Flower, then the worker (warm shutdown: running
generations finish or go back to the queue), then it lets go of the embedded Redis, which stops unless
another weightq command still holds it (`EmbeddedHold`).
"""

from __future__ import annotations

import argparse
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
from weightq.metrics import read_live_workers
from weightq.redis_conn import RedisUnreachable, check_reachable, connect_streams, redacted
from weightq.settings import Settings

from .redis_server import EmbeddedHold
from .supervise import dies_with_parent, refuse_taken_ports, signals_ignored, stop_on_signals


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
    redis_hold: EmbeddedHold | None = None  # None: REDIS_URL's Redis
    url: str = ""

    def start(self) -> None:
        s = self.settings
        if s.redis.url:
            try:
                check_reachable(s.redis.url, s.redis)
            except RedisUnreachable as e:
                raise RuntimeError(str(e)) from None
            self.url = s.redis.url
        else:
            self.redis_hold = EmbeddedHold(s.redis)
            self.url = self.redis_hold.acquire()
            print(f"weightq: embedded Redis at {redacted(self.url)} (data in {s.redis.home / 'redis'})", flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.redis_hold:  # each child holds the embedded Redis too: should this process be killed, the last
            env.pop("REDIS_URL", None)  # child out (dies_with_parent) still stops it
            env["WEIGHTQ_HOME"] = str(s.redis.home)
        else:
            env["REDIS_URL"] = self.url
        py = [sys.executable, "-m"]
        self._spawn("worker", [*py, "weightq.cli", "worker", "-n", self.worker_name, "-l", "INFO"], env)
        gw = [*py, "weightq.cli", "gateway", "--host", self.host, "--port", str(self.port), "--log-level", "warning"]
        self._spawn("gateway", gw, env)
        if self.flower_port is not None:
            self._spawn("flower", self.flower_command(), env)

    @property
    def flower_address(self) -> str:
        """Flower revokes jobs, shuts workers down and sends tasks past the gateway's keys and limits:
        without FLOWER_BASIC_AUTH it listens on 127.0.0.1 only (and its API stays off unless
        FLOWER_UNAUTHENTICATED_API is set: Flower's own switch)."""
        return self.host if os.environ.get("FLOWER_BASIC_AUTH") else "127.0.0.1"

    def flower_command(self) -> list[str]:
        auth = os.environ.get("FLOWER_BASIC_AUTH")
        flower = [sys.executable, "-m", "celery", "-A", "weightq", "flower", f"--port={self.flower_port}"]
        return [*flower, f"--address={self.flower_address}", *([f"--basic-auth={auth}"] if auth else [])]

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        log = open(self.log_dir / f"{name}.log", "w") if self.log_dir else None  # noqa: SIM115 (closed in stop)
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log or None,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
            preexec_fn=dies_with_parent(),  # one prctl call between fork and exec
            cwd=Path(__file__).resolve().parents[2],
        )
        self.children.append(Child(name, proc, log))

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = 300) -> dict:
        """Until a worker's heartbeat is in Redis and the gateway answers; returns the worker's stats."""
        import httpx

        r = connect_streams(self.settings.redis, self.url, socket_timeout=5)  # the heartbeats
        deadline = time.monotonic() + timeout
        while True:
            self.check_children()
            try:
                workers = read_live_workers(r)
                if workers and httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return dict(next(iter(workers.values())).stats)
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
        r = connect_streams(self.settings.redis, self.url, socket_timeout=5)  # the heartbeats
        beat = next(iter(read_live_workers(r).values()), None)
        return dict(beat.stats) if beat else {}

    def stop(self) -> None:
        order = sorted(self.children, key=lambda c: c.name == "worker")  # front doors first, then the worker
        for c in order:
            if c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGTERM)
            grace = self.settings.worker.shutdown_grace_s + 15 if c.name == "worker" else 15
            try:
                c.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait(5)
            if c.log:
                c.log.close()
        self.children.clear()
        if self.redis_hold is not None:
            self.redis_hold.release()
            self.redis_hold = None

    def serve(self) -> int:
        """Start, then run until Ctrl-C, SIGTERM or SIGHUP (0) or a child dies (1); everything stops."""
        try:
            with stop_on_signals():
                return self._serve()
        finally:
            with signals_ignored():  # a second signal must not cut the shutdown short and leak children
                self.stop()

    def _serve(self) -> int:
        try:
            self.start()
            self.wait_ready()
            print(f"weightq: ready. HTTP {self.base} (OpenAI: {self.base}/v1, TGI: {self.base}/generate)", flush=True)
            if self.flower_port is not None:
                print(f"weightq: Flower at http://{self.flower_address}:{self.flower_port}", flush=True)
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


# ----- the `weightq up` and `weightq demo` commands ----------------------------------------------------
def stack_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="run the whole stack here: embedded Redis (unless REDIS_URL), a worker, the gateway (and Flower)",
        description="Embedded Redis unless REDIS_URL is set, one worker, the HTTP gateway on GATEWAY_HOST:GATEWAY_PORT "
        "(127.0.0.1:8000), and Flower with --flower. Ctrl-C stops everything cleanly.",
    )
    p.add_argument("--host", default=None, help="gateway bind address (default GATEWAY_HOST)")
    p.add_argument("--port", type=int, default=None, help="gateway port (default GATEWAY_PORT)")
    p.add_argument("--flower", action="store_true", help="also run Flower (FLOWER_BASIC_AUTH=user:pass for auth)")
    p.add_argument("--flower-port", type=int, default=5555)
    p.set_defaults(func=cmd_up)
    d = sub.add_parser(
        "demo",
        help="start the stack on the built-in tiny model, stream a completion, run a batch file, stop",
        description="What `make run` does: the whole stack on MODEL (default builtin:tiny), one streamed chat "
        "completion through the HTTP gateway, examples/prompts.jsonl as a batch job with its progress bar, "
        "the summary and the engine's stats; then a clean shutdown.",
    )
    d.add_argument("--batch", default=None, help="JSONL requests to run (default examples/prompts.jsonl)")
    d.set_defaults(func=cmd_demo)


WORKER_EXTRA = ("torch", "transformers", "tokenizers", "safetensors")  # pyproject.toml's `worker` extra


def require_worker_extra(command: str) -> None:
    """The engine's dependencies are an extra (`weightq[worker]`): a command that runs an engine says
    so, before it starts anything, while `pip install weightq` alone is enough for a web app."""
    import importlib.util

    missing = [name for name in WORKER_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"weightq {command}: the engine needs {', '.join(missing)}, which is not installed: "
            "pip install 'weightq[worker]'"
        )


def require_flower() -> None:
    """Flower is an extra (`weightq[flower]`): name it rather than fail in a child process."""
    import importlib.util

    if importlib.util.find_spec("flower") is None:
        raise SystemExit("weightq up --flower: Flower is not installed; install it with: pip install 'weightq[flower]'")


def cmd_up(args: argparse.Namespace) -> int:
    require_worker_extra("up")
    settings = Settings.from_env().check()  # it starts a worker: every group
    if args.flower:
        require_flower()
    stack = Stack(
        settings,
        host=args.host or settings.gateway.host,
        port=settings.gateway.port if args.port is None else args.port,
        flower_port=args.flower_port if args.flower else None,
    )
    refuse_taken_ports("weightq up", stack.host, {"gateway": stack.port, "Flower": stack.flower_port or 0})
    return stack.serve()


def cmd_demo(args: argparse.Namespace) -> int:
    from weightq.client import Client
    from weightq.client.batch import format_summary, run_batch

    from .redis_server import free_port

    require_worker_extra("demo")
    settings = Settings.from_env().check()  # it starts a worker: every group
    batch = Path(args.batch) if args.batch else Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"
    home = settings.redis.home / "demo"
    (home / "logs").mkdir(parents=True, exist_ok=True)
    stack = Stack(settings, port=free_port(), log_dir=home / "logs", worker_name="demo@%h")
    headers = {"Authorization": f"Bearer {settings.gateway.api_key}"} if settings.gateway.api_key else None
    print(
        f"weightq demo: starting Redis, a worker on {settings.served.model} and the gateway (logs in {home / 'logs'})"
    )
    with stop_on_signals():
        try:
            stack.start()
            stats = stack.wait_ready()
            print(
                f"ready: worker {stats['hostname']} ({stats['model']}, {stats['attention']} attention, "
                f"max_batch_weight {stats['max_batch_weight']} tokens); gateway {stack.base}\n"
            )
            print("== one chat completion, streamed through the gateway's OpenAI API ==")
            usage = stream_chat(stack.base, "Explain how the batcher admits requests.", 64, headers)
            print(f"[{usage.get('prompt_tokens')} prompt + {usage.get('completion_tokens')} completion tokens]\n")
            print(f"== a batch file: {batch} ==")
            out = home / "results.jsonl"
            out.unlink(missing_ok=True)
            summary, interrupted = run_batch(batch, out, Client(stack.url, settings=settings))
            print(format_summary(summary))
            print(f"results: {out}\n")
            time.sleep(1.2)  # the next heartbeat carries the final counters
            s = stack.worker_stats()
            print(
                f"engine: {s.get('steps')} steps, {s.get('prefill_tokens')} prompt + "
                f"{s.get('decode_tokens')} generated tokens, {s.get('finished')} requests finished, forward "
                f"passes {s.get('forward_s')} s of {s.get('step_s')} s stepping; KV blocks in use now "
                f"{s.get('kv_blocks_used')}/{s.get('kv_blocks_total')}"
            )
            if interrupted:
                return 130
            return 0 if summary["failed"] == 0 else 1
        except KeyboardInterrupt:
            return 130
        except (RuntimeError, TimeoutError) as e:
            print(f"weightq demo: {e}", file=sys.stderr)
            return 1
        finally:
            print("weightq demo: stopping", flush=True)
            with signals_ignored():
                stack.stop()
