"""The token plane: how much Redis CPU a streamed token costs, and so how many workers one Redis carries.

    python -m bench.tokenplane --json

Two stacks run side by side, each with --workers `weightq worker` processes on the simulated device
(RUNNER=simulated: the device is a modelled wait, so many workers fit on two cores):
- one: every key on one Redis (REDIS_URL alone, as `make run` and most deployments);
- split: Celery's broker on one Redis, the streams and job state on another (STREAMS_REDIS_URL).
Rounds alternate one / split. Each round submits --jobs jobs of --tokens new tokens (short prompts, EOS
ignored) in one batch through the Client (and a round of --few-jobs: fewer streams per worker step, so
each step's writes carry fewer tokens), and one reader process follows every stream as the gateway's
hub does (blocking on the workers' STREAM_TICK, taking the entries each tick carries, and XREADing a
stream only where a tick cannot stand in for it). A
round's Redis CPU is the server's INFO cpu (used_cpu_sys + used_cpu_user) delta from the submit to the
reader seeing the last end entry: submits, Celery's deliveries, acks and results, every stream entry,
the readers' XREADs, and the workers' background traffic (heartbeats, leases, sweeps) of that time.
Figures are medians over rounds:
- cpu_ms_per_1000_tokens per Redis (one; split: broker and streams);
- tok_s_per_redis_core: 1000 / cpu_s per 1,000 tokens: the stream rate that keeps one Redis core busy;
- worker_tok_s: streamed tokens/s per worker measured here, and workers_to_saturate_one_core at that
  speed and at each of --speeds (tokens/s a worker streams on its own device).
The idle background (Redis CPU per second per idle worker) is measured once per stack.
streams_command_wall_ms_per_1000_tokens splits the streams' server's time by command (INFO
commandstats): wall time, so a server preempted on a busy machine counts the wait, and a command run
inside a script (WRITE_BATCH's XADDs) is counted again under its own name: read it as shares, not CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from weightq.cli.processes import WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client
from weightq.settings import Settings

from .pipeline import start_follower


def redis_cpu_s(client: redis.Redis) -> float:
    """The server's CPU seconds so far (main thread and its helpers, user + system)."""
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


@dataclass
class Stack:
    """Workers on one Redis (`streams` None) or on a broker and a streams Redis."""

    name: str
    broker: EmbeddedRedis
    streams: EmbeddedRedis | None
    workers: list[WorkerProcess] = field(default_factory=list)

    @property
    def servers(self) -> dict[str, EmbeddedRedis]:
        """Named for what each carries: "redis" (everything), or "broker" and "streams"."""
        return {"broker": self.broker, "streams": self.streams} if self.streams else {"redis": self.broker}

    @property
    def streams_url(self) -> str:
        return (self.streams or self.broker).url

    def settings(self) -> Settings:
        extra = {"streams_redis_url": self.streams.url} if self.streams else {}
        return Settings(redis_url=self.broker.url, **extra)

    def cpu(self) -> dict[str, float]:
        return {k: redis_cpu_s(redis.Redis.from_url(s.url)) for k, s in self.servers.items()}

    def commands(self) -> dict[str, float]:
        """Microseconds spent so far per command (INFO commandstats) by the Redis of the streams."""
        stats = redis.Redis.from_url(self.streams_url).info("commandstats")
        return {k.removeprefix("cmdstat_"): float(v["usec"]) for k, v in stats.items()}


def start_stack(name: str, home: Path, split: bool, args) -> Stack:
    fsync = {"appendfsync": args.appendfsync}
    broker = EmbeddedRedis(home / f"{name}-broker", **fsync)
    broker.start()
    streams = EmbeddedRedis(home / f"{name}-streams", **fsync) if split else None
    if streams:
        streams.start()
    stack = Stack(name, broker, streams)
    extra = {"streams_redis_url": streams.url} if streams else {}
    for i in range(args.workers):
        stack.workers.append(
            WorkerProcess(
                broker.url,
                f"{name}{i}@tokenplane",
                home,
                runner="simulated",
                sim_step_cost=args.sim_step_cost,
                engine_process="off",
                max_batch_weight=65536,
                concurrency=args.jobs // args.workers + 16,
                task_events=0,
                **extra,
            )
        )
    for w in stack.workers:
        w.wait_ready()
    return stack


def run_round(stack: Stack, client: Client, n: int, tokens: int, tag: str) -> dict:
    ids = [f"{tag}-{i}" for i in range(n)]
    reader, results = start_follower(stack.streams_url, ids)
    requests = [
        {"prompt": f"token plane {i % 7}", "max_new_tokens": tokens, "ignore_eos": True, "request_id": job_id}
        for i, job_id in enumerate(ids)
    ]
    cmd0, cpu0, t0 = stack.commands(), stack.cpu(), time.perf_counter()
    client.submit_many(requests)
    if not results.poll(900):
        raise RuntimeError(f"{stack.name}: the reader did not see every job end within 900 s")
    latencies, _ = results.recv()
    wall = time.perf_counter() - t0
    cpu1, cmd1 = stack.cpu(), stack.commands()
    reader.join(10)
    streamed = len(latencies)
    out = {"tokens": streamed, "wall_s": wall, "tok_s": streamed / wall}
    for k in cpu0:
        out[f"{k}_cpu_ms_per_1000_tokens"] = 1e6 * (cpu1[k] - cpu0[k]) / max(streamed, 1)
    # where the streams' server spends it: command execution alone (the rest is network I/O and parsing)
    per_command = {k: (v - cmd0.get(k, 0.0)) / 1000 / max(streamed, 1) * 1000 for k, v in cmd1.items()}
    out["commands"] = {k: v for k, v in per_command.items() if v >= 0.05 and k != "info"}
    return out


def idle_cpu(stack: Stack, seconds: float) -> dict[str, float]:
    """Redis CPU ms per second per idle worker: what a worker costs a Redis with no job."""
    cpu0 = stack.cpu()
    time.sleep(seconds)
    cpu1 = stack.cpu()
    return {k: round(1000 * (cpu1[k] - cpu0[k]) / seconds / len(stack.workers), 3) for k in cpu0}


def median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def summary(rounds: list[dict], workers: int, speeds: list[float], full: bool = True) -> dict:
    """Medians of a stack's rounds and what they mean for one Redis core."""
    keys = [k for k in rounds[0] if k.endswith("_cpu_ms_per_1000_tokens")]
    out = {k: round(median(rounds, k), 2) for k in keys}
    streams_ms = out.get("streams_cpu_ms_per_1000_tokens") or out["redis_cpu_ms_per_1000_tokens"]
    per_core = 1000 / (streams_ms / 1000)  # tokens per CPU second of the Redis that carries the streams
    out["tok_s_per_redis_core"] = round(per_core)
    if not full:
        return out
    out["tok_s"] = round(median(rounds, "tok_s"), 1)
    out["worker_tok_s"] = round(out["tok_s"] / workers, 1)
    out["workers_to_saturate_one_core"] = {
        "measured": round(per_core / out["worker_tok_s"], 1),
        **{f"at_{s:g}_tok_s": round(per_core / s, 1) for s in speeds},
    }
    commands = {k for r in rounds for k in r["commands"]}
    medians = {k: statistics.median(r["commands"].get(k, 0.0) for r in rounds) for k in commands}
    out["streams_command_wall_ms_per_1000_tokens"] = {
        k: round(v, 2) for k, v in sorted(medians.items(), key=lambda kv: -kv[1]) if v >= 0.05
    }
    out["rounds"] = [{k: round(v, 2) for k, v in r.items() if k != "commands"} for r in rounds]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Redis CPU per streamed token, on one Redis and split")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workers", type=int, default=3, help="workers per stack")
    ap.add_argument("--jobs", type=int, default=192, help="jobs per round")
    ap.add_argument("--few-jobs", type=int, default=24, help="jobs per round of the few-streams load")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per job")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per stack and load (alternating)")
    ap.add_argument("--sim-step-cost", default="", help="SIM_STEP_COST (default: the simulated device's)")
    ap.add_argument("--appendfsync", default="everysec", choices=["everysec", "always"])
    ap.add_argument("--speeds", default="1000,2500,5000,10000", help="worker tok/s to size for (comma-separated)")
    args = ap.parse_args()
    speeds = [float(x) for x in args.speeds.split(",") if x]
    home = Path(tempfile.mkdtemp(prefix="weightq-tokenplane-"))
    stacks: list[Stack] = []
    try:
        stacks = [start_stack("one", home, False, args), start_stack("split", home, True, args)]
        clients = {s.name: Client(s.broker.url, settings=s.settings()) for s in stacks}
        for s in stacks:  # warm: every worker's first jobs (imports, tokenizer) out of the figures
            run_round(s, clients[s.name], 4 * args.workers, 8, f"{s.name}-warm")
        idle = {s.name: idle_cpu(s, 3.0) for s in stacks}
        loads = {"many": args.jobs, "few": args.few_jobs}
        rounds: dict[tuple[str, str], list[dict]] = {(s.name, load): [] for s in stacks for load in loads}
        for r in range(args.rounds):
            for s in stacks if r % 2 == 0 else stacks[::-1]:
                for load, n in loads.items():
                    rounds[s.name, load].append(run_round(s, clients[s.name], n, args.tokens, f"{s.name}-{load}-{r}"))
        one, split = (summary(rounds[s.name, "many"], args.workers, speeds) for s in stacks)
        few = {s.name: summary(rounds[s.name, "few"], args.workers, speeds, full=False) for s in stacks}
        out = {
            "runner": "simulated",
            "sim_step_cost": args.sim_step_cost or "default",
            "workers_per_stack": args.workers,
            "jobs_per_round": args.jobs,
            "tokens_per_job": args.tokens,
            "rounds": args.rounds,
            "appendfsync": args.appendfsync,
            "reader": "one process, hub-style: STREAM_TICK and the entries it carries, XREAD where it cannot stand in",
            "one_redis": one,
            "split": split,
            "split_streams_vs_one": round(
                split["streams_cpu_ms_per_1000_tokens"] / one["redis_cpu_ms_per_1000_tokens"], 3
            ),
            "few_streams": {"jobs_per_round": args.few_jobs, "one_redis": few["one"], "split": few["split"]},
            "idle_cpu_ms_per_s_per_worker": idle,
        }
        print(json.dumps(out, indent=None if args.json else 2))
    finally:
        for s in stacks:
            for w in s.workers:
                w.kill()
            for server in s.servers.values():
                server.stop()


if __name__ == "__main__":
    main()
