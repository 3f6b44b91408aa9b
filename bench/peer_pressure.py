"""bench.peer's memory-pressure cases: output lengths the model decides, KV capacity fixed on both sides.

    python -m bench.peer --json --suite pressure     # [--pressure-kv 4096,8192] [--rounds 3]

Workload: bench.engine's prompts (256 requests of 16-256 random token ids, fixed seed), greedy, max_tokens
512, EOS ignored, each request ended by `stop_token_ids` = STOP_TOKEN_IDS: the built-in tiny model then
stops a median ~100 tokens in with a long tail (>= 10% past 300, some at 512). `python -m bench.peer_pressure` runs
the workload to 512 tokens and prints the sets that give that shape (how STOP_TOKEN_IDS was picked).

Per KV capacity, one vLLM (the same child process as bench.peer, block 32, num_gpu_blocks_override) and
one weightq Engine per batcher mode (worst_case, predictive) with max_batch_weight = the capacity; every
round runs the workload once on each side, the order rotating. Reported per case:
- tok_s / wall_s: medians over rounds per side (output tokens / wall time of one generate call); ratio:
  each weightq mode / vLLM.
- preempted_tokens / preemptions (weightq: tokens prefilled again after a preemption, per round) and
  overflow_steps (steps that ended over the budget: must be 0); generated tokens per round.
- identical: per mode, requests whose output ids equal vLLM's (round 1); a divergence at a near-tie
  (reference top1-top2 gap < 1e-4) is a match and is listed, as in bench.peer.
- lengths: the output-length histogram of vLLM's outputs (round 1), median, share past 300.
"""

from __future__ import annotations

import collections
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MAX_TOKENS = 512
REQUESTS = 256
STOP_TOKEN_IDS = (228, 957, 1090)  # --choose-stop-ids on seed 0: median 99.5, 20.7% past 300
MODES = ("worst_case", "predictive")
BUCKETS = (50, 100, 200, 300, 400, 511, 512)


def pressure_work(seed: int) -> list[tuple[list[int], int]]:
    from .engine import workload

    return [(ids, MAX_TOKENS) for ids, _ in workload(REQUESTS, seed)]


def histogram(lengths: list[int]) -> dict[str, Any]:
    """Counts per length bucket (upper bounds inclusive), the median, and the share past 300 tokens."""
    counts: dict[str, int] = {}
    lo = 1
    for hi in BUCKETS:
        counts[f"{lo}-{hi}" if hi > lo else str(hi)] = sum(lo <= n <= hi for n in lengths)
        lo = hi + 1
    return {
        "counts": counts,
        "median": statistics.median(lengths) if lengths else 0,
        "past_300": round(sum(n > 300 for n in lengths) / max(1, len(lengths)), 3),
    }


def stop_sets(outputs: list[list[int]], median: float = 100, tail: float = 0.10, top: int = 10) -> list[dict]:
    """Sets of 1-3 token ids that, as stop_token_ids, give outputs of about `median` tokens with at least
    `tail` of them past 300 (each output is cut at its first stop id; none means it runs to the end)."""
    first: dict[int, dict[int, int]] = collections.defaultdict(dict)
    for i, out in enumerate(outputs):
        for p, t in enumerate(out):
            first[t].setdefault(i, p)
    common = sorted(first, key=lambda t: -len(first[t]))[:150]
    found = []
    for k in (1, 2, 3):
        for ids in itertools.combinations(common[:70] if k == 3 else common, k):
            lengths = [min([first[t].get(i, len(o)) for t in ids] + [len(o) - 1]) + 1 for i, o in enumerate(outputs)]
            h = histogram(lengths)
            if h["past_300"] >= tail:
                found.append((abs(h["median"] - median), -h["past_300"], list(ids), h))
    found.sort(key=lambda f: f[:2])
    return [{"stop_token_ids": ids, **h} for _, _, ids, h in found[:top]]


def _requests(work, tag: str):
    from weightq.engine import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=STOP_TOKEN_IDS)
    return [GenerationRequest(f"{tag}{i}", prompt_token_ids=ids, params=params) for i, (ids, _) in enumerate(work)]


def run_mode(engine, work, tag: str) -> dict[str, Any]:
    """One generate() over the workload: tok/s, wall, preemption and overflow counts, output ids."""
    stats = engine.batcher.stats
    before = (stats.preemptions, stats.preempted_tokens, engine.counters["overflow_steps"])
    t0 = time.perf_counter()
    results = engine.generate(_requests(work, tag))
    dt = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in results)
    errors = [r.error for r in results if r.reason == "error"]
    if errors:
        raise RuntimeError(f"weightq failed requests: {errors[:3]}")
    return {
        "tok_s": tokens / dt,
        "wall_s": dt,
        "tokens": tokens,
        "preemptions": stats.preemptions - before[0],
        "preempted_tokens": stats.preempted_tokens - before[1],
        "overflow_steps": engine.counters["overflow_steps"] - before[2],
        "ids": [list(r.token_ids) for r in results],
    }


def run_pressure(args, kv_tokens: int, python: Path, env: dict[str, str], wq_overrides: dict[str, Any]) -> dict:
    """Both batcher modes and vLLM at one KV capacity, rounds rotating the order."""
    from weightq.engine import Engine
    from weightq.engine.model import builtin_path

    from .engine import NEAR_TIE
    from .peer import (
        MAX_MODEL_LEN,
        PEER_BLOCK,
        SETTLE_S,
        first_divergence,
        parse_overrides,
        reference_gaps,
        tally,
        weightq_config,
    )
    from .peer_client import VllmPeer

    def log(msg: str) -> None:
        print(f"[bench.peer pressure] {kv_tokens} KV tokens: {msg}", file=sys.stderr, flush=True)

    model_dir = builtin_path("tiny")
    work = pressure_work(args.seed)
    engines = {m: Engine(weightq_config(kv_tokens, {**wq_overrides, "mode": m})) for m in MODES}
    for m, e in engines.items():
        run_mode(e, work[:4], f"warm-{m}-")
    start = {
        "model": str(model_dir),
        "kv_tokens": kv_tokens,
        "block_size": PEER_BLOCK,
        "max_num_seqs": REQUESTS,
        "max_model_len": MAX_MODEL_LEN,
        "threads": args.threads,
        "llm": parse_overrides(args.vllm_config),
    }
    params = {"stop_token_ids": list(STOP_TOKEN_IDS), "ignore_eos": True}
    peer = VllmPeer(python, start, env, args.peer_log)
    sides = [*MODES, "vllm"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    try:
        log(f"vLLM up in {peer.hello['startup_s']:.1f}s")
        peer.run(work[:4], params=params)
        for r in range(args.rounds):
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                time.sleep(SETTLE_S)
                if side == "vllm":
                    reply = peer.run(work, token_ids=r == 0, params=params)
                    ids = reply.get("token_ids", [])
                    runs["vllm"].append(
                        {
                            "tok_s": reply["tokens"] / reply["elapsed_s"],
                            "wall_s": reply["elapsed_s"],
                            "tokens": reply["tokens"],
                            "ids": ids,
                        }
                    )
                else:
                    runs[side].append(run_mode(engines[side], work, f"{side}{r}-"))
                log(f"round {r + 1}: {side} {runs[side][-1]['tok_s']:.0f} tok/s in {runs[side][-1]['wall_s']:.1f}s")
    finally:
        peer.close()
    theirs = runs["vllm"][0]["ids"]

    def med(side: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[side])

    case: dict[str, Any] = {
        "kv_tokens": kv_tokens,
        "requests": REQUESTS,
        "tok_s": {s: round(med(s, "tok_s"), 1) for s in sides},
        "wall_s": {s: round(med(s, "wall_s"), 2) for s in sides},
        "ratio": {m: round(med(m, "tok_s") / med("vllm", "tok_s"), 3) for m in MODES},
        "rounds_tok_s": {s: [round(x["tok_s"], 1) for x in runs[s]] for s in sides},
        "generated_tokens": {s: [x["tokens"] for x in runs[s]] for s in sides},
        "preemptions": {m: [x["preemptions"] for x in runs[m]] for m in MODES},
        "preempted_tokens": {m: [x["preempted_tokens"] for x in runs[m]] for m in MODES},
        "preempted_share": {
            m: round(max(x["preempted_tokens"] / max(1, x["tokens"]) for x in runs[m]), 4) for m in MODES
        },
        "overflow_steps": {m: sum(x["overflow_steps"] for x in runs[m]) for m in MODES},
        "lengths": histogram([len(t) for t in theirs]),
        "identical": {},
    }
    for m in MODES:
        ours = runs[m][0]["ids"]
        diverged = [(i, k) for i in range(len(work)) if (k := first_divergence(ours[i], theirs[i])) is not None]
        gaps = reference_gaps(model_dir, work, ours, diverged)
        case["identical"][m] = tally(len(work), [(i, k, g) for (i, k), g in zip(diverged, gaps, strict=True)], NEAR_TIE)
    for e in engines.values():
        e.stop()
    return case


def choose_stop_ids(seed: int) -> list[dict]:
    """Run the workload to MAX_TOKENS (no stop ids) and list stop-id sets that give the wanted shape."""
    from weightq.batcher import BatcherConfig
    from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    work = pressure_work(seed)
    engine = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=REQUESTS * (256 + MAX_TOKENS))))
    params = SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)
    reqs = [GenerationRequest(f"c{i}", prompt_token_ids=ids, params=params) for i, (ids, _) in enumerate(work)]
    return stop_sets([list(r.token_ids) for r in engine.generate(reqs)])


if __name__ == "__main__":  # pragma: no cover - a helper for picking STOP_TOKEN_IDS
    import json

    print(json.dumps(choose_stop_ids(int(os.environ.get("SEED", "0"))), indent=1))
