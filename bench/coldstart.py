"""A new worker's cold start: seconds from spawning `weightq worker` to its first job's first token.

    python -m bench.coldstart --json [--warm 3] [--compile on off]

A real Redis (the embedded one) holds one job, submitted with the Client before the worker exists, as
a KEDA scale-from-zero would; the worker (builtin:tiny, default settings) is spawned and the job's
stream read until its first token and its end. Per COMPILE setting, the first start runs with an
empty WEIGHTQ_HOME and an empty temp dir (torch's default caches live there: nothing is reused from
other runs), then `--warm` starts reuse that WEIGHTQ_HOME (medians reported). Where the time goes is
read from the worker's log: each line's timestamp against the spawn (`phases`, seconds after it).
`cpu_s` is the CPU time of the worker and its engine process from spawn to stop: on a machine shared
with other work it moves far less than the wall-clock figures do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client
from weightq.settings import Settings
from weightq.tasks.entries import EntryType

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
NEW_TOKENS = 16

# log lines that mark a phase (the first line matching each, its time after the spawn)
PHASES = {
    "engine_step_start": r"weightq worker: starting the engine",
    "model_loaded": r"KV cache: ",
    "warmed_up": r"compiled and warmed up in",
    "engine_ready": r"weightq engine ready on",
    "celery_ready": r"celery@\S+ ready\.",
}
# Celery's and the engine process' line format: "[2026-12-07 23:41:11,123: INFO/MainProcess] ..."
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):")


def phases(log_text: str, spawned_wall: float) -> dict[str, float]:
    """Seconds after the spawn at which each phase's first log line was written."""
    found: dict[str, float] = {}
    for line in log_text.splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - spawned_wall
        for name, pattern in PHASES.items():
            if name not in found and re.search(pattern, line):
                found[name] = round(at, 2)
    return found


def one_start(url: str, home: Path, tmp: Path, logs: Path, compile_: str, name: str) -> dict:
    """Submit one job, spawn a worker, time its first token and its end; stop the worker."""
    client = Client(url, settings=Settings(redis_url=url))
    job = client.submit(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    seen: dict[str, float] = {}

    def read() -> None:
        for ev in job.events(timeout=600):
            if ev.type == EntryType.TOKEN and "first_token" not in seen:
                seen["first_token"] = time.monotonic()
        seen["done"] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    log_path = logs / f"{name}.log"
    env = dict(
        os.environ,
        REDIS_URL=url,
        WEIGHTQ_HOME=str(home),
        TMPDIR=str(tmp),
        COMPILE=compile_,
        MODEL="builtin:tiny",
        PYTHONUNBUFFERED="1",
    )
    with open(log_path, "w") as log:
        spawned_wall, spawned = time.time(), time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightq.cli", "worker", "-n", f"{name}@bench", "-l", "INFO"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        reader.join(600)
        if "done" not in seen:
            raise RuntimeError(f"{name}: the job did not finish:\n{log_path.read_text()[-3000:]}")
    finally:
        cpu_s = stop(proc)
    text = log_path.read_text(errors="replace")
    return {
        "first_token_s": round(seen["first_token"] - spawned, 2),
        "done_s": round(seen["done"] - spawned, 2),
        "cpu_s": round(cpu_s, 2),
        "phases": phases(text, spawned_wall),
    }


def stop(proc: subprocess.Popen, grace_s: float = 60.0) -> float:
    """Warm shutdown (killed past `grace_s`); the CPU seconds the worker and its engine process used,
    a figure that a busy machine's other work does not inflate as it does wall-clock time."""
    proc.terminate()
    deadline = time.monotonic() + grace_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            proc.kill()
            deadline = float("inf")
        time.sleep(0.1)


def median_of(rounds: list[dict]) -> dict:
    """Each number's median over the rounds (phases too, over the rounds that logged them)."""
    out: dict = {k: round(statistics.median(r[k] for r in rounds), 2) for k in ("first_token_s", "done_s", "cpu_s")}
    names = {p for r in rounds for p in r["phases"]}
    out["phases"] = {
        p: round(statistics.median(r["phases"][p] for r in rounds if p in r["phases"]), 2)
        for p in sorted(names, key=lambda p: list(PHASES).index(p))
    }
    return out


def run(compile_settings: list[str], warm: int, keep_logs: Path | None = None) -> dict:
    results: dict = {"model": "builtin:tiny", "new_tokens": NEW_TOKENS, "warm_starts": warm, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="weightq-coldstart-") as root:
        server = EmbeddedRedis(Path(root) / "redis", appendfsync="no")
        url = server.start()
        logs = keep_logs or Path(root) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for setting in compile_settings:
                home, tmp = Path(root) / f"home-{setting}", Path(root) / f"tmp-{setting}"
                tmp.mkdir(parents=True)
                first = one_start(url, home, tmp, logs, setting, f"cold-{setting}")
                warm_rounds = [one_start(url, home, tmp, logs, setting, f"warm-{setting}-{i}") for i in range(warm)]
                results[f"compile_{setting}"] = {
                    "first_start": first,
                    "warm_median": median_of(warm_rounds) if warm_rounds else None,
                    "warm_rounds": [r["first_token_s"] for r in warm_rounds],
                    "warm_cpu_s": [r["cpu_s"] for r in warm_rounds],
                }
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            server.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warm", type=int, default=3, help="warm starts after the first (medians)")
    p.add_argument("--compile", nargs="+", default=["on", "off"], choices=["on", "off", "auto"])
    p.add_argument("--logs", type=Path, default=None, help="keep the workers' logs in this directory")
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args()
    results = run(args.compile, args.warm, args.logs)
    print(json.dumps(results, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
