"""Overload: twice what the workers can serve, for a minute, through the gateway, with and without a
bound on the projected queue wait (MAX_QUEUE_WAIT_S).

    python -m bench.overload --json        # [--seconds 60] [--bound 10] [--rounds 1] [--workers 1]

A real Redis, the HTTP gateway and `--workers` `weightq worker`s on the simulated device
(RUNNER=simulated: a step of SIM_STEP_COST's fixed time, so capacity is known and the two cores stay
free for the clients). Capacity is measured first: a burst of jobs, completions per second once all are queued.
Then Poisson arrivals at 2x that rate for `--seconds`: streaming completions (the same prompt length
and max_tokens each, EOS never ends them early on the simulated device), each client reading its first
token. A refused client (429) comes back after `Retry-After` and again until it is let in. The clients
are bench/lean_http.py's (one connection per request, the rest of a stream read as raw bytes): with
httpx, the load generator took the cores the gateway needed at four workers (accepted TTFT p99 35-43 s).

- bounded (MAX_QUEUE_WAIT_S = --bound): accepted requests' TTFT (from the accepted attempt) p50/p99
  against the bound; refusals' response time p50/p99 (the 429 itself); for each refused request,
  its first Retry-After against its real wait (from that refusal until an attempt was let in):
  ratio real / Retry-After, median and p90, and the share within 2x either way.
- unbounded (the same load, MAX_QUEUE_WAIT_S=0): TTFT p50/p99 of every request: what callers get
  from a queue that never says no.
Rounds alternate bounded and unbounded on one stack; medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client
from weightq.settings import Settings

from .lean_http import LeanHttp

STEP_S = 0.03
MAX_TOKENS = 96
PROMPT = "overload " * 6
BUDGET = 2048  # KV tokens: ~18 requests of ~110 tokens at once
WORKER = {
    "runner": "simulated", "sim_step_cost": f"{STEP_S},0,0", "max_batch_weight": BUDGET, "max_total_tokens": 256,
    "concurrency": 64, "prefix_cache": 0,
}  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else 0.0


def capacity(url: str, n: int = 120) -> float:
    """Completions per second with the queue never empty: n jobs at once (n a multiple of about 6
    jobs per worker's budget), the rate over the middle."""
    client = Client(url, settings=Settings(redis_url=url))
    jobs = client.submit_many([{"prompt": PROMPT, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}] * n)
    ends = []
    for job in jobs:
        job.result(timeout=600)
        ends.append(time.monotonic())
    lo, hi = n // 4, 3 * n // 4  # past the first wave, before the queue runs dry
    return (hi - lo) / (ends[hi] - ends[lo])


class Load:
    """Open-loop Poisson arrivals against the gateway; refused requests retry at Retry-After."""

    def __init__(self, base: str, rate: float, seconds: float, seed: int) -> None:
        self.base, self.rate, self.seconds = base, rate, seconds
        self.rng = random.Random(seed)
        self.ttft: list[float] = []
        self.ttft_fresh: list[float] = []
        self.ttft_retried: list[float] = []
        self.refusal_s: list[float] = []
        self.retry_ratio: list[float] = []
        self.refused_requests = 0
        self.requests = 0
        self.errors = 0
        self.dropped = 0  # of the errors: connections dropped before the response ended
        self.refusals: list[int] = []  # per refused request: how many times it was refused
        self.sleeping: dict[int, float] = {}  # request -> the Retry-After it sleeps (progress lines)
        self.reading = 0

    async def one(self, http: LeanHttp) -> None:
        self.requests += 1
        body = {"model": "builtin:tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
        first_refusal: float | None = None
        promised, refusals, reading = 0.0, 0, False
        while True:
            t0 = time.monotonic()
            r = None
            try:
                r = await http.post("/v1/completions", body)
                if r.status == 429:
                    self.refusal_s.append(time.monotonic() - t0)
                    after = float(r.headers.get("retry-after", "1"))
                    r.close()  # now: a sleeping client holds no connection of the gateway's
                    refusals += 1
                    if first_refusal is None:
                        first_refusal, promised = t0, after
                        self.refused_requests += 1
                    self.sleeping[id(body)] = after
                    await asyncio.sleep(after)
                    self.sleeping.pop(id(body), None)
                    continue
                if r.status != 200:
                    self.errors += 1
                    return
                self.reading += 1
                reading = True
                async for _, line in r.lines():
                    if line.startswith(b"data: {"):
                        self.ttft.append(time.monotonic() - t0)
                        (self.ttft_fresh if first_refusal is None else self.ttft_retried).append(self.ttft[-1])
                        if first_refusal is not None:
                            self.retry_ratio.append((t0 - first_refusal) / promised)
                            self.refusals.append(refusals)
                        break
                await r.drain()
                return
            except (OSError, asyncio.IncompleteReadError, ValueError):  # a connection dropped
                self.errors += 1
                self.dropped += 1
                return
            finally:
                if r is not None:
                    r.close()
                if reading:
                    self.reading -= 1
                    reading = False

    async def run(self) -> None:
        http = LeanHttp(self.base)
        tasks, start = [], time.monotonic()
        t = 0.0
        while True:
            t += self.rng.expovariate(self.rate)
            if t > self.seconds:
                break
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(self.one(http)))
        while not all(t.done() for t in tasks):
            await asyncio.sleep(5)
            late = max(self.sleeping.values(), default=0)
            left = sum(not t.done() for t in tasks)
            print(
                f"overload: {left} requests open, {self.reading} reading, {len(self.sleeping)} "
                f"waiting to retry (longest Retry-After {late} s)",
                file=sys.stderr,
                flush=True,
            )
        await asyncio.gather(*tasks)

    def summary(self, bound: float) -> dict:
        out = {
            "requests": self.requests,
            "errors": self.errors,
            "dropped_connections": self.dropped,
            "ttft_p50_s": pct(self.ttft, 0.5),
            "ttft_p99_s": pct(self.ttft, 0.99),
        }
        if bound:
            r = self.retry_ratio
            out |= {
                "bound_s": bound,
                "ttft_p99_within_bound": pct(self.ttft, 0.99) <= bound,
                "ttft_p99_first_try_s": pct(self.ttft_fresh, 0.99),
                "ttft_p99_after_retry_s": pct(self.ttft_retried, 0.99),
                "refused_requests": self.refused_requests,
                "refusal_ms_p50": round(pct(self.refusal_s, 0.5) * 1000, 1),
                "refusal_ms_p99": round(pct(self.refusal_s, 0.99) * 1000, 1),
                "real_wait_over_retry_after_p50": pct(r, 0.5),
                "real_wait_over_retry_after_p90": pct(r, 0.9),
                "let_in_at_first_return_share": round(sum(n == 1 for n in self.refusals) / len(r), 3) if r else None,
                "retry_after_within_2x_share": round(sum(0.5 <= x <= 2 for x in r) / len(r), 3) if r else None,
            }
        return out


def drained(r: redis.Redis, gw: GatewayProcess) -> None:
    while httpx.get(gw.base + "/metrics/cluster", timeout=30).text.count("weightq_projected_drain_seconds 0.0") == 0:
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--bound", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--overload", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="weightq-overload-"))
    server = EmbeddedRedis(home / "redis")
    url = server.start()
    r = redis.Redis.from_url(url)
    workers = [WorkerProcess(url, f"overload{i}@bench", home, **WORKER) for i in range(args.workers)]
    gateways = {
        b: GatewayProcess(url, home, max_queue_wait_s=b, rate_limit_per_s=0, max_concurrent_per_client=0)
        for b in (args.bound, 0.0)
    }
    try:
        for worker in workers:
            worker.wait_ready()
        for gw in gateways.values():
            gw.wait_ready()
        cap = capacity(url, 120 * args.workers)
        rate = args.overload * cap
        results: dict[str, list[dict]] = {"bounded": [], "unbounded": []}
        for i in range(args.rounds):
            for name, b in (("bounded", args.bound), ("unbounded", 0.0))[:: 1 if i % 2 == 0 else -1]:
                load = Load(gateways[b].base, rate, args.seconds, seed=i)
                asyncio.run(load.run())
                results[name].append(load.summary(b))
                drained(r, gateways[b])
        out = {
            "bench": "overload",
            "workers": args.workers,
            "capacity_jobs_s": round(cap, 2),
            "offered_jobs_s": round(rate, 2),
            "seconds": args.seconds,
            "rounds": args.rounds,
            **{name: median_of(rs) for name, rs in results.items()},
            "bounded_ttft_p99_each_round_s": [r["ttft_p99_s"] for r in results["bounded"]],
        }
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    finally:
        for gw in gateways.values():
            gw.stop()
        for worker in workers:
            worker.stop()
            worker.kill()
        server.stop()


def median_of(rounds: list[dict]) -> dict:
    out = {}
    for key, value in rounds[0].items():
        values = [x[key] for x in rounds if x.get(key) is not None]
        numeric = values and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        out[key] = round(statistics.median(values), 3) if numeric else value
    return out


if __name__ == "__main__":
    main()
