"""Prefix caching on the tiny model: the same greedy outputs with the cache on and off, prompts
computed once, and the cache consistent through preemption, cancellation and failures."""

from __future__ import annotations

import random

from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

from tests.reference import assert_greedy_equal


def shared_prefix_requests(n: int, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 1100) for _ in range(rng.randint(60, 200))] for _ in range(3)]
    out = []
    for i in range(n):
        ids = rng.choice(systems) + [rng.randrange(10, 1100) for _ in range(rng.randint(1, 40))]
        new = rng.choice([1, rng.randint(2, 30), 60])
        out.append(GenerationRequest(f"p{i}", prompt_token_ids=ids, params=SamplingParams(max_new_tokens=new)))
    return out


def engine(tiny_loaded, **kw) -> Engine:
    limits = dict(
        max_batch_weight=2048, max_total_tokens=400, max_prefill_weight=256, max_wait_s=1e9, jump_window_s=1e9
    )
    return Engine(EngineConfig(check_invariants=True, batcher=BatcherConfig(**(limits | kw))), loaded=tiny_loaded)


def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(tiny_loaded, reference_model):
    reqs = shared_prefix_requests(40)
    results = {}
    for on in (True, False):
        eng = engine(tiny_loaded, prefix_cache=on, mode="predictive")
        results[on] = eng.generate(reqs)
        st = eng.stats()
        assert eng.batcher.ledger.used == 0
        if on:
            assert st["prefix_hit_rate"] > 0.5, st
            assert sum(r.cached_tokens for r in results[on]) > 0
            computed_on = eng.counters["prefill_tokens"]
        else:
            assert st["prefix_cached_tokens"] == 0 and all(r.cached_tokens == 0 for r in results[on])
            assert eng.counters["prefill_tokens"] > 2 * computed_on
    for a, b in zip(results[True], results[False], strict=True):
        assert a.reason == b.reason
    assert_greedy_equal(reference_model, reqs, results[True])
    assert_greedy_equal(reference_model, reqs, results[False])


def test_samples_of_one_prompt_prefill_it_once(tiny_loaded):
    """n samples submitted together (as the gateway fans `n` out): the first computes the prompt, the
    others find its blocks in the same step and compute only the last partial block."""
    eng = engine(tiny_loaded)
    prompt = list(range(100, 300))  # 200 tokens: 12 full blocks of 16, 8 tokens in a 13th
    reqs = [
        GenerationRequest(
            f"s{i}", prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=8, temperature=1.0, seed=i)
        )
        for i in range(4)
    ]
    out = eng.generate(reqs)
    assert eng.counters["prefill_tokens"] == 200 + 3 * 8
    assert [r.cached_tokens for r in out] == [0, 192, 192, 192]
    assert len({r.token_ids for r in out}) > 1  # different seeds, different samples
    again = eng.generate(
        [
            GenerationRequest(
                "t", prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=8, seed=0, temperature=1.0)
            )
        ]
    )
    assert again[0].token_ids == out[0].token_ids and again[0].cached_tokens == 192  # idle cached blocks reused


def test_cancelling_holders_keeps_the_cache_consistent(tiny_loaded):
    eng = engine(tiny_loaded)
    reqs = shared_prefix_requests(12, seed=3)
    handles = [eng.submit(r) for r in reqs]
    for _ in range(3):
        eng.step()
    for r in reqs[::3]:
        eng.cancel(r.id)
    while not eng.idle():
        eng.step()  # check_invariants checks the ledger and the charges after every step
    assert all(h.final is not None for h in handles)
    assert eng.batcher.ledger.used == 0 and eng.batcher.shared_blocks_held == 0


def test_prompt_logprobs_requests_compute_their_whole_prompt(tiny_loaded):
    eng = engine(tiny_loaded)
    prompt = list(range(100, 180))
    _first, second = eng.generate(
        [
            GenerationRequest("a", prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=2)),
            GenerationRequest("b", prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=2, prompt_logprobs=1)),
        ]
    )
    assert second.cached_tokens == 0 and len(second.prompt_logprobs) == len(prompt)
