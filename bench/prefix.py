"""Prefix caching: the same requests with the cache on and off, and vLLM with its own, in one run.

    python -m bench.prefix --json        # [--requests 512] [--rounds 2] [--no-peer]

Workload (fixed seed): 8 system prompts of 1,150-1,250 random token ids, each request one of them plus
a user turn of 16-64 ids, answering 8-32 tokens (greedy, EOS ignored), all submitted at once, on the
built-in tiny model (2,048-token context). Both weightq engines and vLLM get the same KV budget
(32,768 tokens). Each round runs every side once, in an order that rotates; each side starts cold
(weightq drops its idle cached blocks, vLLM resets its prefix cache), so a round measures caching
within the workload, not from the round before.
- on / off: output tokens/s (wall time of one `generate` over the workload), TTFT p50/p99 (submission
  to first token; every request is submitted at t=0), prompt tokens computed (prefilled) and
  prompt tokens found in the cache; medians over rounds.
- speedup = on / off tok/s; ttft_p50_ratio = on / off TTFT p50 (targets: >= 2, <= 0.3).
- vllm: its tok/s and cached tokens (its offline API reports no TTFT); vs_vllm = on / vLLM tok/s.
- identical_on_off: requests whose output token ids are the same with the cache on and off (round 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.engine.model import builtin_path

from .peer_client import PeerError, VllmPeer, omp_bind, peer_problem, peer_python

KV_TOKENS = 32768
PEER_BLOCK = 32


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 1100) for _ in range(rng.randint(1150, 1250))] for _ in range(8)]
    return [
        (rng.choice(systems) + [rng.randrange(10, 1100) for _ in range(rng.randint(16, 64))], rng.randint(8, 32))
        for _ in range(n)
    ]


def run_weightq(engine: Engine, work, tag: str) -> dict:
    engine.reset_prefix_cache()
    before = engine.counters["prefill_tokens"]
    reqs = [
        GenerationRequest(f"{tag}{i}", prompt_token_ids=ids, params=SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (ids, n) in enumerate(work)
    ]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    dt = time.perf_counter() - t0
    ttft = sorted(r.ttft_s for r in results)
    return {
        "tok_s": sum(r.completion_tokens for r in results) / dt,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "prompt_tokens_computed": engine.counters["prefill_tokens"] - before,
        "cached_tokens": sum(r.cached_tokens for r in results),
        "ids": [list(r.token_ids) for r in results],
    }


def median_of(rounds: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rounds), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true", help="skip vLLM even when the peer venv exists")
    ap.add_argument("--peer-python", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    work = workload(args.requests, args.seed)
    warm = work[:4]
    engines = {}
    for side, on in (("on", True), ("off", False)):
        engines[side] = Engine(
            EngineConfig(batcher=BatcherConfig(max_batch_weight=KV_TOKENS, max_total_tokens=2048, prefix_cache=on))
        )
        run_weightq(engines[side], warm, "warm")
    python = peer_python(args.peer_python)
    problem = "skipped (--no-peer)" if args.no_peer else peer_problem(python)
    peer = None
    if problem is None:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": omp_bind(args.threads)}
        env.pop("PYTHONPATH", None)
        start = {
            "model": str(builtin_path("tiny")),
            "kv_tokens": KV_TOKENS,
            "block_size": PEER_BLOCK,
            "max_num_seqs": 256,
            "max_model_len": 2048,
            "threads": args.threads,
            "llm": {},
        }
        try:
            peer = VllmPeer(python, start, env, Path(tempfile.gettempdir()) / "weightq-bench-prefix-vllm.log")
            peer.run(warm)
        except PeerError as e:
            problem, peer = str(e).splitlines()[0], None
    rounds: dict[str, list[dict]] = {"on": [], "off": [], "vllm": []}
    sides = ["on", "off"] + (["vllm"] if peer else [])
    try:
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                time.sleep(1.0)
                if side == "vllm":
                    reply = peer.run(work)  # type: ignore[union-attr]
                    rounds["vllm"].append({"tok_s": reply["tokens"] / reply["elapsed_s"], **reply})
                else:
                    rounds[side].append(run_weightq(engines[side], work, f"{side}{r}-"))
                print(f"[bench.prefix] round {r + 1} {side}: {rounds[side][-1]['tok_s']:.0f} tok/s", file=sys.stderr)
    finally:
        if peer is not None:
            peer.close()
    out: dict = {"requests": args.requests, "kv_tokens": KV_TOKENS, "rounds": args.rounds}
    for side in ("on", "off"):
        rs = rounds[side]
        keys = ("tok_s", "ttft_p50_s", "ttft_p99_s", "prompt_tokens_computed", "cached_tokens")
        out[side] = {k: median_of(rs, k) for k in keys}
        out[side]["rounds_tok_s"] = [round(x["tok_s"], 1) for x in rs]
    out["speedup"] = round(out["on"]["tok_s"] / out["off"]["tok_s"], 3)
    out["ttft_p50_ratio"] = round(out["on"]["ttft_p50_s"] / out["off"]["ttft_p50_s"], 3)
    out["ttft_p99_ratio"] = round(out["on"]["ttft_p99_s"] / out["off"]["ttft_p99_s"], 3)
    a, b = rounds["on"][0]["ids"], rounds["off"][0]["ids"]
    out["identical_on_off"] = f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"
    if rounds["vllm"]:
        out["vllm"] = {
            "tok_s": median_of(rounds["vllm"], "tok_s"),
            "cached_tokens": median_of(rounds["vllm"], "cached_tokens"),
            "rounds_tok_s": [round(x["tok_s"], 1) for x in rounds["vllm"]],
        }
        out["vs_vllm"] = round(out["on"]["tok_s"] / out["vllm"]["tok_s"], 3)
    else:
        out["vllm"] = f"not run: {problem}"
    out["stats_on"] = {k: v for k, v in engines["on"].stats().items() if k.startswith(("prefix", "kv_"))}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
