"""Resuming a generation from the tokens an earlier run emitted (a worker crashed mid-stream): the
continuation is the one the uninterrupted run produced, token for token, for greedy and seeded
sampling with every control that reads the output so far; the earlier run's streamed text and the
resumed run's join into the final text, each index once."""

from __future__ import annotations

import json

import pytest
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.engine.params import FinishEvent, TokenEvent
from weightq.engine.sampling.grammar import available
from weightq.engine.sink import as_sink

PROMPTS = ["The scheduler admits", "Once upon a time", "A worker crashed and", "Tokens stream back"]
VARIANTS = {
    "greedy": SamplingParams(max_new_tokens=48, ignore_eos=True),
    "greedy-penalised": SamplingParams(max_new_tokens=48, repetition_penalty=1.3, presence_penalty=0.5, logprobs=3),
    "seeded": SamplingParams(max_new_tokens=48, temperature=1.0, seed=7, ignore_eos=True, logprobs=2),
    "seeded-controls": SamplingParams(
        max_new_tokens=48, temperature=0.8, top_k=40, top_p=0.9, frequency_penalty=0.7, min_tokens=30, seed=11
    ),
    "seeded-stop": SamplingParams(max_new_tokens=60, temperature=1.0, seed=3, stop=("e ", "an")),
}


def run(engine: Engine, reqs: list[GenerationRequest]) -> tuple[list[FinishEvent], dict[str, list[TokenEvent]]]:
    events: list = []
    engine.sink = as_sink(events.append)  # set after construction: wrapped as Engine(sink=) would
    finals = engine.generate(reqs)
    engine.sink = None
    tokens: dict[str, list[TokenEvent]] = {}
    for ev in events:
        if isinstance(ev, TokenEvent):
            tokens.setdefault(ev.request_id, []).append(ev)
    return finals, tokens


def check_resumed(engine: Engine, reqs: list[GenerationRequest], cuts: list[int]) -> list[FinishEvent]:
    """Run `reqs` whole, then each again from `cut` tokens of its own output (with the streamed
    log-probabilities), all in one batch: the same final result, and the streamed texts join."""
    whole, streamed = run(engine, reqs)
    resumed_reqs = []
    for req, final, cut in zip(reqs, whole, cuts, strict=True):
        cut = min(cut, len(final.token_ids))
        lps = list(final.logprobs[:cut]) if final.logprobs is not None else None
        resumed_reqs.append(
            GenerationRequest(
                req.id, req.prompt, None, req.params, emitted=list(final.token_ids[:cut]), emitted_logprobs=lps
            )
        )
    resumed, events = run(engine, resumed_reqs)
    for req, want, got in zip(resumed_reqs, whole, resumed, strict=True):
        cut = len(req.emitted)
        assert got.reason == want.reason, (req.id, cut)
        assert got.token_ids == want.token_ids, (req.id, cut)
        assert got.text == want.text, (req.id, cut)
        if want.logprobs is not None:  # the emitted ones as streamed; the rest within prefill/decode noise
            assert got.logprobs[:cut] == want.logprobs[:cut]
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) < 1e-4, (req.id, cut)
        assert got.completion_tokens == want.completion_tokens and got.prompt_tokens == want.prompt_tokens
        after = events.get(req.id, [])
        assert [e.index for e in after] == list(range(cut, len(want.token_ids))), (req.id, cut)
        before = "".join(e.text for e in streamed[req.id][:cut])
        assert before + "".join(e.text for e in after) == want.text, (req.id, cut)
    return whole


@pytest.mark.parametrize("cuts", [(1, 5, 17, 33, 47), (2, 24, 40, 1, 60)])
def test_greedy_and_seeded_runs_resume_where_they_stopped(tiny_loaded, cuts):
    engine = Engine(
        EngineConfig(check_invariants=True, batcher=BatcherConfig(max_prefill_weight=64)), loaded=tiny_loaded
    )
    reqs = [
        GenerationRequest(f"{name}-{i}", prompt=prompt, params=params)
        for name, params in VARIANTS.items()
        for i, prompt in enumerate(PROMPTS)
    ]
    whole = check_resumed(engine, reqs, [cuts[i % len(cuts)] for i in range(len(reqs))])
    stop = [r for r in whole if r.request_id.startswith("seeded-stop")]
    assert any(r.reason == "stop" for r in stop), "no stop string was ever hit: the case tests nothing"


def test_a_run_that_had_emitted_its_last_token_finishes_at_once(tiny_loaded):
    """Its end entry was all the crashed run missed: the resumed run decodes nothing."""
    engine = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    whole = engine.generate([GenerationRequest("done", prompt="Almost there", params=params)])[0]
    before = engine.batcher.stats.generated_tokens
    again = engine.generate(
        [GenerationRequest("done", prompt="Almost there", params=params, emitted=list(whole.token_ids))]
    )[0]
    assert again.reason == "length" and again.token_ids == whole.token_ids and again.text == whole.text
    assert engine.batcher.stats.generated_tokens == before


def test_the_seeded_draw_depends_on_the_seed_and_the_index_alone():
    from weightq.engine.sampling import seeded_uniform

    draws = [seeded_uniform(42, i) for i in range(2000)]
    assert draws == [seeded_uniform(42, i) for i in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) > 1990
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert draws[:50] != [seeded_uniform(43, i) for i in range(50)]


@pytest.mark.skipif(not available(), reason="xgrammar is not installed (make installs it)")
def test_a_guided_run_resumes_with_its_grammar_advanced(tiny_loaded):
    engine = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "maxItems": 3}},
        "required": ["name", "tags"],
    }
    reqs = [
        GenerationRequest(
            f"g{i}",
            prompt=prompt,
            params=SamplingParams(
                max_new_tokens=80, temperature=1.0, seed=i, guided=("json_schema", json.dumps(schema))
            ),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    for final in check_resumed(engine, reqs, [3, 6, 9, 12]):
        assert set(json.loads(final.text)) == {"name", "tags"}


def test_the_padded_runner_resumes_too(tiny_loaded):
    engine = Engine(EngineConfig(runner="padded", batcher=BatcherConfig(max_batch_weight=4096)), loaded=tiny_loaded)
    reqs = [
        GenerationRequest(f"p{i}", prompt=prompt, params=VARIANTS["seeded" if i % 2 else "greedy"])
        for i, prompt in enumerate(PROMPTS)
    ]
    check_resumed(engine, reqs, [4, 9, 20, 31])


def test_an_asynchronous_runner_resumes_too():
    """The simulated device defers a step's text and events (engine/loop/outputs.py: defer): the same."""
    engine = Engine(
        EngineConfig(runner="simulated", sim_step_cost="0.0001,0,0", batcher=BatcherConfig(max_batch_weight=4096))
    )
    reqs = [
        GenerationRequest(f"{name}-{i}", prompt=prompt, params=VARIANTS[name])
        for i, prompt in enumerate(PROMPTS)
        for name in ("greedy", "seeded", "seeded-stop")
    ]
    check_resumed(engine, reqs, [1 + 7 * i for i in range(len(reqs))])
