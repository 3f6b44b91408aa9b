"""The path a web app uses, end to end: N concurrent streaming OpenAI requests through the gateway,
Celery and Redis to a worker, against the same engine in-process and vLLM's own server.

    python -m bench.serve --json                 # 256 concurrent requests
    python -m bench.serve --n 256,1024 --json

Workload: bench.engine's (prompts of 16-256 random token ids, 8-128 new tokens, greedy, EOS ignored,
fixed seed), sent as `/v1/completions` with `prompt` as token ids and `stream: true`, all at once.
- serve: a real stack (the embedded redis-server, one `weightq worker` with CONCURRENCY >= N, the
  gateway), started once; each round drives every request from one asyncio client in this process.
- inproc: `Engine.generate()` in this process on the same requests (the stack idle meanwhile).
- vllm: vLLM's OpenAI server on the same model directory and requests, when the peer venv exists
  (`make peer`); same client.
With --runner simulated both sides run the simulated device (engine/runner/simulated.py; no vLLM) and report
device_busy_pct: modelled device time / the engine's occupied time (first request in -> last one
out; engine stats `occupied_s`, from the worker's heartbeats on the stack), and device_busy_wall_pct:
the same device time over the client's wall time (the stack: first request sent -> last token
received, so intake and delivery count as idle; in-process: the generate() call).
After one untimed round of the workload on each side, rounds alternate serve / inproc / vllm;
figures are medians over rounds. Reported per system: output tokens/s (tokens of requests that
finished / wall time from the first request sent to the last token received), TTFT p50/p99
(request sent -> first token), inter-token p50/p99 (gaps between a request's streamed chunks),
errors; and the ratios serve / inproc and serve / vllm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import torch
from weightq.batcher import BatcherConfig
from weightq.batcher.sim.simulator import percentile
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis, free_port
from weightq.engine import Engine, EngineConfig
from weightq.engine.model import builtin_path
from weightq.settings import Settings
from weightq.tasks.contract import EntryType, job_key, stream_key

from . import cputime
from .engine import requests, workload
from .lean_http import LeanHttp
from .peer_client import omp_bind, peer_problem, peer_python

BUDGET = 65536  # KV tokens: every request of 256 fits at once; 1,024 queue behind it on both sides


async def _one(client: LeanHttp, model: str, ids: list[int], n: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    sent = time.time()
    arrivals: list[float] = []
    event_ids: list[str] = []  # the SSE id of each chunk (ours: "<job id>/<entry id>"; vLLM sends none)
    finish = None
    event_id = ""
    try:
        async for now, line in client.stream("/v1/completions", body):
            if line.startswith(b"id: "):
                event_id = line[4:].decode()
            if not line.startswith(b"data: {"):
                continue
            try:
                choices = json.loads(line[6:]).get("choices") or []
            except ValueError as e:
                return {"error": f"bad JSON ({e}): {line[:300]!r}"}
            if choices:
                arrivals.append(now)
                event_ids.append(event_id)
                finish = choices[0].get("finish_reason") or finish
    except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError) as e:
        return {"error": repr(e)}
    if finish != "length" or not arrivals:
        return {"error": f"finish_reason {finish!r} after {len(arrivals)} chunks"}
    return {"sent": sent, "arrivals": arrivals, "event_ids": event_ids, "tokens": n}


async def _drive(base: str, model: str, work) -> list[dict]:
    client = LeanHttp(base)
    return await asyncio.gather(*(_one(client, model, ids, n) for ids, n in work))


def drive(base: str, model: str, work, redis_client=None, processes: dict[str, int] | None = None) -> dict:
    """One round of every request at once; the figures of that round (and where a token's time went,
    given the stack's Redis; and each server process's CPU per 1,000 streamed tokens, given their pids
    by role)."""
    if redis_client is not None:
        redis_client.config_resetstat()  # its commandstats count this round alone
    cpu0 = cputime.snapshot(processes or {})
    results = asyncio.run(_drive(base, model, work))
    cpu1 = cputime.snapshot(processes or {})
    commandstats = redis_client.info("commandstats") if redis_client is not None else None  # before stages' reads
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    if not ok:
        return {"tok_s": 0.0, "errors": len(errors), "first_error": errors[0] if errors else None}
    start = min(r["sent"] for r in ok)
    end = max(r["arrivals"][-1] for r in ok)
    ttft = [r["arrivals"][0] - r["sent"] for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    tokens = sum(r["tokens"] for r in ok)
    chunks = sum(len(r["arrivals"]) for r in ok)  # the ITL figures are gaps between chunks
    cpu = cputime.per_1000_tokens(cpu0, cpu1, tokens) if processes else {}
    redis_time = {} if commandstats is None else {"redis_command_us_per_1000_tokens": commands(commandstats, tokens)}
    return (stages(redis_client, ok) if redis_client is not None else {}) | {
        "tok_s": tokens / (end - start),
        "wall_s": end - start,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": percentile(gaps, 50) * 1000 if gaps else None,
        "itl_p99_ms": percentile(gaps, 99) * 1000 if gaps else None,
        "tokens_per_chunk": round(tokens / chunks, 2),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        **({"cpu_ms_per_1000_tokens": cpu} if cpu else {}),
        **redis_time,
    }


def stages(redis_client, results: list[dict]) -> dict:
    """Where a streamed token's time goes, from the stream entries behind the SSE ids: the engine's
    emit stamp (`ts`) -> written to Redis (the entry id's millisecond, taken at its middle: the floor
    would read 0.5 ms early on average) -> received by the HTTP client;
    and where a first token's goes: request sent -> job recorded (its `queued_at`) -> first emit."""
    emit_write: list[float] = []
    write_client: list[float] = []
    intake: list[float] = []  # request sent -> job recorded in Redis (gateway and submit)
    to_first: list[float] = []  # job recorded -> first token emitted (broker, worker, batcher, prefill)
    to_start: list[float] = []  # job recorded -> its task began (broker and Celery's consumer)
    start_to_first: list[float] = []  # task began -> first token emitted (engine queue, batcher, prefill)
    for r in results:
        if "error" in r or not r["event_ids"][0]:
            continue
        job_id = r["event_ids"][0].partition("/")[0]
        entries = redis_client.xrange(stream_key(job_id))
        stamps = {eid.decode(): float(f[b"ts"]) for eid, f in entries if b"ts" in f}
        if (queued := redis_client.hget(job_key(job_id), "queued_at")) is not None and stamps:
            intake.append(float(queued) - r["sent"])
            to_first.append(min(stamps.values()) - float(queued))
            attempt = EntryType.ATTEMPT.encode()
            begun = [int(eid.split(b"-")[0]) / 1000 for eid, f in entries if f.get(b"type") == attempt]
            if begun:  # the task began (its attempt entry): broker + consumer, then worker + engine
                to_start.append(begun[0] - float(queued))
                start_to_first.append(min(stamps.values()) - begun[0])
        for arrived, event_id in zip(r["arrivals"], r["event_ids"], strict=True):
            entry = event_id.partition("/")[2]
            if entry not in stamps:
                continue
            written = (int(entry.split("-")[0]) + 0.5) / 1000  # ids count whole ms: the middle of its ms
            emit_write.append(written - stamps[entry])
            write_client.append(arrived - written)
    if not emit_write:
        return {}
    ms = lambda xs, q: round(1000 * percentile(xs, q), 2)  # noqa: E731
    return {
        **({"sent_to_queued_p50_ms": ms(intake, 50), "sent_to_queued_p99_ms": ms(intake, 99)} if intake else {}),
        **({"queued_to_first_emit_p50_ms": ms(to_first, 50)} if to_first else {}),
        **(
            {
                "queued_to_started_p50_ms": ms(to_start, 50),
                "queued_to_started_p99_ms": ms(to_start, 99),
                "started_to_first_emit_p50_ms": ms(start_to_first, 50),
            }
            if to_start
            else {}
        ),
        "emit_to_redis_p50_ms": ms(emit_write, 50),
        "emit_to_redis_p99_ms": ms(emit_write, 99),
        "redis_to_client_p50_ms": ms(write_client, 50),
        "redis_to_client_p99_ms": ms(write_client, 99),
        "emit_to_client_p50_ms": ms([a + b for a, b in zip(emit_write, write_client, strict=True)], 50),
        "emit_to_client_p99_ms": ms([a + b for a, b in zip(emit_write, write_client, strict=True)], 99),
    }


def inproc(engine: Engine, work) -> dict:
    reqs = requests(work, f"r{time.monotonic_ns()}-")
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wall = time.perf_counter() - t0
    after = engine.stats()
    return {"tok_s": sum(len(o.token_ids) for o in outs) / wall, **busy(before, after, wall)}


def busy(before: dict, after: dict, wall: float) -> dict:
    """Device busy %: modelled (or forward) device time over the engine's occupied time (first
    request in -> last one out, as the issue defines it), and over the client's wall time."""
    device = after["forward_s"] - before["forward_s"]
    occupied = after["occupied_s"] - before["occupied_s"]
    return {
        "device_busy_pct": round(100 * device / occupied, 2) if occupied > 0 else None,
        "device_busy_wall_pct": round(100 * device / wall, 2),
    }


def served(worker: WorkerProcess, base: str, model: str, work, processes: dict[str, int]) -> dict:
    """One round through the stack, with the worker's device time over it (from its heartbeats: the
    modelled device time on the simulated runner, the forward passes' on a real one)."""
    before = worker.wait_stats(lambda s: s.get("running", 1) == 0 and s.get("active_jobs", 1) == 0, timeout=300)
    figures = drive(base, model, work, worker.redis, processes)
    goal = before["finished"] + len(work) - figures["errors"]
    after = worker.wait_stats(lambda s: s.get("finished", 0) >= goal, timeout=300)
    if figures.get("wall_s"):
        figures |= busy(before, after, figures["wall_s"])
    return figures


def commands(stats: dict, tokens: float) -> dict[str, float]:
    """Where Redis's time went (INFO commandstats, reset as the round began), per 1,000 streamed
    tokens: the script calls (the stream writes among them), the gateway's XREADs, and the rest. A
    command a script runs counts in the script's time and in its own line too, so the lines overlap."""
    us = {name.removeprefix("cmdstat_"): v["usec"] * 1000 / tokens for name, v in stats.items()}
    top = dict(sorted(us.items(), key=lambda kv: -kv[1])[:6])
    return {k: round(v, 1) for k, v in top.items()}


def _engine(label: str) -> bool:
    """A process of the engine: our worker's engine process (a multiprocessing child of the worker);
    vLLM's engine core (its scheduler: VLLM::EngineCore) and the worker that runs its model
    (VLLM::Worker). Outside it: our gateway, worker main process and Redis; vLLM's API server."""
    return label.startswith("worker/") or "EngineCore" in label or "VLLM::Worker" in label


class VllmServer:
    """vLLM's OpenAI server from the peer venv, on the built-in tiny model's directory."""

    def __init__(self, python: Path, model_dir: Path, threads: int, log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        # vLLM's CPU KV space is in GiB; the tiny model's KV per token is small, so 1 GiB holds far
        # more than the budget: the server is not memory-bound here, as ours is not.
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--dtype", "float32",
               "--max-model-len", "2048", "--port", str(self.port)]  # fmt: skip
        # The same intra-op threads as our worker (torch's default: one per core), bound as bench.peer does.
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": omp_bind(threads)}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), env=env, stdout=out, stderr=out)
        self.log = log

    def wait_ready(self, timeout: float = 600) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM's server did not answer in {timeout} s; see {self.log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def medians(rounds: list[dict]) -> dict:
    keys = [k for k in rounds[0] if isinstance(rounds[0][k], (int, float)) and k != "errors"]
    out = {k: round(statistics.median(r[k] for r in rounds if r.get(k) is not None), 3) for k in keys}
    if all("cpu_ms_per_1000_tokens" in r for r in rounds):
        labels = {k for r in rounds for k in r["cpu_ms_per_1000_tokens"]}
        cpu = {k: round(statistics.median(r["cpu_ms_per_1000_tokens"].get(k, 0.0) for r in rounds), 1) for k in labels}
        out["cpu_ms_per_1000_tokens"] = dict(sorted(cpu.items()))
        out["outside_engine_cpu_ms_per_1000_tokens"] = round(sum(v for k, v in cpu.items() if not _engine(k)), 1)
    if all("redis_command_us_per_1000_tokens" in r for r in rounds):
        names = {k for r in rounds for k in r["redis_command_us_per_1000_tokens"]}
        by = {k: round(statistics.median(r["redis_command_us_per_1000_tokens"].get(k, 0.0) for r in rounds), 1)
              for k in names}  # fmt: skip
        out["redis_command_us_per_1000_tokens"] = dict(sorted(by.items(), key=lambda kv: -kv[1]))
    out["errors"] = sum(r.get("errors", 0) for r in rounds)
    firsts = [r["first_error"] for r in rounds if r.get("first_error")]
    if firsts:
        out["first_error"] = firsts[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="256", help="concurrent requests per case, comma-separated (default 256)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-python", default=None, help="the peer venv's python (default .venv-peer/bin/python)")
    ap.add_argument("--no-peer", action="store_true", help="skip vLLM even if the peer venv exists")
    ap.add_argument(
        "--runner", default="auto", choices=["auto", "simulated"], help="simulated: the modelled device (no vLLM)"
    )
    ap.add_argument("--sim-step-cost", default="", help="SIM_STEP_COST for --runner simulated")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sizes = [int(x) for x in args.n.split(",")]
    python = peer_python(args.peer_python)
    problem = "--no-peer" if args.no_peer else peer_problem(python)
    if args.runner == "simulated":
        problem = "the simulated device has no vLLM counterpart"
    runner = {"runner": args.runner, "sim_step_cost": args.sim_step_cost}
    out: dict = {
        "bench": "serve",
        "runner": args.runner,
        "budget_kv_tokens": BUDGET,
        "stream_flush_ms": Settings.from_env().stream.flush_ms,  # the worker's (it inherits this environment)
        "rounds": args.rounds,
        "cases": [],
    }
    if problem:
        out["vllm_skipped"] = problem
    home = Path(tempfile.mkdtemp(prefix="weightq-serve-"))
    server = EmbeddedRedis(home / "redis", appendfsync="everysec")
    url = server.start()
    worker = WorkerProcess(url, "serve@bench", home, max_batch_weight=BUDGET, concurrency=max(sizes) + 64, **runner)
    gateway = GatewayProcess(url, home)
    vllm = None
    try:
        worker.wait_ready()
        gateway.wait_ready()
        engine = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=BUDGET), **runner))
        model = "builtin:tiny"
        if not problem:
            vllm = VllmServer(python, builtin_path("tiny"), torch.get_num_threads(), home / "vllm.log").wait_ready()
        for n in sizes:
            work = workload(n, args.seed)
            # Warm-up: one untimed round of the whole workload on every side. A first round at a new size
            # ran 35-45% slower than the next ones, in-process and through the stack alike.
            warm = work
            drive(gateway.base, model, warm)
            inproc(engine, warm)
            if vllm:
                drive(vllm.base, vllm.model, warm)
            serve_r, inproc_r, vllm_r = [], [], []
            for _ in range(args.rounds):
                stack = {"gateway": gateway.proc.pid, "worker": worker.proc.pid, "redis": server.proc.pid}
                serve_r.append(served(worker, gateway.base, model, work, stack))
                inproc_r.append(inproc(engine, work))
                if vllm:
                    vllm_r.append(drive(vllm.base, vllm.model, work, processes={"vllm": vllm.proc.pid}))
            case = {"n": n, "serve": medians(serve_r), "inproc": medians(inproc_r)}
            case["serve_over_inproc"] = round(case["serve"]["tok_s"] / case["inproc"]["tok_s"], 3)
            if vllm:
                case["vllm"] = medians(vllm_r)
                case["serve_over_vllm"] = round(case["serve"]["tok_s"] / case["vllm"]["tok_s"], 3)
            out["cases"].append(case)
    finally:
        if vllm:
            vllm.stop()
        gateway.stop()
        worker.stop()
        worker.kill()
        server.stop()
    print(json.dumps(out, indent=1 if args.json else None))


if __name__ == "__main__":
    main()
