"""What a worker crash costs streaming clients, measured: jobs resume from their streamed tokens.

    python -m bench.resume --json

A real Redis, the HTTP gateway and two `weightq worker` processes on the built-in tiny model, default
settings. N sampled streaming completions (OpenAI SSE: unseeded at temperature 1, seeded, greedy;
some with logprobs) run through the gateway; once all stream, after a random delay, the worker holding
the most of them is SIGKILLed (its process group) while the other serves on. Per job, from the client's
side and from Redis:

- the streamed text equals the result's text, and the stream holds each token index once;
- the stream pause after the kill: from the kill to the first token written after it, for the killed
  worker's jobs (p50, p99, max);
- tokens decoded twice: token entries of an index some earlier run had already streamed (a restart
  from token 0 would repeat every one); tokens resumed from the stream: prefilled, not decoded again.

With `--baseline` the same round runs first with LEASE_TTL_S=3600 (no lease reaper: kombu's visibility
timeout alone brings the jobs back, as before resuming existed) for the pause to compare against.

The poison round: 16 healthy sampled jobs and one that crashes its worker whenever it runs (the bench
SIGKILLs whichever worker has it inside its engine), three crashes; reported: healthy jobs
dead-lettered (must be 0), whether the poison job was, and the healthy jobs' streams checked as above.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import redis
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client, JobFailed
from weightq.settings import Settings
from weightq.tasks.contract import DEAD, LEASES, EntryType, engine_jobs_key, job_key, stream_key, token_parts

# the tests' streaming client: the bench reads streams as they do (run from the repository root)
from tests.sse_client import openai_text, read_sse

KINDS = [
    {"temperature": 1.0},  # what OpenAI clients send by default
    {"temperature": 1.0, "logprobs": 2},
    {"temperature": 0.8, "top_p": 0.9, "seed": 7},
    {"temperature": 0},
]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else 0.0


def pause_summary(pauses: list[float]) -> dict:
    return {
        "p50": percentile(pauses, 0.5),
        "p99": percentile(pauses, 0.99),
        "max": round(max(pauses, default=0.0), 3),
        "mean": round(statistics.fmean(pauses), 3) if pauses else 0.0,
    }


class Stack:
    """Redis, a gateway and named workers, all under one temporary home."""

    def __init__(self, **worker_settings) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="weightq-resume-"))
        self.server = EmbeddedRedis(self.home / "redis")
        self.url = self.server.start()
        self.redis = redis.Redis.from_url(self.url, decode_responses=True)
        self.client = Client(self.url, settings=Settings(redis_url=self.url))
        self.worker_settings = worker_settings
        self.workers: dict[str, WorkerProcess] = {}
        self.gateway: GatewayProcess | None = None

    def worker(self, name: str) -> WorkerProcess:
        w = self.workers[name] = WorkerProcess(self.url, name, self.home, **self.worker_settings)
        return w

    def owner_of(self, job_id: str) -> str:
        """The hostname of the worker whose engine runs the job, or ''."""
        owner = self.redis.hget(job_key(job_id), "owner") or ""
        return owner.split("/")[0] if self.redis.sismember(engine_jobs_key(owner), job_id) else ""

    def stop(self) -> None:
        for w in self.workers.values():
            w.kill()
        if self.gateway is not None:
            self.gateway.stop()
        self.server.stop()


def check_stream(stack: Stack, job_id: str, streamed_text: str | None) -> dict:
    """The job's stream and result, as the issue's figures need them."""
    result = stack.client.job(job_id).result(timeout=600)
    entries = stack.redis.xrange(stream_key(job_id))
    parts = [(eid, p) for eid, f in entries if f["type"] == EntryType.TOKEN for p in token_parts(f)]
    tokens = [(eid, int(p["i"])) for eid, p in parts]
    indexes = [i for _, i in tokens]
    attempts = [int(f.get("from", 0)) for _, f in entries if f["type"] == EntryType.ATTEMPT]
    text = "".join(p["text"] for _, p in parts)
    return {
        "result": result,
        "tokens": tokens,
        "once": indexes == list(range(len(result["token_ids"]))),
        "equal": text == result["text"] and (streamed_text is None or streamed_text == result["text"]),
        "twice": len(indexes) - len(set(indexes)),
        "resumed_from": sum(attempts[1:]),
        "attempts": len(attempts),
    }


def kill_round(n: int, max_tokens: int, seed: int, **worker_settings) -> dict:
    rng = random.Random(seed)
    stack = Stack(**worker_settings)
    try:
        workers = [stack.worker("a@bench"), stack.worker("b@bench")]
        stack.gateway = GatewayProcess(stack.url, stack.home)
        for w in workers:
            w.wait_ready()
        stack.gateway.wait_ready()
        outs: list[dict] = [{} for _ in range(n)]
        threads = []
        for i in range(n):
            body = {"prompt": f"Request {i} resumes", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            body |= KINDS[i % len(KINDS)]
            reader = threading.Thread(target=read_sse, args=(stack.gateway.base, "/v1/completions", body, outs[i]))
            threads.append(reader)
            reader.start()
        while not all(o.get("events") or o.get("error") for o in outs):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.5, 3.0))  # a random step
        ids = [o["events"][0][1].split("/")[0] for o in outs]
        held = [stack.owner_of(j) for j in ids]
        victim = max(("a@bench", "b@bench"), key=held.count)
        on_victim = {j for j, h in zip(ids, held, strict=True) if h == victim}
        killed_at = time.time()
        os.killpg(stack.workers[victim].proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(600)
        pauses, checks = [], []
        for job_id, out in zip(ids, outs, strict=True):
            c = check_stream(stack, job_id, openai_text(out["events"]))
            checks.append(c)
            if job_id in on_victim and c["result"]["finish_reason"] == "length":
                after = [float(eid.split("-")[0]) / 1000 for eid, _ in c["tokens"]]
                resumed = [ts for ts in after if ts > killed_at]
                if resumed and len(resumed) < len(after):
                    pauses.append(resumed[0] - killed_at)
        return {
            "jobs": n,
            "max_tokens": max_tokens,
            "killed_worker_jobs": len(on_victim),
            "resumed_jobs": len(pauses),
            "stream_errors": sum(1 for o in outs if o.get("error") or o.get("status") != 200),
            "streamed_equals_result_share": round(sum(c["equal"] for c in checks) / n, 4),
            "each_index_once_share": round(sum(c["once"] for c in checks) / n, 4),
            "pause_after_kill_s": pause_summary(pauses),
            "pauses": pauses,
            "tokens_decoded_twice": sum(c["twice"] for c in checks),
            "tokens_resumed_from_stream": sum(c["resumed_from"] for c in checks),
        }
    finally:
        stack.stop()


def poison_round(healthy: int = 16, max_tokens: int = 150, crashes: int = 3) -> dict:
    stack = Stack(max_attempts=crashes)
    try:
        ids = [f"healthy-{i}" for i in range(healthy)]
        for job_id in ids:
            stack.client.submit(f"{job_id} runs", max_new_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                                request_id=job_id)  # fmt: skip
        stack.client.submit("poison", max_new_tokens=max_tokens, temperature=1.0, ignore_eos=True, request_id="poison")
        t0 = time.monotonic()
        worker = stack.worker("v0@bench")
        done = 0
        while done < crashes and time.monotonic() - t0 < 600:
            if stack.owner_of("poison") == worker.name:
                successor = stack.worker(f"v{done + 1}@bench")  # starting while the crash is handled
                os.killpg(worker.proc.pid, signal.SIGKILL)
                worker, done = successor, done + 1
            time.sleep(0.01)
        checks = [check_stream(stack, job_id, None) for job_id in ids]
        try:
            poison = stack.client.job("poison").result(timeout=600)["finish_reason"]
        except JobFailed as e:
            poison = str(e)
        dead = [json.loads(x)["id"] for x in stack.redis.lrange(DEAD, 0, -1)]
        return {
            "healthy_jobs": healthy,
            "crashes": done,
            "healthy_dead_lettered": sum(j in dead for j in ids),
            "poison_dead_lettered": "poison" in dead,
            "poison_outcome": poison[:120],
            "healthy_streamed_equals_result_share": round(sum(c["equal"] and c["once"] for c in checks) / healthy, 4),
            "healthy_tokens_decoded_twice": sum(c["twice"] for c in checks),
            "seconds": round(time.monotonic() - t0, 1),
            "workers_left_registered": len(stack.redis.hkeys(LEASES)),
        }
    finally:
        stack.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", action="store_true", help="first a round without the lease reaper")
    ap.add_argument("--no-poison", action="store_true")
    args = ap.parse_args()
    report: dict = {"bench": "resume"}
    if args.baseline:
        base = kill_round(args.jobs, args.max_tokens, args.seed, lease_ttl_s=3600)
        base.pop("pauses")
        report["baseline_visibility_timeout_only"] = base
    rounds = [kill_round(args.jobs, args.max_tokens, args.seed + r) for r in range(args.rounds)]
    pauses = [p for r in rounds for p in r.pop("pauses")]
    report["rounds"] = rounds
    report["all_rounds"] = {
        "resumed_jobs": len(pauses),
        "pause_after_kill_s": pause_summary(pauses),
        "streamed_equals_result_share": min(r["streamed_equals_result_share"] for r in rounds),
        "each_index_once_share": min(r["each_index_once_share"] for r in rounds),
        "tokens_decoded_twice": sum(r["tokens_decoded_twice"] for r in rounds),
    }
    if not args.no_poison:
        report["poison"] = poison_round()
    print(json.dumps(report, indent=1 if args.json else None))


if __name__ == "__main__":
    main()
