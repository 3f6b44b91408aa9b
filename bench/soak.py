"""Soak: 2,000 jobs through the whole stack with cancellations and a worker SIGKILL in the middle.

    python -m bench.soak --json

A real Redis, the HTTP gateway and a `weightq worker` on the built-in tiny model. Half the jobs go
through Celery (weightq.client), half through the gateway (OpenAI completions, streaming or not);
about one in ten is cancelled (client cancel, or an HTTP client hanging up mid-stream). When 40%
have finished the worker is SIGKILLed and a fresh one started. At the end every job's fate is read
from Redis: completed, cancelled, failed (errors), lost (never finished), duplicated (more than one
end entry in its stream). Worker memory is the survivor's RSS after its first 200 jobs and at the
end; Redis keys left without an expiry must all be the documented singletons (and the fair-order state of
the queues still served).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client
from weightq.settings import Settings
from weightq.tasks.contract import (
    CANCEL_CHANNEL,
    DEAD,
    HEARTBEATS,
    LEASES,
    LORA_ADAPTERS,
    LORA_ERRORS,
    QUEUED,
    RECOVER_LOCK,
    RESUMING,
    STARTED_HW,
    STREAM_TICK,
    WORKER_QUEUES,
    fair_key,
    is_end,
    job_key,
    stream_key,
)
from weightq.transport import priority_queues

# The contract's keys that live without an expiry (one each, not one per job)
CONTRACT_KEYS = (
    CANCEL_CHANNEL, QUEUED, STARTED_HW, DEAD, HEARTBEATS, RECOVER_LOCK, STREAM_TICK, LEASES, RESUMING, WORKER_QUEUES,
    LORA_ADAPTERS, LORA_ERRORS,
)  # fmt: skip
SINGLETONS = {*CONTRACT_KEYS, "weightq", "unacked", "unacked_index"}  # kombu's own, and the queue
WORKER = {
    "max_batch_weight": 16384,
    "concurrency": 256,
    "visibility_timeout_s": 10,
    "restore_interval_s": 2,
    "lease_renew_s": 2,
    "lost_job_grace_s": 15,
    "recover_interval_s": 5,
}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


class Soak:
    def __init__(self, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.n = n
        self.home = Path(tempfile.mkdtemp(prefix="weightq-soak-"))
        self.server = EmbeddedRedis(self.home / "redis")
        self.url = self.server.start()
        self.r = redis.Redis.from_url(self.url, decode_responses=True)
        self.client = Client(self.url, settings=Settings(redis_url=self.url))
        self.gateway = GatewayProcess(self.url, self.home)
        self.workers = [WorkerProcess(self.url, "soak1@bench", self.home, **WORKER)]
        self.ids: list[str] = []
        self.lock = threading.Lock()
        self.http_errors: list[str] = []

    def job_spec(self) -> dict:
        return {
            "prompt": " ".join(self.rng.choice(["weight", "batch", "token", "stream", "cache"]) for _ in range(
                self.rng.randint(2, 60))),
            "max_new_tokens": self.rng.choice([4, 16, 32, 64, 96]),
            "ignore_eos": True,
        }  # fmt: skip

    def celery_job(self, i: int, cancel: bool) -> None:
        job = self.client.submit(request_id=f"soak-c{i}", **self.job_spec())
        with self.lock:
            self.ids.append(job.id)
        if cancel:
            time.sleep(self.rng.random() * 0.5)
            job.cancel()

    def http_job(self, i: int, cancel: bool, http: httpx.Client) -> None:
        spec = self.job_spec()
        body = {"prompt": spec["prompt"], "max_tokens": spec["max_new_tokens"], "ignore_eos": True, "stream": cancel
                or i % 2 == 0}  # fmt: skip
        try:
            if not body["stream"]:
                r = http.post("/v1/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code} {r.text[:200]}")
                with self.lock:
                    self.ids.append(r.json()["id"].removeprefix("cmpl-"))
                return
            with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RuntimeError(f"{r.status_code} {r.text[:200]}")
                seen = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        if seen == 0:
                            with self.lock:
                                self.ids.append(json.loads(line[6:])["id"].removeprefix("cmpl-"))
                        seen += 1
                        if cancel and seen >= 2:
                            return  # hang up mid-stream: the gateway cancels the job
        except Exception as e:  # counted: the soak reports, it does not stop
            with self.lock:
                self.http_errors.append(repr(e)[:200])

    def finished(self) -> int:
        with self.lock:
            ids = list(self.ids)
        pipe = self.r.pipeline(transaction=False)
        for j in ids:
            pipe.hget(job_key(j), "state")
        return sum(1 for s in pipe.execute() if s in ("done", "cancelled"))

    def run(self) -> dict:
        w = self.workers[0]
        w.wait_ready()
        self.gateway.wait_ready()
        for i in range(50):  # warm-up, not counted
            self.client.submit(request_id=f"warm{i}", **self.job_spec())
        while sum(self.r.llen(q) for q in priority_queues("weightq")) or self.finished_warm() < 50:
            time.sleep(0.2)
        t0 = time.monotonic()
        with httpx.Client(base_url=self.gateway.base, timeout=300) as http, ThreadPoolExecutor(48) as pool:
            futures = []
            for i in range(self.n):
                cancel = self.rng.random() < 0.1
                if i % 2:
                    futures.append(pool.submit(self.http_job, i, cancel, http))
                else:
                    futures.append(pool.submit(self.celery_job, i, cancel))
            while self.finished() < 0.4 * self.n:
                time.sleep(0.1)
            rss_killed = rss_mb(w.proc.pid)
            w.kill()  # SIGKILL mid-run
            survivor = WorkerProcess(self.url, "soak2@bench", self.home, **WORKER)
            self.workers.append(survivor)
            survivor.wait_ready()
            rss_start = None
            deadline = time.monotonic() + 600  # what is not finished by then counts as lost
            while any(not f.done() for f in futures) or self.finished() < len(self.ids):
                if rss_start is None and survivor.stats().get("finished", 0) >= 200:
                    rss_start = rss_mb(survivor.proc.pid)
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        elapsed = time.monotonic() - t0
        time.sleep(1.5)
        stats = survivor.stats()
        rss_end = rss_mb(survivor.proc.pid)
        report = self.fates() | {
            "http_errors": len(self.http_errors),
            "worker_rss_mb_killed": rss_killed,
            "worker_rss_mb_start": rss_start,
            "worker_rss_mb_end": rss_end,
            "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 1) if rss_start else None,
            "kv_overflow_steps": stats.get("overflow_steps"),
            "kv_blocks_used_end": stats.get("kv_blocks_used"),
            "elapsed_s": round(elapsed, 1),
        }
        report |= self.keys_report()
        return report

    def finished_warm(self) -> int:
        return sum(1 for i in range(50) if self.r.hget(job_key(f"warm{i}"), "state") == "done")

    def fates(self) -> dict:
        with self.lock:
            ids = list(self.ids)
        out = {"jobs": self.n, "tracked": len(ids), "completed": 0, "cancelled": 0, "errors": 0, "lost": 0,
               "duplicated": 0}  # fmt: skip
        for j in ids:
            h = self.r.hgetall(job_key(j))
            ends = [f for _, f in self.r.xrange(stream_key(j)) if is_end(f)]
            if len(ends) > 1:
                out["duplicated"] += 1
            if h.get("state") == "cancelled" or (h.get("result") and '"finish_reason": "cancelled"' in h["result"]):
                out["cancelled"] += 1
            elif h.get("state") == "done" and h.get("result"):
                out["completed"] += 1
            elif h.get("state") == "done":
                out["errors"] += 1
            else:
                out["lost"] += 1
        out["lost"] += self.n - len(ids)  # jobs whose submission never got an id back (HTTP errors)
        return out

    def keys_report(self) -> dict:
        keys = list(self.r.scan_iter(count=1000))
        no_expiry = [k for k in keys if self.r.ttl(k) == -1]
        queues = {"weightq", *self.r.hkeys(WORKER_QUEUES)}  # the shared queue and the registered own ones
        expected = SINGLETONS | {fair_key(q) for q in queues}  # their fair-order state (a forgotten one's goes)
        unexpected = sorted(k for k in no_expiry if k not in expected and not k.startswith("_kombu."))
        return {"redis_keys_end": len(keys), "redis_keys_without_expiry_unexpected": unexpected[:10]}

    def close(self) -> None:
        self.gateway.stop()
        for w in self.workers:
            try:
                w.stop()
            finally:
                w.kill()
        self.server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description="weightq soak: jobs, cancels and a worker SIGKILL through the stack")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    soak = Soak(args.jobs, args.seed)
    try:
        report = soak.run()
    finally:
        soak.close()
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
