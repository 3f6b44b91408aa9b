"""Prefix affinity on the pull queue: do N workers' prefix caches act as one cache of their summed size?

    python -m bench.affinity --json        # [--rounds 2] [--requests 512] [--step-cost ...]

Real parts: an embedded Redis and `weightq worker` processes on the simulated device (RUNNER=simulated:
the real batcher, KV blocks and prefix cache, Celery and streams; the forward pass is a modelled wait,
SIM_STEP_COST, whose per-token term makes prefill cost real so that caching matters). Three clusters
run side by side, each on its own QUEUE: one worker with 32,768 KV tokens (the baseline), two with
16,384 each, four with 8,192 each. Loads (fixed seeds, fresh prefixes every run so that no run finds
the last one's cache):
- shared: 512 text prompts over 32 shared prefixes of ~768 tokens (24.6k tokens of prefixes: more than
  one small worker holds), each plus a question of 24-48 tokens, answering 16-32 tokens; all at once;
- multiturn: 24 conversations (a ~640-token opening each), 4 turns (~20k tokens of context at the
  end); each turn's prompt is the last one's, its answer and a new question; a turn is sent once
  every conversation's previous one ended.
Each round runs every (cluster, affinity on/off) pair once, in an order that rotates; the 2- and
4-worker clusters run the same load with the client's AFFINITY on and off (off: today's single queue).
Reported, medians over rounds: cached prompt tokens (usage.prompt_tokens_details.cached_tokens) as a
ratio to the one-worker baseline's (target >= 0.8), output tok/s (wall time from the first submit to the
last result) and its ratio on/off (target at 4 workers >= 1.3), the jobs stolen, and each worker's
busy share (wall time its engine held requests / the run's wall time): no worker idles while work it
could take is queued if every share stays near 1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from weightq.cli.processes import WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client
from weightq.settings import Settings

CLUSTERS = {"one": (1, 32768), "two": (2, 16384), "four": (4, 8192)}
STEP_COST = "0.004,6e-5,0"  # 4 ms a step, 60 us a token fed (a 7B model on one A100-class GPU: StepCost)
WORDS = [a + b for a in ("ka", "lo", "mi", "su", "te", "ra", "no", "vi", "de", "po") for b in ("n", "s", "l", "", "r")]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def text_of_tokens(tok, rng: random.Random, tokens: int) -> str:
    """Random words, about `tokens` tokens long in the model's tokenizer."""
    text = words(rng, tokens // 2)
    while len(tok.encode(text, add_special_tokens=False)) < tokens:
        text += " " + words(rng, 8)
    return text


def shared_load(tok, seed: int, n: int, prefixes: int = 32, prefix_tokens: int = 768) -> list[dict]:
    rng = random.Random(seed)
    heads = [f"[{seed}:{i}] " + text_of_tokens(tok, rng, prefix_tokens) for i in range(prefixes)]
    return [
        {"prompt": rng.choice(heads) + " Q: " + words(rng, rng.randint(12, 24)), "max_new_tokens": rng.randint(16, 32)}
        for _ in range(n)
    ]


def openings(tok, seed: int, n: int = 24, tokens: int = 640) -> list[str]:
    rng = random.Random(seed)
    return [f"[{seed}:{i}] " + text_of_tokens(tok, rng, tokens) for i in range(n)]


def worker_stats(workers: list[WorkerProcess], after: float) -> dict[str, dict]:
    """Each worker's first heartbeat written after `after` (unix s)."""
    return {w.name: w.wait_stats(lambda s: s.get("ts", 0) > after, timeout=60) for w in workers}


def measure(workers: list[WorkerProcess], send) -> dict:
    """Run `send()` (which returns the results), with the workers' counters around it."""
    before = worker_stats(workers, time.time())
    t0 = time.perf_counter()
    results = send()
    wall = time.perf_counter() - t0
    after = worker_stats(workers, time.time() + 0.2)
    usage = [r["usage"] for r in results]
    busy = {n: (after[n]["occupied_s"] - before[n]["occupied_s"]) / wall for n in after}
    return {
        "requests": len(results),
        "prompt_tokens": sum(u["prompt_tokens"] for u in usage),
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage),
        "tok_s": sum(u["completion_tokens"] for u in usage) / wall,
        "wall_s": wall,
        "stolen": sum(after[n]["stolen"] - before[n]["stolen"] for n in after),
        "idle_queued_s": sum(after[n]["idle_queued_s"] - before[n]["idle_queued_s"] for n in after),
        "busy_min": min(busy.values()),
        "busy": [round(b, 3) for b in busy.values()],
    }


def run_shared(client: Client, workers, requests: list[dict]) -> dict:
    def send():
        return [job.result(timeout=600) for job in client.submit_many(requests)]

    return measure(workers, send)


def run_multiturn(client: Client, workers, heads: list[str], turns: int, seed: int) -> dict:
    rng = random.Random(seed)

    def send():
        prompts, results = list(heads), []
        for _ in range(turns):
            asks = [p + " Q: " + words(rng, rng.randint(12, 24)) + " A:" for p in prompts]
            jobs = client.submit_many([{"prompt": a, "max_new_tokens": 24} for a in asks])
            done = [job.result(timeout=600) for job in jobs]
            prompts = [a + r["text"] for a, r in zip(asks, done, strict=True)]
            results += done
        return results

    return measure(workers, send)


def start(url: str, home: Path, cost: str) -> dict[str, list[WorkerProcess]]:
    clusters = {}
    worker = dict(runner="simulated", sim_step_cost=cost, engine_process="off", concurrency=128, task_events=0)
    for name, (n, kv) in CLUSTERS.items():
        queue = f"bench-{name}"
        clusters[name] = [
            WorkerProcess(url, f"{name}{i}@bench", home, queue=queue, max_batch_weight=kv, **worker) for i in range(n)
        ]
    for ws in clusters.values():
        for w in ws:
            w.wait_ready()
    return clusters


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--step-cost", default=STEP_COST)
    args = ap.parse_args()
    from transformers import AutoTokenizer
    from weightq.engine.model.builtin import builtin_path

    tok = AutoTokenizer.from_pretrained(builtin_path("tiny"))
    cases = [("one", True), ("two", True), ("two", False), ("four", True), ("four", False)]
    runs: dict[str, dict[str, list[dict]]] = {"shared": {}, "multiturn": {}}
    with tempfile.TemporaryDirectory() as home, EmbeddedRedis(Path(home) / "redis", appendfsync="everysec") as server:
        clusters = start(server.url, Path(home), args.step_cost)
        try:
            for r in range(args.rounds):
                order = cases[r % len(cases) :] + cases[: r % len(cases)]
                for i, (name, on) in enumerate(order):
                    tag = f"{name}-{'on' if on else 'off'}"
                    settings = Settings(redis_url=server.url, queue=f"bench-{name}", affinity=on)
                    client = Client(server.url, settings=settings)
                    seed = 1000 * r + 10 * i
                    load = shared_load(tok, seed, args.requests)
                    runs["shared"].setdefault(tag, []).append(run_shared(client, clusters[name], load))
                    heads = openings(tok, seed + 1, args.conversations)
                    got = run_multiturn(client, clusters[name], heads, args.turns, seed + 2)
                    runs["multiturn"].setdefault(tag, []).append(got)
                    print(tag, json.dumps(runs["shared"][tag][-1]), json.dumps(got), file=sys.stderr, flush=True)
        finally:
            for ws in clusters.values():
                for w in ws:
                    w.stop()
    print(json.dumps(report(runs, args), indent=None if not args.json else 1))


def report(runs: dict, args) -> dict:
    out: dict = {
        "setup": {
            "runner": "simulated",
            "sim_step_cost": args.step_cost,
            "clusters": {k: {"workers": n, "kv_tokens_each": kv} for k, (n, kv) in CLUSTERS.items()},
            "rounds": args.rounds,
            "shared": f"{args.requests} requests over 32 prefixes of ~768 tokens",
            "multiturn": f"{args.conversations} conversations x {args.turns} turns",
        }
    }
    for load, by_case in runs.items():
        base = median(by_case["one-on"], "cached_tokens")
        section = {}
        for tag, rs in by_case.items():
            section[tag] = {
                "cached_tokens": median(rs, "cached_tokens"),
                "prompt_tokens": median(rs, "prompt_tokens"),
                "cached_vs_one_worker": round(median(rs, "cached_tokens") / base, 3) if base else None,
                "tok_s": round(median(rs, "tok_s"), 1),
                "stolen": median(rs, "stolen"),
                "idle_queued_s": round(median(rs, "idle_queued_s"), 2),
                "busy_min": round(median(rs, "busy_min"), 3),
                "busy_last_round": rs[-1]["busy"],
            }
        for n in ("two", "four"):
            on, off = by_case[f"{n}-on"], by_case[f"{n}-off"]
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(on, off, strict=True)]
            section[f"{n}_tok_s_on_vs_off"] = round(statistics.median(ratios), 3)
        out[load] = section
    return out


if __name__ == "__main__":
    main()
