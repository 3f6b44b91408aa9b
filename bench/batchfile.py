"""A 100,000-line batch file as a data scientist runs it: `weightq batch` in a process of its own against a
worker on the simulated device (so the batch tool and the queue, not the model, are what is measured).

    python -m bench.batchfile --json        # [--lines 100000] [--kill-at 0.4]

- whole: lines/s of one uninterrupted run, and the batch process's peak resident memory (RSS, sampled
  every 0.2 s);
- resumed: the same file into another output, the batch process SIGKILLed once `--kill-at` of the lines
  are written, then the same command again: seconds from the rerun's start to its first new output line
  (reading the output and the input back), its total time, every line's id exactly once at the end, and
  the jobs both runs submitted (the killed run's jobs in flight are collected, not run again: one per line).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis
from weightq.cli.processes import ROOT, WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.tasks.contract import job_key

WORKER = {
    "runner": "simulated", "sim_step_cost": "0.005,0,0", "max_batch_weight": 65536, "max_total_tokens": 256,
    "concurrency": 256, "prefix_cache": 0,
}  # fmt: skip


def write_lines(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            line = {"id": f"r{i}", "prompt": f"row {i}: classify this text", "max_new_tokens": 8, "meta": {"row": i}}
            f.write(json.dumps(line) + "\n")


def batch_jobs(url: str) -> int:
    """Jobs batch runs submitted: each has a record in Redis (kept RESULT_TTL_S)."""
    return sum(1 for _ in redis.Redis.from_url(url).scan_iter(job_key("batch-*"), count=10_000))


def count(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


class BatchProcess:
    def __init__(self, url: str, home: Path, src: Path, out: Path) -> None:
        env = dict(os.environ, REDIS_URL=url, WEIGHTQ_HOME=str(home))
        cmd = [sys.executable, "-m", "weightq.cli", "batch", str(src), "-o", str(out), "--json", "--no-progress"]
        self.log = open(home / f"{out.stem}.log", "a")  # noqa: SIM115
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)
        self.rss_peak = 0

    def sample(self) -> None:
        try:
            rss = self.ps.memory_info().rss
        except psutil.Error:
            return
        self.rss_peak = max(self.rss_peak, rss)

    def wait(self, until=lambda: False) -> float:
        while self.proc.poll() is None and not until():
            self.sample()
            time.sleep(0.2)
        return time.monotonic() - self.t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--kill-at", type=float, default=0.4)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="weightq-batchfile-"))
    server = EmbeddedRedis(home / "redis")
    url = server.start()
    worker = WorkerProcess(url, "batchfile@bench", home, **WORKER)
    src = home / "in.jsonl"
    write_lines(src, args.lines)
    try:
        worker.wait_ready()
        whole = BatchProcess(url, home, src, home / "whole.jsonl")
        took = whole.wait()
        assert whole.proc.returncode == 0, (home / "whole.log").read_text()[-2000:]
        out = home / "resumed.jsonl"
        jobs_before = batch_jobs(url)
        first = BatchProcess(url, home, src, out)
        first.wait(lambda: count(out) >= args.kill_at * args.lines)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
        before = count(out)
        rerun = BatchProcess(url, home, src, out)
        to_first = rerun.wait(lambda: count(out) > before)
        total = rerun.wait()
        ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
        result = {
            "bench": "batchfile",
            "lines": args.lines,
            "whole": {
                "seconds": round(took, 1),
                "lines_s": round(args.lines / took, 1),
                "rss_peak_mb": round(whole.rss_peak / 2**20, 1),
            },
            "resumed": {
                "killed_after_lines": before,
                "rerun_to_first_new_line_s": round(to_first, 2),
                "rerun_seconds": round(total, 1),
                "rerun_rss_peak_mb": round(rerun.rss_peak / 2**20, 1),
                "each_id_once": len(ids) == len(set(ids)) == args.lines,
                "jobs_submitted": batch_jobs(url) - jobs_before,  # == lines: none generated twice
            },
        }
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    finally:
        worker.kill()
        server.stop()


if __name__ == "__main__":
    main()
