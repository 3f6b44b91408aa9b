"""The padded runner: T5, BART and GPT-2 style models built tiny and locally, against generate()."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import (
    AutoTokenizer,
    BartConfig,
    BartForConditionalGeneration,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5ForConditionalGeneration,
)
from weightq.batcher import BatcherConfig, ConfigError
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.engine.model.builtin import shape_t5

from tests.reference import assert_matches, reference, requests


def _t5(v: int, ids: dict):
    small = dict(d_model=128, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=32)
    config = T5Config(vocab_size=v, initializer_factor=3.0, tie_word_embeddings=False, **small, **ids)
    model = T5ForConditionalGeneration(config)
    shape_t5(model)  # diverse output, well-conditioned (see engine/model/builtin.py)
    return model


def _bart(v: int, ids: dict):
    heads = dict(encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256)
    config = BartConfig(
        vocab_size=v, d_model=128, encoder_layers=2, decoder_layers=2, max_position_embeddings=512, init_std=0.3,
        forced_eos_token_id=None, **heads, **ids,
    )  # fmt: skip
    return BartForConditionalGeneration(config)


def _gpt2(v: int, ids: dict):
    config = GPT2Config(vocab_size=v, n_positions=512, n_embd=128, n_layer=2, n_head=4, initializer_range=0.1)
    config.eos_token_id = ids["eos_token_id"]
    return GPT2LMHeadModel(config)


FAMILIES = {"t5": _t5, "bart": _bart, "gpt2": _gpt2}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tmp_path_factory, tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = FAMILIES[request.param](len(tok), ids)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def padded_engine(model_dir, **kw) -> Engine:
    limits = BatcherConfig(**(dict(max_batch_weight=1500, max_total_tokens=220, max_prefill_weight=400) | kw))
    # check_invariants: the padded weight the tensors hold, every step
    return Engine(
        EngineConfig(model=str(model_dir), device="cpu", runner="padded", check_invariants=True, batcher=limits)
    )


def test_greedy_matches_generate_as_requests_join_and_leave(model_dir):
    engine = padded_engine(model_dir)
    reqs = requests(36)
    admitted_at: dict[str, int] = {}
    original = engine.batcher.schedule

    def spy(now):
        plan = original(now)
        admitted_at.update((r.id, engine.batcher.step) for r in plan.admitted)
        return plan

    engine.batcher.schedule = spy
    held: list[int] = []
    step = engine.step

    def counting_step():
        worked = step()
        held.append(engine.runner.weight())
        return worked

    engine.step = counting_step
    results = engine.generate(reqs)
    model = engine.lm.model
    # Encoder-decoder rows join the decode step directly (their cross K/V projected on admission).
    assert (engine.runner.cross is not None) == model.config.is_encoder_decoder
    for req, res in zip(reqs, results, strict=True):
        assert res.reason in ("length", "eos"), (req.id, res.error)
        assert_matches(model, req, list(res.token_ids), reference(model, req))
    assert len(set(admitted_at.values())) > 5, "requests should join the batch at many different steps"
    assert engine.batcher.stats.rejected_projected > 0, "the budget never made anyone wait"
    assert 0 < max(held) <= engine.batcher.budget
    assert engine.runner.rows is None and engine.stats()["kv_blocks_used"] == 0
    distinct = {t for r in results for t in r.token_ids}
    assert len(distinct) > 30, "random weights collapsed: equality would mean little"


def test_cancelling_one_request_mid_batch_leaves_the_others_unchanged(model_dir):
    engine = padded_engine(model_dir, max_batch_weight=4000)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    reqs = [GenerationRequest(r.id, prompt_token_ids=r.prompt_token_ids, params=params) for r in requests(8, seed=3)]
    victim = reqs[2]
    engine.runner.cross = None  # seq2seq rows take the general path here: a decoder pass of their own
    handles = [engine.submit(r) for r in reqs]
    for _ in range(10):
        engine.step()
    assert engine.runner.num_rows == len(reqs)
    engine.cancel(victim.id)
    while any(h.final is None for h in handles):
        engine.step()
    model = engine.lm.model
    for req, h in zip(reqs, handles, strict=True):
        if req is victim:
            assert h.final.reason == "cancelled" and len(h.final.token_ids) < 40
            continue
        want = reference_ignoring_eos(model, req)
        assert_matches(model, req, list(h.final.token_ids), want)
    assert engine.runner.rows is None


def reference_ignoring_eos(model, req: GenerationRequest) -> list[int]:
    ids = torch.tensor([req.prompt_token_ids])
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=req.params.max_new_tokens, do_sample=False)
    config.eos_token_id = []  # None would be filled in from the model's defaults
    if config.pad_token_id is None:
        config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(ids, generation_config=config)
    return out[0, 1 if model.config.is_encoder_decoder else ids.shape[1] :].tolist()


def test_budget_is_derived_from_measured_memory(tmp_path, tiny_path):
    from weightq.engine.model import builtin_path

    engine = Engine(EngineConfig(model="builtin:tiny-t5", device="cpu", kv_cache_mb=32))
    assert engine.lm.runner == "padded" and "B per weight unit" in engine.kv_derivation
    per_unit = 32 * 2**20 / engine.batcher.budget
    # One decoder token of self-attention KV is the least a weight unit can cost.
    assert per_unit >= engine.lm.geometry.bytes_per_token
    assert builtin_path("tiny-t5").exists()
    out = engine.generate([GenerationRequest("a", prompt="hello there", params=SamplingParams(max_new_tokens=5))])
    assert out[0].completion_tokens == 5 or out[0].reason == "eos"


def test_auto_picks_the_runner_and_refuses_paged_for_seq2seq(tiny_loaded):
    assert Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=4096)), loaded=tiny_loaded).lm.runner == "paged"
    with pytest.raises(ConfigError, match="runner: the paged runner cannot serve"):
        Engine(
            EngineConfig(
                model="builtin:tiny-t5", device="cpu", runner="paged", batcher=BatcherConfig(max_batch_weight=4096)
            )
        )
    with pytest.raises(ConfigError, match="mode: the padded runner supports worst_case only"):
        Engine(
            EngineConfig(
                model="builtin:tiny-t5", device="cpu", batcher=BatcherConfig(mode="predictive", max_batch_weight=4096)
            )
        )


def test_a_seq2seq_worker_streams_cancels_and_serves_the_gateway(service, tmp_path):
    """The same task, cancellation, stats and HTTP front door on top of the padded runner."""
    import httpx
    from weightq.cli.processes import GatewayProcess

    w = service.worker(model="builtin:tiny-t5").wait_ready()
    gateway = GatewayProcess(service.url, tmp_path).wait_ready()
    try:
        running = service.client.submit("translate this", max_new_tokens=400, ignore_eos=True)
        other = service.client.submit("and this one", max_new_tokens=30, ignore_eos=True)
        tokens = 0
        for ev in running.events(timeout=60):
            tokens += ev.type == "token"
            if tokens >= 5:
                break
        assert running.cancel() == "running"
        assert running.result(timeout=30)["finish_reason"] == "cancelled"
        assert other.result(timeout=60)["usage"]["completion_tokens"] == 30
        r = httpx.post(gateway.base + "/v1/completions", json={"prompt": "hello", "max_tokens": 6}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 6
        with httpx.stream("POST", gateway.base + "/v1/completions", timeout=60,
                          json={"prompt": "hello", "max_tokens": 6, "stream": True}) as s:  # fmt: skip
            chunks = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]" and len(chunks) >= 2
        deadline = time.monotonic() + 5
        while w.stats().get("kv_blocks_used") != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        stats = w.stats()
        assert stats["kv_blocks_used"] == 0 and stats["runner"] == "padded" and stats["block_size"] == 1
    finally:
        gateway.stop()


def test_a_failing_step_fails_its_batch_and_the_engine_serves_on():
    """The padded runner cannot rerun one row alone (every running row is in every step): a step
    whose forward raises fails the requests in it, leaves no stale rows, and the next work runs."""
    engine = Engine(
        EngineConfig(
            model="builtin:tiny-t5", device="cpu", check_invariants=True, batcher=BatcherConfig(max_batch_weight=4096)
        )
    )
    poison = 1099

    def guard(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and (ids == poison).any():
            raise RuntimeError("poisoned input")

    hook = engine.lm.model.get_encoder().register_forward_pre_hook(guard, with_kwargs=True)
    try:
        first = [GenerationRequest(f"a{i}", prompt_token_ids=[11 + i, 12, 13], params=SamplingParams(max_new_tokens=20))
                 for i in range(3)]  # fmt: skip
        handles = [engine.submit(r) for r in first]
        for _ in range(3):
            engine.step()
        bad = engine.submit(GenerationRequest("bad", prompt_token_ids=[11, poison], params=SamplingParams()))
        while bad.final is None or any(h.final is None for h in handles):
            engine.step()
    finally:
        hook.remove()
    assert bad.final.reason == "error" and "poisoned input" in bad.final.error
    assert all(h.final.reason == "error" for h in handles)  # they shared the failed step
    assert engine.runner.rows is None and not engine.batcher.running
    after = GenerationRequest("after", prompt_token_ids=[20, 21, 22], params=SamplingParams(max_new_tokens=12))
    out = engine.generate([after])[0]
    assert_matches(engine.lm.model, after, list(out.token_ids), reference(engine.lm.model, after))
