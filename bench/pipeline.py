"""End to end through Celery and Redis Streams against the same engine called in-process.

    python -m bench.pipeline --json

256 greedy requests on the built-in tiny model (prompts 16-128 random token ids, 16-96 new tokens,
EOS ignored, fixed seed). In-process: Engine.generate() in this process. Pipeline: a real Redis and a
`weightq worker` subprocess with the same engine settings; the client enqueues every job and one
reader process follows all 256 streams with XREAD. Token latency is from the engine emitting a token
(stamped in the stream entry) to the reader receiving it. The two runs are sequential, so they never
compete for the CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import redis
from weightq.batcher import BatcherConfig
from weightq.batcher.sim.simulator import percentile
from weightq.cli.processes import WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.redis_conn import raw_xread, xread_streams
from weightq.settings import Settings
from weightq.tasks.contract import (
    END_TYPES,
    STREAM_TICK,
    TICKS_KEPT,
    EntryType,
    stream_key,
    tick_entries,
    tick_streams,
)

BUDGET = 65536
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = vals[3] + vals[4]
    return (sum(vals) - idle) / TICK, sum(vals) / TICK


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, 1100) for _ in range(rng.randint(16, 128))], rng.randint(16, 96)) for _ in range(n)]


def inproc(work, runner: dict) -> tuple[float, dict]:
    engine = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=BUDGET), **runner))
    engine.generate([GenerationRequest("warm", prompt_token_ids=work[0][0], params=SamplingParams(max_new_tokens=4))])
    reqs = [
        GenerationRequest(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(work)
    ]
    c0, t0 = cpu_s(), time.perf_counter()
    results = engine.generate(reqs)
    elapsed = time.perf_counter() - t0
    forward_s = engine.stats()["forward_s"]
    cpu = {"cpu_s": round(cpu_s() - c0, 2), "wall_s": round(elapsed, 2), "engine_forward_s": forward_s}
    return sum(r.completion_tokens for r in results) / elapsed, cpu


def start_follower(url: str, ids: list[str] | None) -> tuple[multiprocessing.Process, Connection]:
    """`follow` in a spawned process, ready: the process and the end of the pipe its results come
    back on (duplex when `ids` is None: the ids are sent over it once the jobs are submitted)."""
    spawn = multiprocessing.get_context("spawn")
    results, sender = spawn.Pipe(duplex=ids is None)
    reader = spawn.Process(target=follow, args=(url, ids, sender), daemon=True)
    reader.start()
    if not results.poll(60) or results.recv() != "ready":
        raise RuntimeError("the stream reader did not start")
    return reader, results


def follow(url: str, ids: list[str] | None, out: Connection) -> None:
    """One reader for every stream, in a process of its own (as a gateway is: sharing the
    submitting client's GIL added its switch interval to every read), until each stream has ended;
    then the latencies (read time - emit stamp) go back over `out`. As the gateway's hub does, it
    blocks on the workers' STREAM_TICK stream, takes the entries each tick carries (tasks/ticks.py),
    and XREADs only the streams a tick cannot stand in for (all of them when no tick came, or some
    may be trimmed), replies read as hiredis parses them (app/redis_conn.py: raw_xread). `ids` None:
    they come over `out` (duplex) after "ready", for jobs whose ids the client draws at submission."""
    r = redis.Redis.from_url(url, socket_timeout=30)
    raw_xread(r)
    r.ping()
    latencies: list[float] = []
    cpu0 = cpu_s()  # the reader's own work, not its start-up imports
    out.send("ready")
    last = {stream_key(i): "0-0" for i in (out.recv() if ids is None else ids)}

    def take(key: str, entries: list, now: float) -> None:
        for entry_id, raw in entries:
            last[key] = entry_id
            fields = dict(zip(raw[::2], raw[1::2], strict=True))
            if fields["type"] == EntryType.TOKEN:  # a joined entry's tokens, each at its first one's latency
                latencies.extend([now - float(fields["ts"])] * int(fields.get("n", 1)))
            elif fields["type"] in END_TYPES:
                del last[key]
                return

    tick, named = "0-0", None  # None: read every unfinished stream
    while last:
        streams = last if named is None else {k: last[k] for k in named if k in last}
        resp = r.xread(streams, count=1000) if streams else None
        now = time.time()
        full = False
        for key, entries in xread_streams(resp):
            full = full or len(entries) >= 1000
            take(key.decode(), [(i.decode(), [x.decode() for x in raw]) for i, raw in entries], now)
        named = None
        if last and not full:
            for _, entries in xread_streams(r.xread({STREAM_TICK: tick}, block=100, count=TICKS_KEPT)):
                tick, now, named = entries[-1][0], time.time(), set()
                for _, raw in entries:
                    fields = dict(zip(raw[::2], raw[1::2], strict=True))
                    keys, data = fields.get(b"keys"), fields.get(b"data")
                    parts = tick_streams(None if keys is None else keys.decode(), data and data.decode())
                    if parts is None or len(entries) >= TICKS_KEPT:
                        named = None
                        break
                    for key, part in parts:
                        if key not in last:
                            continue
                        before, carried = tick_entries(part) if part else ("", [])
                        if before and before == last[key]:
                            take(key, carried, now)
                        else:
                            named.add(key)
                if named is None:
                    break
    out.send((latencies, cpu_s() - cpu0))


def pipeline(work, runner: dict, task_events: bool = False) -> tuple[float, list[float], dict]:
    home = Path(tempfile.mkdtemp(prefix="weightq-bench-"))
    server = EmbeddedRedis(home / "redis")
    url = server.start()
    worker = WorkerProcess(
        url,
        "bench@pipeline",
        home,
        max_batch_weight=BUDGET,
        concurrency=len(work) + 8,
        task_events=int(task_events),
        **runner,
    )
    try:
        worker.wait_ready()
        client = Client(url, settings=Settings(redis_url=url))
        client.submit(prompt_token_ids=work[0][0], max_new_tokens=4).result(timeout=60)  # warm
        ids = [f"p{i}" for i in range(len(work))]
        reader, results = start_follower(url, ids)
        pids = {"worker": worker.proc.pid, "redis": server.proc.pid, "bench": "self"}
        cpu0 = {k: cpu_s(p) for k, p in pids.items()}
        busy0, total0 = machine_busy()
        t0 = time.perf_counter()
        for job_id, (p, n) in zip(ids, work, strict=True):
            client.submit(prompt_token_ids=p, max_new_tokens=n, ignore_eos=True, request_id=job_id)
        if not results.poll(600):
            raise RuntimeError("the stream reader did not see every job end within 600 s")
        latencies, reader_cpu = results.recv()
        elapsed = time.perf_counter() - t0
        reader.join(10)
        busy1, total1 = machine_busy()
        cpu = {f"{k}_cpu_s": round(cpu_s(p) - cpu0[k], 2) for k, p in pids.items()}
        cpu["reader_cpu_s"] = round(reader_cpu, 2)
        cpu["wall_s"] = round(elapsed, 2)
        cpu["machine_busy_pct"] = round(100 * (busy1 - busy0) / max(total1 - total0, 1e-9), 1)
        time.sleep(1.2)  # the next heartbeat carries the final engine counters
        cpu["engine_forward_s"] = worker.stats().get("forward_s")
        return len(latencies) / elapsed, latencies, cpu
    finally:
        worker.stop()
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description="weightq through Celery + Redis Streams vs in-process")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--task-events", action="store_true", help="run the worker with TASK_EVENTS=1 (as if Flower watched)"
    )
    ap.add_argument("--runner", default="auto", choices=["auto", "simulated"], help="simulated: the modelled device")
    ap.add_argument("--sim-step-cost", default="", help="SIM_STEP_COST for --runner simulated")
    args = ap.parse_args()
    runner = {"runner": args.runner, "sim_step_cost": args.sim_step_cost}
    work = workload(args.requests, args.seed)
    inproc_tok_s, inproc_cpu = inproc(work, runner)
    pipe_tok_s, lat, pipe_cpu = pipeline(work, runner, task_events=args.task_events)
    out = {
        "runner": args.runner,
        "requests": len(work),
        "inproc_tok_s": round(inproc_tok_s, 1),
        "pipeline_tok_s": round(pipe_tok_s, 1),
        "ratio": round(pipe_tok_s / inproc_tok_s, 3),
        "token_latency_ms_p50": round(1000 * percentile(lat, 50), 3),
        "token_latency_ms_p99": round(1000 * percentile(lat, 99), 3),
        "tokens": len(lat),
        "task_events": args.task_events,
        "inproc_cpu": inproc_cpu,
        "pipeline_cpu": pipe_cpu,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
