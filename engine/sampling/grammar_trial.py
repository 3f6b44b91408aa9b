"""A grammar's first compile, in a helper process that is killed past a deadline or a memory limit.

xgrammar's compile time is no simple function of a schema's size: a few thousand optional properties,
small as text, can take minutes, and a compile cannot be interrupted in the process that runs it. So a
spec the engine has not compiled before is compiled here first, in a child process under RLIMIT_AS; a
compile past `timeout_s` kills the child (a fresh one starts for the next spec) and the request is
refused, and so is one that runs out of memory. A spec that passes compiles again in the engine, where it is
known to take about as long (the engine caches it; the trial keeps nothing).

The child is `python -m weightq.engine.sampling.grammar_trial`, a plain subprocess (the engine's own process is
a daemonic multiprocessing child, which may not have children of its own), talking JSON lines over
its stdin and stdout; it exits when its stdin closes, so it never outlives the engine.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # importing xgrammar (and with it torch) in the child: seconds on a busy machine


class GrammarTrial:
    """`check(kind, spec)`: None when the grammar compiles within the limits, else why not."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float, memory_mb: int) -> None:
        self.info_json, self.timeout_s, self.memory_mb = tokenizer_info_json, timeout_s, memory_mb
        self._lock = threading.Lock()  # one trial at a time, on one child
        self._proc: subprocess.Popen | None = None
        self._pending = b""  # what the child wrote past the last line read

    def check(self, kind: str, spec: str) -> str | None:
        with self._lock:
            proc = self._ready()
            t0 = time.monotonic()
            try:
                proc.stdin.write(json.dumps([kind, spec]).encode() + b"\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
                line = self._line(self.timeout_s)
            except OSError:
                line = None
            if line is None:  # past the deadline, or its output ended before: dead (out of memory)
                died = time.monotonic() - t0 < self.timeout_s
                self._kill()
                log.warning("a %s %s its compile: refused", kind, "died in" if died else "timed out in")
                if died:
                    return f"compiling the {_name(kind)} takes more than {self.memory_mb} MiB of memory: simplify it"
                return f"the {_name(kind)} takes more than {self.timeout_s:g} s to compile: simplify it"
            log.debug("grammar trial: %s in %.3f s", kind, time.monotonic() - t0)
            return json.loads(line)

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _ready(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._kill()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "weightq.engine.sampling.grammar_trial", str(self.memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self._proc.stdin.write(self.info_json.encode() + b"\n")  # type: ignore[union-attr]
        if self._line(START_TIMEOUT_S) != "ready":
            self._kill()
            raise RuntimeError("the grammar trial process did not start")
        return self._proc

    def _line(self, timeout: float) -> str | None:
        """The child's next line, or None past `timeout` or at its end."""
        assert self._proc is not None and self._proc.stdout is not None
        fd, deadline = self._proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(10)
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc, self._pending = None, b""


def _name(kind: str) -> str:
    return kind.replace("_", " ")


def _child(memory_mb: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its parent ends it
    out = os.fdopen(os.dup(1), "wb", 0)
    os.dup2(2, 1)  # whatever xgrammar prints goes to stderr, not into the replies
    from weightq.engine.sampling.grammar_spec import GrammarError, compile_spec, xgrammar

    xgr = xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.buffer.readline().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()  # what the imports mapped already
    resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_mb * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    out.write(b"ready\n")
    for line in sys.stdin.buffer:
        kind, spec = json.loads(line)
        try:
            compile_spec(compiler, kind, spec)
            problem = None
        except MemoryError:
            return  # the parent reads the end of its output as "too much memory"
        except GrammarError as e:  # the message the engine's own compile would give
            if "bad_alloc" in str(e):
                return  # xgrammar's C++ out of memory, as MemoryError
            problem = str(e)
        out.write(json.dumps(problem).encode() + b"\n")


if __name__ == "__main__":
    _child(int(sys.argv[1]))
