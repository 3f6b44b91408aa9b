"""What a job costs the serving path apart from its tokens: CPU per job of short jobs.

    python -m bench.jobcost --json

One `weightq worker` on the simulated device (RUNNER=simulated, the engine in its own process as
`auto` places it) and one Redis. Each round submits --jobs jobs of --tokens new tokens in one batch
through the Client, and one reader process follows every stream as the gateway's hub does; the
round ends when the reader has seen every end entry. Per job, medians over rounds:
- worker_main_cpu_ms_per_job: the worker's main process (Celery's consumer, the task threads, the
  intake, the stream writer: everything a job costs apart from the model);
- worker_engine_cpu_ms_per_job: its engine process (the simulated device's bookkeeping only);
- redis_cpu_ms_per_job: the server's INFO cpu delta (deliveries, acks, results, streams, scripts).
With one token a job these are the per-job costs bench.serve's per-token figures carry at
tokens/job: a 64-token job at 2 ms per job is 31 ms per 1,000 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import redis
from weightq.cli.processes import WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client
from weightq.settings import Settings

from .cputime import snapshot
from .pipeline import start_follower
from .tokenplane import redis_cpu_s


def run_round(server: EmbeddedRedis, worker: WorkerProcess, client: Client, n: int, tokens: int, tag: str) -> dict:
    ids = [f"{tag}-{i}" for i in range(n)]
    reader, results = start_follower(server.url, ids)
    requests = [
        {"prompt": f"job cost {i % 7}", "max_new_tokens": tokens, "ignore_eos": True, "request_id": job_id}
        for i, job_id in enumerate(ids)
    ]
    r = redis.Redis.from_url(server.url)
    commands0 = r.info("commandstats")
    procs0, redis0, t0 = snapshot({"worker": worker.proc.pid}), redis_cpu_s(r), time.perf_counter()
    client.submit_many(requests)
    if not results.poll(600):
        raise RuntimeError("the reader did not see every job end within 600 s")
    latencies, _ = results.recv()
    wall = time.perf_counter() - t0
    procs1, redis1 = snapshot({"worker": worker.proc.pid}), redis_cpu_s(r)
    commands1 = r.info("commandstats")
    reader.join(10)
    main = engine = 0.0
    for key, (label, t1) in procs1.items():
        if key in procs0:
            if label == "worker":
                main += t1 - procs0[key][1]
            else:
                engine += t1 - procs0[key][1]
    return {
        "jobs_s": n / wall,
        "tokens": len(latencies),
        "worker_main_cpu_ms_per_job": 1000 * main / n,
        "worker_engine_cpu_ms_per_job": 1000 * engine / n,
        "redis_cpu_ms_per_job": 1000 * (redis1 - redis0) / n,
        # a command run inside a script counts again under its own name: shares, not a sum
        "redis_command_us_per_job": {
            k.removeprefix("cmdstat_"): (v["usec"] - commands0.get(k, {"usec": 0})["usec"]) / n
            for k, v in commands1.items()
            if k != "cmdstat_info"
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="CPU per job of short jobs, by process")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--jobs", type=int, default=1000, help="jobs per round")
    ap.add_argument("--tokens", type=int, default=1, help="new tokens per job")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="weightq-jobcost-"))
    server = EmbeddedRedis(home / "redis")
    server.start()
    worker = None
    try:
        worker = WorkerProcess(
            server.url,
            "jobcost@bench",
            home,
            runner="simulated",
            max_batch_weight=65536,
            concurrency=128,
            task_events=0,
        ).wait_ready()
        client = Client(server.url, settings=Settings(redis_url=server.url))
        run_round(server, worker, client, 64, 4, "warm")  # imports, tokenizer, scripts loaded
        rounds = [run_round(server, worker, client, args.jobs, args.tokens, f"r{k}") for k in range(args.rounds)]
        keys = [k for k in rounds[0] if k not in ("tokens", "redis_command_us_per_job")]
        commands = {k for r in rounds for k in r["redis_command_us_per_job"]}
        per_command = {
            k: statistics.median(r["redis_command_us_per_job"].get(k, 0.0) for r in rounds) for k in commands
        }
        out = {
            "bench": "jobcost",
            "runner": "simulated",
            "jobs_per_round": args.jobs,
            "tokens_per_job": args.tokens,
            "rounds": args.rounds,
            **{k: round(statistics.median(r[k] for r in rounds), 3) for k in keys},
            "redis_command_us_per_job": {
                k: round(v, 1) for k, v in sorted(per_command.items(), key=lambda kv: -kv[1]) if v >= 0.5
            },
            "each_round": [{k: round(r[k], 3) for k in keys} for r in rounds],
        }
        print(json.dumps(out, indent=None if args.json else 2))
    finally:
        if worker is not None:
            worker.kill()
        server.stop()


if __name__ == "__main__":
    main()
