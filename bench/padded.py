"""The padded runner on a tiny T5 against transformers' generate() on static batches, in one run.

    python -m bench.padded --json

Workload: 64 requests, prompts 16-256 random token ids, 8-128 new tokens, greedy, EOS ignored so
every request produces exactly its max_new_tokens (fixed seed); model builtin:tiny-t5.
- weightq: the engine with the padded runner, max_batch_weight = 16 x the longest request's
  input + output, i.e. the memory a static batch of 16 must be sized for.
- hf_static16: model.generate() on right-padded encoder batches of 16 in arrival order; each batch
  decodes until its longest request is done (useful tokens only are counted).
- torch runs on one thread by default (--threads): on this 2-core machine the tiny model is faster
  so, and two threads make both sides' figures swing with any other load.
- greedy_match: weightq's outputs against per-request generate(); a divergence at a near-tie
  (reference top1-top2 gap < 1e-4) counts as a match and is listed.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time

import torch
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig

from .engine import requests, workload  # the same workload as the paged engine's benchmark

NEAR_TIE = 1e-4
MODEL = "builtin:tiny-t5"


def no_eos(model, max_new: int):
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=max_new, do_sample=False)
    config.eos_token_id = []  # None would be filled in from the model's defaults: generate() would stop at EOS
    return config


def run_weightq(work, budget: int) -> tuple[float, Engine, list]:
    engine = Engine(
        EngineConfig(model=MODEL, device="cpu", batcher=BatcherConfig(max_batch_weight=budget, max_total_tokens=512))
    )
    engine.generate(requests(work[:4], "warm"))
    t0 = time.perf_counter()
    results = engine.generate(requests(work))
    dt = time.perf_counter() - t0
    return sum(r.completion_tokens for r in results) / dt, engine, results


def run_static16(model, work, pad: int) -> float:
    tokens, elapsed = 0, 0.0
    for b in range(0, len(work), 16):
        batch = work[b : b + 16]
        longest = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([p + [pad] * (longest - len(p)) for p, _ in batch])
        mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p, _ in batch])
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=no_eos(model, max(n for _, n in batch)))
        elapsed += time.perf_counter() - t0
        tokens += sum(n for _, n in batch)
    return tokens / elapsed


def greedy_match(model, work, results) -> tuple[int, list[str]]:
    matched, ties = 0, []
    start = model.generation_config.decoder_start_token_id
    for i, ((ids, n), res) in enumerate(zip(work, results, strict=True)):
        prompt = torch.tensor([ids])
        with torch.no_grad():
            want = model.generate(prompt, generation_config=no_eos(model, n))[0, 1:].tolist()
        got = list(res.token_ids)
        if got == want:
            matched += 1
            continue
        k = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        with torch.no_grad():
            dec = torch.tensor([[start, *want[:k]]])
            logits = model(input_ids=prompt, decoder_input_ids=dec).logits[0, -1]
        top = logits.topk(2).values
        gap = float(top[0] - top[1])
        if gap < NEAR_TIE:
            matched += 1
            ties.append(f"{i}@{k} gap {gap:.1e}")
    return matched, ties


def main() -> None:
    ap = argparse.ArgumentParser(description="weightq's padded runner vs generate() on static batches (tiny T5)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both sides (0: torch's default)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:  # a model this small runs faster on one thread here, and 2 make both sides hostage to load
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = workload(args.requests, args.seed)
    budget = 16 * max(len(ids) + n for ids, n in work)
    weightq_tok_s, engine, results = run_weightq(work, budget)
    model = engine.lm.model
    pad = engine.runner.pad_id
    run_static16(model, work[:16], pad)  # warm-up
    hf_tok_s = run_static16(model, work, pad)
    matched, ties = greedy_match(model, work, results)
    stats = engine.stats()
    out = {
        "weightq_tok_s": round(weightq_tok_s, 1),
        "hf_static16_tok_s": round(hf_tok_s, 1),
        "ratio": round(weightq_tok_s / hf_tok_s, 3),
        "greedy_match": f"{matched}/{len(work)}",
        "near_ties": ties,
        "requests": len(work),
        "tokens": sum(n for _, n in work),
        "max_batch_weight": budget,
        "steps": stats["steps"],
        "runner": stats["runner"],
        "torch_threads": torch.get_num_threads(),
        "model": MODEL,
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
