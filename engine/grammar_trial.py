"""A grammar's first compile, in a helper process that is killed past a deadline or a memory limit.

xgrammar's compile time is no simple function of a schema's size: 3,000 optional properties in 90 KB
took 255 s on 2 cores, and a compile cannot be interrupted in the process that runs it. So a spec the
engine has not compiled before is compiled here first, in a child process under RLIMIT_AS; a compile
past `timeout_s` kills the child (a fresh one starts for the next spec) and the request is refused,
and so is one that runs out of memory. A spec that passes compiles again in the engine, where it is
known to take about as long (the engine caches it; the trial keeps nothing). The child is started
with spawn on the first spec and exits when its parent's end of the pipe closes.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # importing xgrammar (and with it torch) in the child: seconds on a busy machine


class GrammarTrial:
    """`check(kind, spec)`: None when the grammar compiles within the limits, else why not."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float, memory_mb: int) -> None:
        self.info_json, self.timeout_s, self.memory_mb = tokenizer_info_json, timeout_s, memory_mb
        self._lock = threading.Lock()  # one trial at a time, on one child
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def check(self, kind: str, spec: str) -> str | None:
        with self._lock:
            conn = self._ready()
            t0 = time.monotonic()
            conn.send((kind, spec))
            if not conn.poll(self.timeout_s):
                self._kill()
                log.warning("a %s took over %.0f s to compile: refused", kind, self.timeout_s)
                return f"the {_name(kind)} takes more than {self.timeout_s:g} s to compile: simplify it"
            try:
                problem = conn.recv()
            except (EOFError, OSError):
                self._kill()
                return f"compiling the {_name(kind)} takes more than {self.memory_mb} MiB of memory: simplify it"
            log.debug("grammar trial: %s in %.3f s", kind, time.monotonic() - t0)
            return problem

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _ready(self) -> Connection:
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            return self._conn
        self._kill()
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(
            target=_child, args=(theirs, self.info_json, self.memory_mb), name="weightq-grammar-trial", daemon=True
        )
        proc.start()
        theirs.close()
        if not ours.poll(START_TIMEOUT_S) or ours.recv() != "ready":
            proc.kill()
            raise RuntimeError("the grammar trial process did not start")
        self._proc, self._conn = proc, ours
        return ours

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None


def _name(kind: str) -> str:
    return kind.replace("_", " ")


def _child(conn: Connection, info_json: str, memory_mb: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends it
    from .grammar import _xgr, compile_spec  # xgrammar imports torch: after the spawn, in the child

    xgr = _xgr()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1, cache_enabled=False)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()  # what the imports mapped already
    limit = mapped + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    conn.send("ready")
    while True:
        try:
            kind, spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            compile_spec(compiler, kind, spec)
            conn.send(None)
        except MemoryError:
            return  # the parent reads the closed pipe as "too much memory"
        except Exception as e:  # the message the engine's own compile would give
            conn.send(str(e))
