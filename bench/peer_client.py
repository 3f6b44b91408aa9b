"""The vLLM side of bench.peer, seen from our venv: where the peer venv's python is, whether it has
vLLM, which CPUs its OpenMP threads bind to, and the long-lived bench/peer_vllm.py child it talks to
in JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PEER_ENV = "WEIGHTQ_PEER_PYTHON"
DEFAULT_PEER = REPO / ".venv-peer" / "bin" / "python"
PEER_SCRIPT = Path(__file__).resolve().with_name("peer_vllm.py")


def peer_python(option: str | None) -> Path:
    """The peer venv's python: --peer-python, else $WEIGHTQ_PEER_PYTHON, else .venv-peer/bin/python."""
    return Path(option or os.environ.get(PEER_ENV) or DEFAULT_PEER).absolute()  # not resolve(): keep the venv


def peer_problem(python: Path) -> str | None:
    """Why `python` cannot be the peer (checked in a blink, before minutes of start-up), or None."""
    if not (python.is_file() and os.access(python, os.X_OK)):
        return f"no peer python at {python}"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if subprocess.run([str(python), "-c", probe], cwd=tempfile.gettempdir(), capture_output=True).returncode:
        return f"{python} has no vllm"
    return None


def omp_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` OpenMP threads on the CPUs this process may use. vLLM's own
    "auto" keeps one core per worker for its scheduler process: 1 thread on 2 cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads > len(cpus):
        raise ValueError(f"--threads {threads} > {len(cpus)} usable CPUs")
    return ",".join(map(str, cpus[:threads]))


class PeerError(RuntimeError):
    pass


class VllmPeer:
    """One long-lived bench/peer_vllm.py process: started (and compiled) once per case, then asked for rounds."""

    def __init__(self, python: Path, start: dict[str, Any], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("a") as f:
            f.write(f"\n===== vLLM peer: {start['max_num_seqs']} requests, {start['kv_tokens']} KV tokens =====\n")
        self._log_file = log.open("a")
        self.proc = subprocess.Popen(
            [str(python), str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),  # so that nothing of this repo shadows vllm's imports
        )
        self.hello = self._ask(start)

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: readline() says so below
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"ok": False, "error": f"exited with status {self.proc.wait()}"}
        if not reply.get("ok"):
            raise PeerError(f"vLLM peer failed: {reply.get('error')}\n--- tail of {self.log} ---\n{self._tail()}")
        return reply

    def _tail(self, lines: int = 30) -> str:
        self._log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def run(
        self, work: list[tuple[list[int], int]], token_ids: bool = False, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Generate greedily (EOS ignored unless `params` say otherwise; `params` are extra SamplingParams)."""
        return self._ask({"cmd": "run", "work": work, "token_ids": token_ids, "params": params or {}})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.terminate()
                self.proc.wait(timeout=30)
        self._log_file.close()
