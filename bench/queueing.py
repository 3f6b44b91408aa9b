"""The queue's promises through the whole stack, swept over a matrix so that no one point can be tuned
for: interactive requests beside a `weightq batch`, a light tenant beside another's flood.

    python -m bench.queueing --json   # [--workers 1,2] [--lengths 16,64,256,512] [--settings default,kv]

Each cell is (settings, workers, job length): `default` is what `weightq up` starts (RUNNER=simulated and
nothing else: the budget from memory, CONCURRENCY task threads, the default step cost), `kv` a small KV
budget that binds first (MAX_BATCH_WEIGHT=8192, MAX_TOTAL_TOKENS=1024, a 20 ms step); the flood's jobs
and the batch's lines ask for `length` tokens each, and there are enough of them to queue well past
what the workers hold (`jobs_for`). The top-level `worst` gives each figure's worst cell: the README's.

A real Redis, the HTTP gateway, `weightq batch` as a user runs it (default flags), and `weightq worker`s
on the simulated device (RUNNER=simulated: a step of SIM_STEP_COST's time, the GIL free as during a GPU
kernel, so capacity is known and the two cores stay for the serving path). Interactive callers are
streaming chat completions through the gateway, one every 0.5 s, 16 tokens; TTFT is the time to the
first token's SSE event. Every HTTP client is bench/lean_http.py's (httpx's CPU on a thousand streams
was the flood's own, on the two cores the stack shares).

- batch: interactive TTFT p50/p99 alone, then while a `weightq batch` (no flags: background) runs;
  the batch's lines/s alone and with the interactive load. Target: TTFT p99 <= max(1.5x solo,
  0.5 s), batch >= 0.9x its solo lines/s.
- tenants: two API keys in one class; one floods streaming completions at once, the other
  sends one every 0.5 s. The light tenant's TTFT alone and beside the flood, through a gateway with fair
  staging (FAIR_QUEUE, the default) and one without (first come, first served), on the same workers;
  the flood's completions/s with each, and `machine_cpu_busy`: the share of the machine's cores in use
  meanwhile (near 1.0 every stage of the stack, and the clients, wait for a core), and `cores_used`: who
  used them (CPU seconds over the flood's wall seconds of the workers' main processes, their engine
  processes, the gateway, Redis, the flooding client and this process, the light client). Target: light TTFT
  p99 <= max(2x solo, 0.5 s), throughput >= 0.95x of first come, first served.
- workers: each worker's share of busy time while anything waited, and the seconds workers idled
  while a queue they take from held a job (`idle_queued_s`, sampled every 0.25 s).
- --shared-prompt N: every batch line starts with the same N-character instruction and the workers keep
  the prefix cache on (PREFIX_CACHE=1), so the batch's running lines hold cached blocks, as a real
  batch with a system prompt does; the interactive requests must still start at once.
- --chat-context N, --chat-tokens M: interactive requests carry N characters of earlier conversation
  and ask for M tokens, so that together they need more than the KV headroom background work leaves
  them (PRIORITY_HEADROOM) and start only by preempting batch lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis
from weightq.cli.processes import ROOT, GatewayProcess, WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.tasks.contract import EntryType, decode_fields, job_key, stream_key

from . import cputime
from .lean_http import LeanHttp

STEP_S = 0.02
SETTINGS = {
    "default": {"runner": "simulated"},
    "kv": {"runner": "simulated", "sim_step_cost": f"{STEP_S},2e-5,0", "max_batch_weight": 8192,
           "max_total_tokens": 1024},
}  # fmt: skip
THREADS = 128  # CONCURRENCY's default: what one worker holds at most


def slots(settings: str, length: int) -> int:
    """About how many jobs of `length` tokens one worker runs at once in `settings` (to size a cell)."""
    if settings == "kv":
        return min(THREADS, 8192 // (length + 32))
    return THREADS


def jobs_for(settings: str, length: int, workers: int, at_least_tokens: int) -> int:
    """Jobs in a flood or lines in a batch: three times what the workers hold at once, and at least
    `at_least_tokens` tokens of work (a quarter of it where KV binds: a tenth of the tokens a step), at
    most 3,000."""
    at_least = at_least_tokens // 4 if settings == "kv" else at_least_tokens
    return min(3000, max(3 * slots(settings, length) * workers, at_least // length))


GATEWAY = {"rate_limit_per_s": 0, "max_concurrent_per_client": 0, "api_key": "light-key,flood-key"}
INTERACTIVE_EVERY_S = 0.5


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else 0.0


SUBMITTED: dict[str, tuple[float, float]] = {}  # a light request's job id -> (sent, first token read), unix s


async def first_token(http: LeanHttp, key: str, body: dict) -> float | None:
    """Seconds to the first token of one streaming request (None: it failed); reads it to the end."""
    t0, sent = time.monotonic(), time.time()
    ttft = None
    try:
        r = await http.post(body.pop("_route"), body, {"Authorization": f"Bearer {key}"})
    except OSError:
        return None
    try:
        if r.status != 200:
            return None
        async for _, line in r.lines():
            if line.startswith(b"data: {"):
                ttft = time.monotonic() - t0
                if key == "light-key":
                    SUBMITTED[json.loads(line[6:])["id"].split("-", 1)[1]] = (sent, time.time())
                break
        await r.drain()
    except (OSError, asyncio.IncompleteReadError):
        return None
    finally:
        r.close()
    return ttft


def light_split(r: redis.Redis) -> dict:
    """Where each light request's TTFT went since the last call, p99 over the requests: the gateway
    until its job was recorded (`queued_at`), then the queue and the engine until its first token was
    written (the stream entry's time), then the token plane until the client read it."""
    parts: dict[str, list[float]] = {"gateway": [], "queue_engine": [], "delivery": []}
    for job_id, (sent, got) in SUBMITTED.items():
        queued = r.hget(job_key(job_id), "queued_at")
        entries = r.xrange(stream_key(job_id), count=3)
        tokens = [
            int(eid.split(b"-")[0]) / 1000 for eid, f in entries if decode_fields(f).get("type") == EntryType.TOKEN
        ]
        if queued is None or not tokens:
            continue
        parts["gateway"].append(float(queued) - sent)
        parts["queue_engine"].append(tokens[0] - float(queued))
        parts["delivery"].append(got - tokens[0])
    SUBMITTED.clear()
    return {f"light_{k}_p99_s": pct(v, 0.99) for k, v in parts.items()}


CHAT = {"context_chars": 0, "max_tokens": 16}  # --chat-context, --chat-tokens


def chat(i: int) -> dict:
    earlier = "Earlier in this conversation: " + "the figures were discussed at length. " * 64
    context = earlier[: CHAT["context_chars"]]
    return {
        "_route": "/v1/chat/completions", "model": "builtin:tiny", "stream": True, "max_tokens": CHAT["max_tokens"],
        "messages": [{"role": "user", "content": f"{context}interactive question {i}: what is next?"}],
    }  # fmt: skip


async def interactive(base: str, until, key: str = "light-key") -> list[float]:
    """One chat request every INTERACTIVE_EVERY_S until `until()` is true; their TTFTs."""
    out: list[float] = []
    http = LeanHttp(base)
    tasks, i = [], 0
    start = time.monotonic()
    while not until():
        tasks.append(asyncio.create_task(first_token(http, key, chat(i))))
        i += 1
        await asyncio.sleep(max(0.0, start + i * INTERACTIVE_EVERY_S - time.monotonic()))
    for t in await asyncio.gather(*tasks):
        if t is not None:
            out.append(t)
    return out


def timed(seconds: float):
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end


def shared_prompt(chars: int) -> str:
    """The instruction every line starts with (--shared-prompt): `chars` characters, the same for all."""
    text = "You are a careful assistant. Summarise the report below in plain words, keeping every figure. "
    return (text * (chars // len(text) + 1))[:chars]


def write_lines(path: Path, n: int, length: int, shared: str = "") -> None:
    with open(path, "w") as f:
        for i in range(n):
            prompt = f"{shared}line {i}: summarise " + "the report " * 8
            f.write(json.dumps({"id": f"l{i}", "prompt": prompt, "max_new_tokens": length}))
            f.write("\n")


class Batch:
    """`weightq batch IN OUT` in a subprocess, as a user runs it (no flags but the output format)."""

    def __init__(self, url: str, home: Path, lines: int, length: int, tag: str, shared: str = "") -> None:
        self.input, self.output = home / f"{tag}.jsonl", home / f"{tag}.out.jsonl"
        write_lines(self.input, lines, length, shared)
        self.lines = lines
        env = dict(os.environ, REDIS_URL=url, WEIGHTQ_HOME=str(home))
        self.t0 = time.monotonic()
        cmd = [
            sys.executable,
            "-m",
            "weightq.cli",
            "batch",
            str(self.input),
            "-o",
            str(self.output),
            "--json",
            "--no-progress",
        ]
        self.log = home / f"{tag}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.elapsed: float | None = None

    def done(self) -> bool:
        if self.proc.poll() is None:
            return False
        if self.elapsed is None:
            self.elapsed = time.monotonic() - self.t0
        return True

    def lines_s(self) -> float:
        if self.proc.wait() != 0:
            raise RuntimeError(f"weightq batch exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        self.done()
        return round(self.lines / self.elapsed, 1)


def flood(base: str, n: int, length: int, results) -> None:
    """n streaming completions from the flooding tenant at once (a process of its own, so that its
    reading never delays the light tenant's clock); puts (seconds to finish all, failures, its CPU
    seconds from its first request: it has exited before the caller could read them)."""

    async def run() -> tuple[float, int, float]:
        http = LeanHttp(base)
        t0, cpu = time.monotonic(), time.process_time()
        body = {"_route": "/v1/completions", "model": "builtin:tiny", "stream": True, "max_tokens": length}
        outs = await asyncio.gather(
            *(first_token(http, "flood-key", body | {"prompt": f"flood {i}: " + "go on " * 10}) for i in range(n))
        )
        return time.monotonic() - t0, sum(o is None for o in outs), time.process_time() - cpu

    results.put(asyncio.run(run()))


def cores_used(before: dict, after: dict, wall_s: float) -> dict[str, float]:
    """Cores each part of the stack used between two `cputime.snapshot`s: a worker's engine process is
    its descendant ("worker<i>/<name>"), summed apart from the workers' main processes."""
    spent: dict[str, float] = {}
    for key, (label, t1) in after.items():
        if key in before:
            role = label.split("/")[0]
            part = "workers_engine" if role.startswith("worker") and "/" in label else role.rstrip("0123456789")
            part = "workers_main" if part == "worker" else part
            spent[part] = spent.get(part, 0.0) + t1 - before[key][1]
    return {k: round(v / wall_s, 3) for k, v in sorted(spent.items())}


def tenants(base: str, n: int, length: int, r: redis.Redis, roles: dict[str, int]) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=flood, args=(base, n, length, results))
    proc.start()
    cpu, parts, me, t0 = cputime.machine(), cputime.snapshot(roles), psutil.Process(), time.monotonic()
    mine = sum(me.cpu_times()[:2])
    time.sleep(1.0)  # the flood is queued
    light = asyncio.run(interactive(base, lambda: not proc.is_alive() or not results.empty()))
    took, failed, flood_cpu = results.get()
    busy, wall = cputime.machine_busy(cpu, cputime.machine()), time.monotonic() - t0
    used = cores_used(parts, cputime.snapshot(roles), wall)
    used["flood_client"] = round(flood_cpu / wall, 3)
    used["light_client"] = round((sum(me.cpu_times()[:2]) - mine) / wall, 3)
    proc.join()
    split = light_split(r)
    return {"light_ttft_p50_s": pct(light, 0.5), "light_ttft_p99_s": pct(light, 0.99), "light_requests": len(light),
            **split,
            "flood_jobs_s": round(n / took, 2), "flood_failed": failed, "machine_cpu_busy": busy,
            "cores_used": used}  # fmt: skip


def worker_report(workers: list[WorkerProcess]) -> dict:
    stats = [w.stats() for w in workers]
    return {
        "idle_queued_s": round(sum(s.get("idle_queued_s", 0.0) for s in stats), 2),
        "jobs_each": [s.get("metrics", {}).get("jobs_finished", s.get("finished", 0)) for s in stats],
        "stolen": sum(s.get("stolen", 0) for s in stats),
    }


def cluster(setting: str, n_workers: int, args) -> list[dict]:
    """One stack of `setting` on `n_workers` workers; a cell for each job length."""
    home = Path(tempfile.mkdtemp(prefix=f"weightq-queueing-{setting}-{n_workers}-"))
    server = EmbeddedRedis(home / "redis")
    url = server.start()
    worker = SETTINGS[setting] | ({"prefix_cache": 1} if args.shared_prompt else {})
    workers = [WorkerProcess(url, f"q{i}@bench", home, **worker) for i in range(n_workers)]
    fair = GatewayProcess(url, home, **GATEWAY)
    fifo = GatewayProcess(url, home, fair_queue=0, **GATEWAY)
    try:
        for w in workers:
            w.wait_ready()
        fair.wait_ready()
        fifo.wait_ready()
        asyncio.run(interactive(fair.base, timed(2.0)))  # warm
        solo = asyncio.run(interactive(fair.base, timed(args.seconds)))  # the light tenant's and chats' alone
        roles = {f"worker{i}": w.proc.pid for i, w in enumerate(workers)} | {"redis": server.proc.pid}
        cells = []
        for length in (int(x) for x in args.lengths.split(",")):
            if args.only and f"{setting}/{n_workers}/{length}" not in args.only.split(","):
                continue
            cell: dict = {"settings": setting, "workers": n_workers, "length": length}
            if "batch" in args.scenarios:
                cell["batch"] = web_beside_batch(url, home, fair, solo, setting, length, n_workers, args)
            if "tenants" in args.scenarios:
                cell["tenants"] = two_tenants(url, fair, fifo, solo, setting, length, n_workers, roles)
            cell["workers_report"] = worker_report(workers)
            cells.append(cell)
            print(json.dumps(cell), file=sys.stderr, flush=True)
        return cells
    finally:
        fair.stop()
        fifo.stop()
        for w in workers:
            w.kill()
        server.stop()


def web_beside_batch(
    url: str, home: Path, fair: GatewayProcess, solo: list[float], setting: str, length: int, workers: int, args
) -> dict:
    lines = jobs_for(setting, length, workers, 192_000)
    shared = shared_prompt(args.shared_prompt) if args.shared_prompt else ""
    alone = Batch(url, home, lines, length, f"alone{length}", shared)
    while not alone.done():
        time.sleep(0.2)
    batch_alone = alone.lines_s()
    beside = Batch(url, home, lines, length, f"beside{length}", shared)
    time.sleep(1.0)  # the batch has filled the workers
    mixed = asyncio.run(interactive(fair.base, beside.done))
    batch_mixed = beside.lines_s()
    out = {
        "lines": lines,
        "interactive_solo_p50_s": pct(solo, 0.5), "interactive_solo_p99_s": pct(solo, 0.99),
        "interactive_beside_batch_p50_s": pct(mixed, 0.5), "interactive_beside_batch_p99_s": pct(mixed, 0.99),
        "interactive_requests": len(mixed),
        "ttft_p99_target_s": round(max(1.5 * pct(solo, 0.99), 0.5), 3),
        "batch_lines_s_alone": batch_alone, "batch_lines_s_beside_interactive": batch_mixed,
        "batch_vs_alone": round(batch_mixed / batch_alone, 3),
    }  # fmt: skip
    out["within_targets"] = out["interactive_beside_batch_p99_s"] <= out["ttft_p99_target_s"] and (
        out["batch_vs_alone"] >= 0.9
    )
    return out


def two_tenants(
    url: str,
    fair: GatewayProcess,
    fifo: GatewayProcess,
    solo: list[float],
    setting: str,
    length: int,
    workers: int,
    roles: dict[str, int],
) -> dict:
    n = min(1000, jobs_for(setting, length, workers, 64_000))
    r = redis.Redis.from_url(url)
    SUBMITTED.clear()
    with_fair = tenants(fair.base, n, length, r, roles | {"gateway": fair.proc.pid})
    with_fifo = tenants(fifo.base, n, length, r, roles | {"gateway": fifo.proc.pid})
    target = max(2 * pct(solo, 0.99), 0.5)
    out = {
        "flood": n, "light_solo_p50_s": pct(solo, 0.5), "light_solo_p99_s": pct(solo, 0.99),
        "fair": with_fair, "fifo": with_fifo,
        "light_p99_target_s": round(target, 3),
        "throughput_fair_vs_fifo": round(with_fair["flood_jobs_s"] / with_fifo["flood_jobs_s"], 3),
    }  # fmt: skip
    out["within_targets"] = with_fair["light_ttft_p99_s"] <= target and out["throughput_fair_vs_fifo"] >= 0.95
    return out


def worst(cells: list[dict]) -> dict:
    """Each target's worst cell: the figure and where (settings/workers/length)."""
    picks = {
        "interactive_beside_batch_p99_s": ("batch", lambda c: c["interactive_beside_batch_p99_s"], max),
        "batch_vs_alone": ("batch", lambda c: c["batch_vs_alone"], min),
        "light_ttft_p99_s": ("tenants", lambda c: c["fair"]["light_ttft_p99_s"], max),
        "throughput_fair_vs_fifo": ("tenants", lambda c: c["throughput_fair_vs_fifo"], min),
    }
    out: dict = {}
    for name, (scenario, get, pick) in picks.items():
        have = [c for c in cells if scenario in c]
        if have:
            c = pick(have, key=lambda c: get(c[scenario]))
            out[name] = {"value": get(c[scenario]), "cell": f"{c['settings']}/{c['workers']}w/{c['length']}"}
    out["cells_within_targets"] = sum(
        all(c[s]["within_targets"] for s in ("batch", "tenants") if s in c) for c in cells
    )
    out["cells"] = len(cells)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--lengths", default="16,64,256,512", help="tokens each flood job and batch line asks for")
    ap.add_argument("--settings", default="default,kv", help=f"of {', '.join(SETTINGS)}")
    ap.add_argument("--only", default="", help="cells to run, as settings/workers/length,... (default: all)")
    ap.add_argument("--seconds", type=float, default=15.0, help="the interactive load alone")
    ap.add_argument("--scenarios", default="batch,tenants")
    ap.add_argument("--shared-prompt", type=int, default=0, help="characters of instruction every batch line shares")
    ap.add_argument("--chat-context", type=int, default=0, help="characters of conversation each chat carries")
    ap.add_argument("--chat-tokens", type=int, default=16, help="tokens each chat asks for")
    args = ap.parse_args()
    CHAT.update(context_chars=args.chat_context, max_tokens=args.chat_tokens)
    cells = []
    for setting in args.settings.split(","):
        for n in (int(x) for x in args.workers.split(",")):
            if not args.only or any(c.startswith(f"{setting}/{n}/") for c in args.only.split(",")):
                cells += cluster(setting, n, args)
    out = {
        "bench": "queueing",
        "runner": "simulated",
        "settings": {k: SETTINGS[k] for k in args.settings.split(",")},
        "shared_prompt_chars": args.shared_prompt,
        "chat_context_chars": args.chat_context,
        "chat_tokens": args.chat_tokens,
        "prefix_cache": bool(args.shared_prompt),
        "worst": worst(cells),
        "cells": cells,
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
