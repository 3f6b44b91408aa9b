"""A sharded token plane: what one, two and three Redis shards carry (STREAMS_REDIS_URL="a,b,c").

    python -m bench.shards --json

One stack per shard count, side by side: Celery's broker on a Redis of its own, the token plane on 1, 2
or 3 others, --workers `weightq worker` processes on the simulated device (RUNNER=simulated). Rounds
alternate the stacks; each submits --jobs jobs of --tokens new tokens through the Client (distinct
prompts, so prefix affinity spreads them over the workers' own queues, and the client draws each id on
a shard of the worker it is sent to: `TokenPlane.new_id`), and one reader process per shard follows that
shard's streams as a gateway's hub does (blocking on its STREAM_TICK and taking the entries each tick
carries, XREAD of a stream where a tick cannot stand in for it).
Each shard's Redis CPU (INFO cpu) is read from the submit to the last end.

This machine has two cores, fewer than the stack's processes, so the streamed tokens/s measured here is the
workers' and readers' limit, not Redis': what a plane *sustains* is computed from the Redis CPU instead. A
Redis runs commands on one core, so the plane saturates when its busiest shard does: capacity_tok_s =
streamed tokens / the busiest shard's CPU seconds. Figures (medians over rounds):
- redis_cpu_ms_per_1000_tokens: every shard's CPU summed, per 1,000 streamed tokens (the plane's cost;
  flat across shard counts when sharding adds no work per token), and per shard;
- busiest_share: the busiest shard's part of that CPU (1/n when the jobs spread evenly);
- capacity_tok_s and capacity_vs_one: the rate at which the busiest shard's core is full, and its ratio
  to one shard's (the issue's "three shards sustain >= 2.7x one").
That last figure charges every shard's background (the workers' leases, sweeps and held sets on each
shard, the server's own cron: CPU per second, not per token) to the round's tokens, and the tokens are
what this machine's workers stream (about a tenth of what a shard carries when full): with n shards
there is n times the background over the same tokens. So each stack's background is measured too, with
its workers idle (background_ms_per_s per shard, before the rounds), and the per-token cost left once it
is taken out of each round (marginal_cpu_ms_per_1000_tokens); a shard at saturation spends its
background and the rest of its core on tokens: saturated_capacity_tok_s = min over shards of (1 s - its
background) / its marginal CPU per token, and saturated_capacity_vs_first its ratio to one shard's.
A Redis' CPU per token also falls as it carries more (more commands per wakeup of its event loop), and
here each of n shards carries a nth of what one does. So a control stack runs beside them (`control`:
one shard with a nth of the workers and of the jobs, what each shard of the most carries):
cpu_per_token_vs_control compares each stack's CPU per token with a single server's at that load, and
command_calls_and_us_per_1000_tokens (every shard summed) shows what sharding adds per token in commands.
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
from weightq.tasks.contract import shard_of

from .pipeline import start_follower
from .tokenplane import redis_cpu_s


@dataclass
class ShardedStack:
    shards: int
    broker: EmbeddedRedis
    planes: list[EmbeddedRedis]
    workers: list[WorkerProcess] = field(default_factory=list)

    @property
    def streams_redis_url(self) -> str:
        return ",".join(p.url for p in self.planes)

    def cpu(self) -> list[float]:
        return [redis_cpu_s(redis.Redis.from_url(p.url)) for p in self.planes]

    def commands(self) -> dict[str, tuple[int, float]]:
        """Calls and microseconds so far per command (INFO commandstats), summed over the shards."""
        out: dict[str, tuple[int, float]] = {}
        for p in self.planes:
            for k, v in redis.Redis.from_url(p.url).info("commandstats").items():
                calls, usec = out.get(k.removeprefix("cmdstat_"), (0, 0.0))
                out[k.removeprefix("cmdstat_")] = (calls + int(v["calls"]), usec + float(v["usec"]))
        return out

    def stop(self) -> None:
        for w in self.workers:
            w.kill()
        for server in (self.broker, *self.planes):
            server.stop()


def start_stack(shards: int, home: Path, args, workers: int, jobs: int, tag: str) -> ShardedStack:
    fsync = {"appendfsync": args.appendfsync}
    broker = EmbeddedRedis(home / f"{tag}-broker", **fsync)
    broker.start()
    planes = [EmbeddedRedis(home / f"{tag}-plane{n}", **fsync) for n in range(shards)]
    for p in planes:
        p.start()
    stack = ShardedStack(shards, broker, planes)
    for i in range(workers):
        stack.workers.append(
            WorkerProcess(
                broker.url,
                f"{tag}w{i}@shards",
                home,
                runner="simulated",
                engine_process="off",
                max_batch_weight=65536,
                concurrency=jobs // workers + 16,
                task_events=0,
                streams_redis_url=stack.streams_redis_url,
            )
        )
    for w in stack.workers:
        w.wait_ready()
    return stack


def background_ms_per_s(stack: ShardedStack, seconds: float) -> list[float]:
    """Each shard's Redis CPU per second with the workers idle: what it spends whatever the load."""
    cpu0 = stack.cpu()
    time.sleep(seconds)
    return [1000 * (b - a) / seconds for a, b in zip(cpu0, stack.cpu(), strict=True)]


def run_round(stack: ShardedStack, client: Client, n: int, tokens: int, tag: str, background: list[float]) -> dict:
    readers = [start_follower(plane.url, None) for plane in stack.planes]
    requests = [{"prompt": f"{tag} {i}", "max_new_tokens": tokens, "ignore_eos": True} for i in range(n)]
    cpu0, cmd0, t0 = stack.cpu(), stack.commands(), time.perf_counter()
    ids = [job.id for job in client.submit_many(requests)]  # the client draws each id (`TokenPlane.new_id`)
    for shard, (_, results) in enumerate(readers):
        results.send([j for j in ids if shard_of(j, stack.shards) == shard])
    streamed = 0
    for _proc, results in readers:
        if not results.poll(900):
            raise RuntimeError(f"{stack.shards} shards: a reader did not see every job end within 900 s")
        streamed += len(results.recv()[0])
    wall = time.perf_counter() - t0
    cpu = [b - a for a, b in zip(cpu0, stack.cpu(), strict=True)]
    cmd1 = stack.commands()
    commands = {
        k: (1000 * (calls - cmd0.get(k, (0, 0))[0]) / streamed, 1000 * (usec - cmd0.get(k, (0, 0.0))[1]) / streamed)
        for k, (calls, usec) in cmd1.items()
    }
    for proc, _ in readers:
        proc.join(10)
    total = sum(cpu)
    # each shard's CPU less its background over the round: what its part of the tokens cost. Saturated,
    # a shard spends the rest of each second on its part, so the plane carries (1 s - its background) /
    # its marginal CPU x the round's tokens a second, until the first shard is full
    marginal = [max(c - b * wall / 1000, 1e-9) for c, b in zip(cpu, background, strict=True)]
    return {
        "tok_s": streamed / wall,
        "redis_cpu_ms_per_1000_tokens": 1e6 * total / streamed,
        "per_shard_cpu_ms_per_1000_tokens": [1e6 * c / streamed for c in cpu],
        "busiest_share": max(cpu) / total,
        "capacity_tok_s": streamed / max(cpu),
        "marginal_cpu_ms_per_1000_tokens": 1e6 * sum(marginal) / streamed,
        "commands": {k: v for k, v in commands.items() if v[0] > 0},
        "saturated_capacity_tok_s": min(
            streamed * (1 - b / 1000) / m for m, b in zip(marginal, background, strict=True)
        ),
    }


def summary(rounds: list[dict]) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    shards = len(rounds[0]["per_shard_cpu_ms_per_1000_tokens"])
    return {
        "redis_cpu_ms_per_1000_tokens": round(med("redis_cpu_ms_per_1000_tokens"), 2),
        "per_shard_cpu_ms_per_1000_tokens": [
            round(statistics.median(r["per_shard_cpu_ms_per_1000_tokens"][n] for r in rounds), 2) for n in range(shards)
        ],
        "busiest_share": round(med("busiest_share"), 3),
        "capacity_tok_s": round(med("capacity_tok_s")),
        "marginal_cpu_ms_per_1000_tokens": round(med("marginal_cpu_ms_per_1000_tokens"), 2),
        "saturated_capacity_tok_s": round(med("saturated_capacity_tok_s")),
        "measured_tok_s": round(med("tok_s"), 1),
        # calls and microseconds (wall, inside scripts counted again) per 1,000 tokens, all shards summed
        "command_calls_and_us_per_1000_tokens": {
            k: [round(statistics.median(r["commands"].get(k, (0, 0))[i] for r in rounds), 2) for i in (0, 1)]
            for k in sorted({k for r in rounds for k in r["commands"]})
        },
        "rounds": [
            {k: v if isinstance(v, list) else round(v, 3) for k, v in r.items() if k != "commands"} for r in rounds
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="What 1, 2 and 3 token-plane shards carry")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shards", default="1,2,3")
    ap.add_argument("--workers", type=int, default=3, help="workers per stack")
    ap.add_argument("--jobs", type=int, default=192, help="jobs per round")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per job")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-control", action="store_true", help="no one-shard stack at one shard's part of the load")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds each stack's idle background is measured")
    ap.add_argument("--appendfsync", default="everysec", choices=["everysec", "always"])
    args = ap.parse_args()
    counts = [int(x) for x in args.shards.split(",")]
    # the control: one shard carrying what each shard of the most carries (its share of the workers and
    # jobs): a Redis's CPU per token falls as it serves more per wakeup, so this says what the load per
    # server costs, apart from sharding (which adds no command per token: command_calls_and_us_per_1000_tokens)
    per = max(counts)
    control = (max(1, args.workers // per), max(1, args.jobs // per))
    home = Path(tempfile.mkdtemp(prefix="weightq-shards-"))
    stacks: dict[str, tuple[ShardedStack, int]] = {}  # label -> the stack, its jobs per round
    try:
        for n in counts:
            stacks[f"shards_{n}"] = (start_stack(n, home, args, args.workers, args.jobs, f"s{n}"), args.jobs)
        if per > 1 and not args.no_control:
            stacks["control"] = (start_stack(1, home, args, *control, "c1"), control[1])
        clients = {
            label: Client(settings=Settings(redis_url=s.broker.url, streams_redis_url=s.streams_redis_url))
            for label, (s, _) in stacks.items()
        }
        for label, (s, _) in stacks.items():  # warm: the workers' first jobs out of the figures
            run_round(s, clients[label], 4 * len(s.workers), 8, f"{label}-warm", [0.0] * s.shards)
        background = {label: background_ms_per_s(s, args.idle_s) for label, (s, _) in stacks.items()}
        rounds: dict[str, list[dict]] = {label: [] for label in stacks}
        order = list(stacks)
        for r in range(args.rounds):
            for label in order if r % 2 == 0 else order[::-1]:
                s, jobs = stacks[label]
                rounds[label].append(run_round(s, clients[label], jobs, args.tokens, f"{label}-{r}", background[label]))
        results = {label: summary(rounds[label]) | {"background_ms_per_s": background[label]} for label in stacks}
        base = results[f"shards_{counts[0]}"]
        for n in counts:
            res = results[f"shards_{n}"]
            res["capacity_vs_first"] = round(res["capacity_tok_s"] / base["capacity_tok_s"], 2)
            res["cpu_per_token_vs_first"] = round(
                res["redis_cpu_ms_per_1000_tokens"] / base["redis_cpu_ms_per_1000_tokens"], 3
            )
            res["saturated_capacity_vs_first"] = round(
                res["saturated_capacity_tok_s"] / base["saturated_capacity_tok_s"], 2
            )
            res["marginal_cpu_per_token_vs_first"] = round(
                res["marginal_cpu_ms_per_1000_tokens"] / base["marginal_cpu_ms_per_1000_tokens"], 3
            )
            if "control" in results:
                res["cpu_per_token_vs_control"] = round(
                    res["redis_cpu_ms_per_1000_tokens"] / results["control"]["redis_cpu_ms_per_1000_tokens"], 3
                )
        for res in results.values():
            res["background_ms_per_s"] = [round(b, 2) for b in res["background_ms_per_s"]]
        if "control" in results:
            results["control"] = {"workers": control[0], "jobs_per_round": control[1], **results["control"]}
        out = {
            "bench": "shards",
            "runner": "simulated",
            "workers_per_stack": args.workers,
            "jobs_per_round": args.jobs,
            "tokens_per_job": args.tokens,
            "rounds": args.rounds,
            "broker": "a Redis of its own in every stack (not counted)",
            "readers": "one process per shard, hub-style: its STREAM_TICK and what it carries, XREAD where it cannot",
            **results,
        }
        print(json.dumps(out, indent=None if args.json else 2))
    finally:
        for s, _ in stacks.values():
            s.stop()


if __name__ == "__main__":
    main()
