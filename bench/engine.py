"""Engine throughput on the built-in tiny model against transformers' own batching, in one run.

    python -m bench.engine --json

Workload: 64 requests, prompts 16-256 random token ids, 8-128 new tokens, greedy, EOS ignored so
every request produces exactly its max_new_tokens (fixed seed).
- weightq: our engine, KV capacity for the whole workload at once.
- hf_static16: model.generate() on left-padded batches of 16 in arrival order; each batch runs to
  its longest request (useful tokens only are counted).
- hf_cb: transformers' continuous batching (its manager, per-request max_new_tokens) with an
  explicit cache of the same capacity and page size.
- greedy_match: weightq's outputs against per-request generate(); a divergence at a near-tie
  (reference top1-top2 gap < 1e-4) counts as a match and is listed.
- step_overhead_pct: share of weightq's step time outside the model's forward.
- policies: weightq's output tokens/s with each batcher policy at a tight KV budget (4,096 tokens),
  each after one warm-up pass of the same workload (the predictive estimator learns from it).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

import torch
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.engine.model import builtin_path

NEAR_TIE = 1e-4


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(10, 1100) for _ in range(rng.randint(16, 256))], rng.randint(8, 128)) for _ in range(n)]


def requests(work, tag: str = "") -> list[GenerationRequest]:
    return [
        GenerationRequest(f"{tag}{i}", prompt_token_ids=ids, params=SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, (ids, n) in enumerate(work)
    ]


def no_eos(max_new: int):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=None, pad_token_id=0)


def run_weightq(work, budget: int, policy: str = "weighted", warmup: bool = False) -> tuple[float, Engine, list]:
    mode = "predictive" if policy == "predictive" else "worst_case"
    engine = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=budget, max_prefill_weight=2048, mode=mode)))
    if policy == "static":
        from weightq.batcher.sim.policies import static_batcher

        engine.use_batcher(static_batcher(engine.batcher.config, blocks=True))
    engine.generate(requests(work, "warm") if warmup else requests(work[:4], "warm"))
    engine.counters.update(steps=0, forward_s=0.0, step_s=0.0)
    t0 = time.perf_counter()
    results = engine.generate(requests(work))
    dt = time.perf_counter() - t0
    return sum(r.completion_tokens for r in results) / dt, engine, results


def run_static16(model, work) -> float:
    tokens, elapsed = 0, 0.0
    for b in range(0, len(work), 16):
        batch = work[b : b + 16]
        longest = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=no_eos(max(n for _, n in batch)))
        elapsed += time.perf_counter() - t0
        tokens += sum(n for _, n in batch)
    return tokens / elapsed


def hf_cb_config(work, budget: int, cuda_graphs: bool | None = False):
    """transformers' continuous batching with an explicit cache of `budget` tokens in pages of 16."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=16,
        num_blocks=budget // 16,
        max_batch_tokens=2048,
        max_requests_per_batch=len(work),
        allow_block_sharing=False,
        use_cuda_graph=cuda_graphs,
    )


def run_hf_cb(model, work, budget: int) -> float:
    cb = hf_cb_config(work, budget)
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=no_eos(128), continuous_batching_config=cb, block=True, timeout=5
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in work]
        done: dict = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result and result.is_finished():
                done[result.request_id] = result
    dt = time.perf_counter() - t0
    return sum(len(r.generated_tokens) for r in done.values()) / dt


def greedy_match(model, work, results) -> tuple[int, list[str]]:
    ok, ties = 0, []
    for i, ((prompt, n), res) in enumerate(zip(work, results, strict=True)):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), generation_config=no_eos(n))[0, len(prompt) :].tolist()
        got = list(res.token_ids)
        if got == want:
            ok += 1
            continue
        k = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        with torch.no_grad():
            top = model(torch.tensor([prompt + want[:k]])).logits[0, -1].topk(2).values
        gap = float(top[0] - top[1])
        if gap < NEAR_TIE:
            ok += 1
            ties.append(f"request {i} token {k}: gap {gap:.1e}")
    return ok, ties


def main() -> None:
    ap = argparse.ArgumentParser(description="weightq engine vs transformers batching on the tiny model")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy-budget", type=int, default=4096)
    args = ap.parse_args()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    work = workload(args.requests, args.seed)
    budget = len(work) * (256 + 128)
    model = AutoModelForCausalLM.from_pretrained(builtin_path("tiny"), attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # else generate() merges it back and stops at EOS

    weightq, engine, results = run_weightq(work, budget)
    c = engine.counters
    overhead = 100.0 * (c["step_s"] - c["forward_s"]) / c["step_s"]
    static16 = run_static16(model, work)
    hf_cb = run_hf_cb(model, work, budget)
    matched, ties = greedy_match(model, work, results)
    policies = {
        p: round(run_weightq(work, args.policy_budget, p, warmup=True)[0], 1)
        for p in ("static", "weighted", "predictive")
    }
    out = {
        "workload": {
            "requests": len(work),
            "prompt_tokens": "16-256",
            "new_tokens": "8-128",
            "greedy": True,
            "seed": args.seed,
            "kv_budget_tokens": budget,
            "policy_budget_tokens": args.policy_budget,
            "torch_threads": torch.get_num_threads(),
        },
        "weightq_tok_s": round(weightq, 1),
        "hf_static16_tok_s": round(static16, 1),
        "hf_cb_tok_s": round(hf_cb, 1),
        "ratio_vs_static16": round(weightq / static16, 2),
        "ratio_vs_hf_cb": round(weightq / hf_cb, 2),
        "greedy_match": f"{matched}/{len(work)}",
        "near_ties": ties,
        "step_overhead_pct": round(overhead, 2),
        "policies": policies,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
