"""Log-probabilities and the sampling controls apps send (presence, frequency and repetition
penalties, logit bias, min_tokens), each against a reference written here from its definition and
run on transformers' own model, one token at a time."""

from __future__ import annotations

import random
from collections import Counter

import torch
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

from tests.reference import NEAR_TIE


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1100) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def test_logprobs_are_the_models_log_softmax_streamed_and_final(tiny_loaded, reference_model):
    events = []
    engine = Engine(EngineConfig(check_invariants=True), sink=events.append, loaded=tiny_loaded)
    prompts = _prompts(6, seed=1)
    ks = [0, 1, 5, 20, 3, None]  # None: not asked for, in the same batch
    reqs = [
        GenerationRequest(f"lp{i}", prompt_token_ids=p, params=SamplingParams(max_new_tokens=24, logprobs=k))
        for i, (p, k) in enumerate(zip(prompts, ks, strict=True))
    ]
    results = engine.generate(reqs)
    texts = engine.token_texts
    for req, res in zip(reqs, results, strict=True):
        k = req.params.logprobs
        streamed = [e.logprobs for e in events if getattr(e, "index", None) is not None and e.request_id == req.id]
        if k is None:
            assert res.logprobs is None and all(lp is None for lp in streamed)
            continue
        assert list(res.logprobs) == streamed and len(res.logprobs) == len(res.token_ids)
        full = torch.tensor([req.prompt_token_ids + list(res.token_ids)])
        with torch.no_grad():
            ref = reference_model(full).logits[0].float().log_softmax(-1)
        for i, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs, strict=True)):
            row = ref[len(req.prompt_token_ids) - 1 + i]
            assert abs(lp.logprob - float(row[tok])) < 1e-4
            assert lp.token == texts([tok])[0]
            assert len(lp.top_ids) == k and list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            for t, v, name in zip(lp.top_ids, lp.top_logprobs, lp.top_tokens, strict=True):
                assert abs(v - float(row[t])) < 1e-4 and name == texts([t])[0]
            if k:  # greedy: the chosen token is the most likely one (but at a near-tie)
                assert lp.top_ids[0] == tok or lp.top_logprobs[0] - lp.logprob < NEAR_TIE


def reference_controls(model, prompt: list[int], p: SamplingParams, eos: frozenset[int]) -> list[int]:
    """Greedy with every control applied as its definition says, in vLLM's order: logit bias and
    min_tokens, then repetition (transformers: over prompt and output), frequency and presence (OpenAI:
    over the output)."""
    ids, out = list(prompt), []
    for _ in range(p.max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        for t, b in p.logit_bias:
            logits[t] += b
        if len(out) < p.min_tokens:
            for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
                logits[t] = float("-inf")
        if p.repetition_penalty != 1.0:
            for t in set(ids):
                logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
        for t, c in Counter(out).items():
            logits[t] -= c * p.frequency_penalty + p.presence_penalty
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        if tok in p.stop_token_ids or (tok in eos and not p.ignore_eos):
            break
    return out


def test_penalties_bias_and_min_tokens_match_their_definitions(tiny_loaded, reference_model):
    engine = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded)
    eos = tiny_loaded.eos_token_ids
    base = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = engine.generate([GenerationRequest("plain", prompt_token_ids=[5, 17, 99, 4], params=base)])[0]
    first, often = plain.token_ids[0], Counter(plain.token_ids).most_common(1)[0][0]
    variants = [
        SamplingParams(max_new_tokens=32, ignore_eos=True, presence_penalty=-2.0),  # repeats what it said
        SamplingParams(max_new_tokens=32, ignore_eos=True, frequency_penalty=0.9),
        SamplingParams(max_new_tokens=32, ignore_eos=True, frequency_penalty=-0.5, presence_penalty=0.7),
        SamplingParams(max_new_tokens=32, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.3),
        SamplingParams(max_new_tokens=32, ignore_eos=True, logit_bias=((often, -100.0), (1000, 8.0))),
        # the greedy first token is a stop id: min_tokens holds it back for 6 tokens
        SamplingParams(max_new_tokens=32, stop_token_ids=(first,), min_tokens=6),
        SamplingParams(max_new_tokens=32, ignore_eos=True),  # plain, in the same batch
    ]
    prompts = [[5, 17, 99, 4]] * len(variants) + _prompts(len(variants), seed=2)
    reqs = [
        GenerationRequest(f"c{i}", prompt_token_ids=p, params=variants[i % len(variants)])
        for i, p in enumerate(prompts)
    ]
    results = engine.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        want = reference_controls(reference_model, req.prompt_token_ids, req.params, eos)
        got = list(res.token_ids)
        if got != want:  # only a near-tie of the adjusted logits may differ (batching noise)
            k = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
            with torch.no_grad():
                ids = torch.tensor([req.prompt_token_ids + want[:k]])
                top = reference_model(ids).logits[0, -1].topk(2).values
            assert float(top[0] - top[1]) < NEAR_TIE, f"{req.id} ({req.params}): {got[k:]} vs {want[k:]}"
    by_id = {r.request_id: r for r in results}
    assert len(by_id["c5"].token_ids) >= 6  # min_tokens held the stop id back
    assert often not in by_id["c4"].token_ids
    assert by_id["c0"].token_ids != plain.token_ids  # the penalty really changes the output
    assert len(set(by_id["c0"].token_ids)) < len(set(plain.token_ids))


def test_a_logit_bias_beyond_the_vocabulary_is_refused(tiny_loaded):
    """Out-of-range controls are the contract's to refuse (tests/tasks/test_request.py); the vocabulary
    is the engine's."""
    engine = Engine(EngineConfig(), loaded=tiny_loaded)
    params = SamplingParams(logit_bias=((engine.logits_width, 1.0),))
    res = engine.generate([GenerationRequest("bad", prompt="x", params=params)])[0]
    assert res.reason == "error" and res.error.startswith("logit_bias")


def test_prompt_logprobs_across_prefill_chunks(tiny_loaded, reference_model):
    engine = Engine(
        EngineConfig(check_invariants=True, batcher=BatcherConfig(max_prefill_weight=16)), loaded=tiny_loaded
    )
    prompts = [p + p for p in _prompts(4, seed=3)]  # 6-120 tokens: prefilled in chunks of at most 16
    ks = [0, 2, 5, None]
    reqs = [
        GenerationRequest(f"pl{i}", prompt_token_ids=p, params=SamplingParams(max_new_tokens=3, prompt_logprobs=k))
        for i, (p, k) in enumerate(zip(prompts, ks, strict=True))
    ]
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        k = req.params.prompt_logprobs
        if k is None:
            assert res.prompt_logprobs is None
            continue
        prompt = req.prompt_token_ids
        assert list(res.prompt_token_ids) == prompt and len(res.prompt_logprobs) == len(prompt)
        first = res.prompt_logprobs[0]
        assert first.logprob is None and first.token == engine.token_texts(prompt[:1])[0]
        with torch.no_grad():
            ref = reference_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        for i in range(1, len(prompt)):
            lp = res.prompt_logprobs[i]
            assert abs(lp.logprob - float(ref[i - 1, prompt[i]])) < 1e-4, (req.id, i)
            assert len(lp.top_ids) == k and list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
            assert all(abs(v - float(ref[i - 1, t])) < 1e-4 for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True))
