"""The engine's greedy outputs against transformers' own generate(), token for token except at a
near-tie of the reference (batching noise)."""

from __future__ import annotations

import random

import torch
from weightq.engine import GenerationRequest, SamplingParams

NEAR_TIE = 1e-4  # FACTS.md: batching noise is ~1e-5 in fp32; a smaller top1-top2 gap is a tie


def mixed_requests(n: int, seed: int = 0, max_prompt: int = 512, max_new: int = 160) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.choice([1, 2, rng.randint(3, 40), rng.randint(40, max_prompt), max_prompt])
        ids = [rng.randrange(10, 1100) for _ in range(plen)]
        new = rng.choice([1, rng.randint(2, 40), rng.randint(40, max_new), max_new])
        out.append(GenerationRequest(f"r{i}", prompt_token_ids=ids, params=SamplingParams(max_new_tokens=new)))
    return out


def tie_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """The reference's top1 - top2 logit gap where the outputs diverge."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + prefix], device=model.device)).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def assert_greedy_equal(model, reqs, results, expected: dict | None = None, tie: float = NEAR_TIE) -> list[str]:
    """Token-for-token equality with `expected` (request id -> ids; default: generate() now), except
    at a near-tie (reported, not failed)."""
    ties = []
    for req, res in zip(reqs, results, strict=True):
        want = expected[req.id] if expected else reference(model, req)
        got = list(res.token_ids)
        if got == want:
            continue
        check_not_eos_stop(req, res, got, want)
        k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        gap = tie_gap(model, req.prompt_token_ids, want[:k])
        assert gap < tie, f"{req.id}: diverged at token {k} with a clear reference margin {gap:.2e}"
        ties.append(f"{req.id}@{k} gap {gap:.1e}")
    return ties


def check_not_eos_stop(req, res, got: list[int], want: list[int]) -> None:
    """An engine that stopped at its EOS where generate() went on (a model config with no EOS: the
    engine stops at the tokenizer's, engine/model/loading.py) is not a divergence: say so, not "diverged
    at token k" with the reference's margin one token later (issue 42's OLMo 2 report)."""
    if getattr(res, "reason", None) == "eos" and len(got) < len(want) and got == want[: len(got)]:
        raise AssertionError(
            f"{req.id}: the engine stopped at EOS id {got[-1]} after {len(got)} tokens where generate() went on "
            "(the model's config names no EOS; the engine stops at the tokenizer's): compare with ignore_eos=True"
        )


def requests(n: int, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.choice([1, 3, rng.randint(4, 40), rng.randint(40, 120)])
        new = rng.choice([1, rng.randint(2, 30), rng.randint(30, 90)])
        ids = [rng.randrange(10, 1100) for _ in range(plen)]
        out.append(GenerationRequest(f"r{i}", prompt_token_ids=ids, params=SamplingParams(max_new_tokens=new)))
    return out


def reference(model, req: GenerationRequest) -> list[int]:
    """transformers' greedy generate() of the request (decoder-only or encoder-decoder)."""
    ids = torch.tensor([req.prompt_token_ids], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=req.params.max_new_tokens, do_sample=False)
    return out[0, 1 if model.config.is_encoder_decoder else ids.shape[1] :].tolist()


def assert_matches(model, req, got: list[int], want: list[int], tie: float = NEAR_TIE) -> None:
    """Token-for-token equality, except at a near-tie of the reference (batching noise)."""
    if got == want:
        return
    k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    seq2seq, dev = model.config.is_encoder_decoder, model.device
    with torch.no_grad():
        if seq2seq:
            start = model.generation_config.decoder_start_token_id
            dec = torch.tensor([[start, *want[:k]]], device=dev)
            prompt = torch.tensor([req.prompt_token_ids], device=dev)
            logits = model(input_ids=prompt, decoder_input_ids=dec).logits[0, -1]
        else:
            logits = model(torch.tensor([req.prompt_token_ids + want[:k]], device=dev)).logits[0, -1]
    top = logits.topk(2).values
    assert float(top[0] - top[1]) < tie, f"{req.id}: diverged at token {k}: {got[k : k + 5]} vs {want[k : k + 5]}"


def assert_logprobs_match(model, req, result, tol: float = 1e-3) -> None:
    """Each output token's log-probability (the request asked for them) equals the reference model's on
    the same tokens: a check finer than greedy equality, which a tiny random model's flat distributions
    can pass with corrupted attention."""
    out = list(result.token_ids)
    ids = torch.tensor([req.prompt_token_ids + out], device=model.device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    first = len(req.prompt_token_ids) - 1
    want = [float(logp[first + i, t]) for i, t in enumerate(out)]
    got = [lp.logprob for lp in result.logprobs]
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < tol, f"{req.id}: a log-probability differs from the reference by {worst:.2e}"
