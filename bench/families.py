"""Memory that follows the model: a Gemma-3-shaped model's window layers keep their window, not the context.

    python -m bench.families --json     # [--requests 64] [--context 4096] [--new 128] [--rounds 2]

A tiny random model of Gemma 3's shape (6 layers: 5 with a 512-token sliding window, 1 full; the
built-in tokenizer) serves `requests` requests of about `context` tokens each (a prompt of context -
new tokens, then `new` tokens, EOS ignored), all submitted at once, with the same KV memory two ways:
- grouped: the engine's layout (engine/runner/kv_cache.py): full layers keep every block of the context,
  window layers a ring of their window plus one block; the batcher projects both (batcher/weight.py);
- full: every layer keeps every block of the context (window_rings=False; each window a mask), as if
  every layer were full: what the engine did before attention kinds.
Reported per way: requests running at once (at the first step, and at most: the admitted concurrency,
`admitted_ratio`), output tok/s (median of alternating rounds), steps over the budget (must be 0) and
the most ring pages a request held (never more than its ring: the window plus one block, times 5
layers); and whether both ways produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch
import transformers as T
from transformers import AutoModelForCausalLM, AutoTokenizer
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.engine.model import builtin_path

WINDOW = 512


def gemma3_shaped(out: str, context: int) -> str:
    tok = AutoTokenizer.from_pretrained(builtin_path("tiny"))
    config = T.Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # layer_types: five sliding_attention, then one full_attention
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        max_position_embeddings=2 * context,
        initializer_range=0.1,
    )
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def workload(n: int, context: int, new: int, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = context - new - rng.randint(0, 64)
        ids = [rng.randrange(10, 1100) for _ in range(prompt)]
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        out.append(GenerationRequest(f"r{i}", prompt_token_ids=ids, params=params))
    return out


def run(engine: Engine, reqs: list[GenerationRequest]) -> dict:
    engine.reset_prefix_cache()
    handles = [engine.submit(r) for r in reqs]
    first = most = rings = 0
    t0 = time.perf_counter()
    while any(h.final is None for h in handles):
        engine.step()
        running = engine.batcher.running.values()
        first = first or len(running)
        most = max(most, len(running))
        rings = max([rings, *(max((len(g) for g in r.rings), default=0) for r in running)])
    wall = time.perf_counter() - t0
    tokens = sum(len(h.final.token_ids) for h in handles)
    return {
        "running_first_step": first,
        "running_most": most,
        "tok_s": tokens / wall,
        "overflow_steps": engine.counters["overflow_steps"],
        "most_ring_pages": rings,
        "tokens": [list(h.final.token_ids) for h in handles],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--budget-requests", type=int, default=16, help="KV memory: this many full-length requests")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = gemma3_shaped(tmp, args.context)
        budget = args.budget_requests * args.context  # tokens of every layer: the same memory both ways
        engines = {
            rings: Engine(
                EngineConfig(
                    model=path,
                    device="cpu",
                    window_rings=rings,
                    batcher=BatcherConfig(
                        max_batch_weight=budget,
                        max_total_tokens=args.context,
                        max_prefill_weight=args.context,  # a prompt a step: memory, not the prefill cap, bounds it
                        mode="worst_case",
                        prefix_cache=False,
                    ),
                )
            )
            for rings in (True, False)
        }
        reqs = workload(args.requests, args.context, args.new)
        results: dict[bool, list[dict]] = {True: [], False: []}
        for r in range(args.rounds):
            for rings in (True, False) if r % 2 == 0 else (False, True):  # alternating: a drifting machine hits both
                results[rings].append(run(engines[rings], reqs))
        layout = engines[True].runner.cache.layout
    out = {"bench": "families", "model": "Gemma-3-shaped tiny (5 window-512 : 1 full layers)", "context": args.context}
    out |= {"requests": args.requests, "kv_tokens_of_every_layer": budget, "rounds": args.rounds}
    for rings, name in ((True, "grouped"), (False, "full")):
        rs = results[rings]
        out[name] = {
            "running_first_step": rs[0]["running_first_step"],
            "running_most": max(x["running_most"] for x in rs),
            "tok_s": round(statistics.median(x["tok_s"] for x in rs), 1),
            "overflow_steps": sum(x["overflow_steps"] for x in rs),
            "most_ring_pages": max(x["most_ring_pages"] for x in rs),
        }
    (window,) = layout.windows
    out["grouped"]["ring_pages"] = window.ring * window.pages
    out["admitted_ratio"] = round(out["grouped"]["running_most"] / out["full"]["running_most"], 2)
    out["tok_s_ratio"] = round(out["grouped"]["tok_s"] / out["full"]["tok_s"], 2)
    same = [a == b for a, b in zip(results[True][0]["tokens"], results[False][0]["tokens"], strict=True)]
    out["outputs_identical"] = all(same)
    out["outputs_differing"] = same.count(False)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
