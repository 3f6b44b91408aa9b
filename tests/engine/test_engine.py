"""The engine against transformers' own generate(), on the built-in tiny model."""

from __future__ import annotations

import threading

import pytest
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, ModelNotFound, SamplingParams
from weightq.engine.model import load_model

from tests.reference import assert_greedy_equal, mixed_requests, reference


@pytest.fixture(scope="module")
def workload(reference_model):
    reqs = mixed_requests(48)
    return reqs, {r.id: reference(reference_model, r) for r in reqs}


def tight_engine(tiny_loaded, **kw) -> Engine:
    # 2,048 KV tokens for prompts up to 512 + 160 new: at most a few requests fit at once.
    # Real time drives jumping: on a slow machine a run outlasts the default max_wait_s (30 s) and then
    # nothing may jump, so the window is set past any run.
    limits = dict(
        max_batch_weight=2048, max_total_tokens=672, max_prefill_weight=128, max_wait_s=1e9, jump_window_s=1e9
    )
    return Engine(EngineConfig(check_invariants=True, batcher=BatcherConfig(**(limits | kw))), loaded=tiny_loaded)


def test_greedy_matches_generate_under_a_tight_budget(tiny_loaded, reference_model, workload):
    reqs, expected = workload
    engine = tight_engine(tiny_loaded)
    order: list[str] = []
    chunks: list[int] = []
    original = engine.batcher.schedule

    def spy(now):
        plan = original(now)
        order.extend(r.id for r in plan.admitted)
        chunks.extend(n for r, n in plan.prefill if n < r.context_len and r.prefilled == 0)
        return plan

    engine.batcher.schedule = spy
    results = engine.generate(reqs)
    ties = assert_greedy_equal(reference_model, reqs, results, expected)
    print("near-ties:", ties)
    assert all(r.reason in ("length", "eos") for r in results)
    assert engine.batcher.stats.rejected_projected > 0, "the budget never forced queueing"
    assert order != [r.id for r in reqs], "no request jumped the queue"
    assert chunks, "no prompt was prefilled in chunks"
    assert engine.batcher.ledger.used == 0


def test_predictive_mode_with_preemption_gives_the_same_greedy_outputs(tiny_loaded, reference_model, workload):
    reqs, expected = workload
    engine = tight_engine(tiny_loaded, mode="predictive", predictive_margin=0.0)
    # The estimator learns from finished requests: the second pass runs on its estimates.
    first = engine.generate(reqs)
    second = engine.generate(
        [GenerationRequest(r.id + "b", prompt_token_ids=r.prompt_token_ids, params=r.params) for r in reqs]
    )
    assert engine.batcher.stats.preemptions > 0, "the tight budget never forced a preemption"
    for res in (first, second):
        assert_greedy_equal(reference_model, reqs, res, expected)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(tiny_loaded):
    params = SamplingParams(
        max_new_tokens=40, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=1234, ignore_eos=True
    )
    target = GenerationRequest("target", prompt="The scheduler admits", params=params)
    alone = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded).generate([target])[0]
    busy = Engine(EngineConfig(check_invariants=True, batcher=BatcherConfig(max_prefill_weight=64)), loaded=tiny_loaded)
    others = [
        GenerationRequest(
            f"o{i}",
            prompt=f"Request {i} streams",
            params=SamplingParams(max_new_tokens=30 + i, temperature=1.0 if i % 2 else 0.0, top_p=0.8),
        )
        for i in range(12)
    ]
    results = busy.generate(
        [*others[:6], GenerationRequest("target", prompt=target.prompt, params=params), *others[6:]]
    )
    together = next(r for r in results if r.request_id == "target")
    assert together.token_ids == alone.token_ids
    assert together.text == alone.text
    unseeded = busy.generate(
        [
            GenerationRequest(
                "u", prompt=target.prompt, params=SamplingParams(max_new_tokens=40, temperature=0.9, ignore_eos=True)
            )
        ]
    )[0]
    assert unseeded.token_ids != alone.token_ids  # sampling really samples


def test_stop_sequences_end_generation_and_are_excluded(tiny_loaded):
    engine = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded)
    base = engine.generate(
        [GenerationRequest("base", prompt="The engine", params=SamplingParams(max_new_tokens=60, ignore_eos=True))]
    )[0]
    assert len(base.text) > 20
    stop = base.text[12:15]
    cut = base.text.index(stop)
    handle = engine.submit(
        GenerationRequest(
            "s",
            prompt="The engine",
            params=SamplingParams(max_new_tokens=60, ignore_eos=True, stop=("never-appears", stop)),
        ),
        stream=True,
    )
    while handle.final is None:
        engine.step()
    events = list(handle.events(timeout=0))
    final = events[-1]
    assert final.reason == "stop"
    assert final.text == base.text[:cut]
    assert "".join(e.text for e in events[:-1]) == final.text


def test_deltas_are_whole_characters_and_concatenate_to_the_text(tiny_loaded):
    from weightq.engine.text.detokenizer import IncrementalDetokenizer

    tok = tiny_loaded.tokenizer
    text = "Café, Größe: 日本語のテキスト 🎉🚀 and привет."
    ids = tok(text)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens held half a character back

    engine = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded)
    handles = [
        engine.submit(
            GenerationRequest(
                f"u{i}", prompt=text[: 10 + 5 * i], params=SamplingParams(max_new_tokens=50, temperature=1.0, seed=i)
            ),
            stream=True,
        )
        for i in range(6)
    ]
    while any(h.final is None for h in handles):
        engine.step()
    for h in handles:
        events = list(h.events(timeout=0))
        final = events[-1]
        assert "".join(e.text for e in events[:-1]) == final.text
        out = [t for t in final.token_ids if t not in tiny_loaded.eos_token_ids]
        assert final.text == tok.decode(out, skip_special_tokens=True)


def test_cancel_mid_generation_frees_the_blocks(tiny_loaded):
    engine = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded)
    engine.start()
    try:
        long = engine.submit(
            GenerationRequest("long", prompt="A long one", params=SamplingParams(max_new_tokens=1000, ignore_eos=True)),
            stream=True,
        )
        queued_cfg = SamplingParams(max_new_tokens=5)
        events = long.events(timeout=30)
        for _ in range(5):
            next(events)
        assert engine.batcher.ledger.used > 0
        assert engine.cancel("long")
        final = long.result(timeout=30)
        assert final.reason == "cancelled" and 5 <= final.completion_tokens < 1000
        other = engine.submit(GenerationRequest("after", prompt="x", params=queued_cfg))
        assert other.result(timeout=30).reason in ("length", "eos")
        assert engine.batcher.ledger.used == 0
        assert not engine.cancel("unknown-id")
    finally:
        engine.stop()


def test_cancel_a_queued_request(tiny_loaded):
    engine = Engine(
        EngineConfig(check_invariants=True, batcher=BatcherConfig(max_batch_size=1, max_total_tokens=256)),
        loaded=tiny_loaded,
    )
    a = engine.submit(GenerationRequest("a", prompt="first", params=SamplingParams(max_new_tokens=50, ignore_eos=True)))
    b = engine.submit(GenerationRequest("b", prompt="second", params=SamplingParams(max_new_tokens=5)))
    engine.step()
    assert [r.id for r in engine.batcher.waiting] == ["b"]
    engine.cancel("b")
    engine.step()
    assert b.final is not None and b.final.reason == "cancelled" and b.final.completion_tokens == 0
    while a.final is None:
        engine.step()
    assert a.final.completion_tokens == 50


def test_stop_token_ids_end_generation_keep_the_id_and_drop_its_text(tiny_loaded):
    engine = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded)
    free = SamplingParams(max_new_tokens=40, ignore_eos=True)
    base = engine.generate([GenerationRequest("base", prompt="The engine", params=free)])[0]
    stop_id = base.token_ids[7]
    cut = base.token_ids.index(stop_id)  # its first occurrence ends the request
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, stop_token_ids=(stop_id,))
    handle = engine.submit(GenerationRequest("s", prompt="The engine", params=params), stream=True)
    while handle.final is None:
        engine.step()
    events = list(handle.events(timeout=0))
    final = events[-1]
    assert final.reason == "stop"
    assert final.token_ids == base.token_ids[: cut + 1]  # the stop id is the last token
    assert events[-2].token_id == stop_id and events[-2].text == ""
    assert "".join(e.text for e in events[:-1]) == final.text
    assert base.text.startswith(final.text) and len(final.text) < len(base.text)
    bad = engine.generate(
        [GenerationRequest("b", prompt="x", params=SamplingParams(stop_token_ids=(len(tiny_loaded.tokenizer),)))]
    )[0]
    assert bad.reason == "error" and bad.error.startswith("stop_token_ids")


def test_no_max_new_tokens_runs_to_the_context_limit(tiny_loaded):
    """OpenAI's chat without max_tokens (tasks/limits.py: DEFAULTS) reaches the engine as None."""
    engine = Engine(EngineConfig(check_invariants=True, batcher=BatcherConfig(max_total_tokens=48)), loaded=tiny_loaded)
    params = SamplingParams(max_new_tokens=None, ignore_eos=True)
    done = engine.generate([GenerationRequest("ctx", prompt="The engine admits", params=params)])[0]
    assert done.reason == "length" and done.prompt_tokens + done.completion_tokens == 48


def test_bad_requests_fail_alone_with_errors_naming_the_field(tiny_loaded):
    """What needs the model (the contract checked the rest: tests/tasks/test_request.py)."""
    engine = Engine(
        EngineConfig(check_invariants=True, batcher=BatcherConfig(max_total_tokens=128)), loaded=tiny_loaded
    )
    bad = {"max_new_tokens": SamplingParams(max_new_tokens=0)}  # the batcher's own check
    reqs = [GenerationRequest(f"bad-{k}", prompt="hi", params=p) for k, p in bad.items()]
    reqs.append(GenerationRequest("too-long", prompt_token_ids=[5] * 200))
    reqs.append(GenerationRequest("over-total", prompt_token_ids=[5] * 100, params=SamplingParams(max_new_tokens=100)))
    reqs.append(GenerationRequest("bad-ids", prompt_token_ids=[10**9]))
    reqs.append(GenerationRequest("good", prompt="hello", params=SamplingParams(max_new_tokens=8)))
    results = {r.request_id: r for r in engine.generate(reqs)}
    for field in bad:
        assert results[f"bad-{field}"].reason == "error" and results[f"bad-{field}"].error.startswith(field)
    assert "max_input_length 127" in results["too-long"].error
    assert "max_total_tokens 128" in results["over-total"].error
    assert results["bad-ids"].error.startswith("prompt_token_ids")
    assert results["good"].reason in ("length", "eos") and results["good"].completion_tokens >= 1


def test_submit_is_thread_safe(tiny_loaded):
    engine = Engine(EngineConfig(check_invariants=True), loaded=tiny_loaded)
    engine.start()
    handles = []
    lock = threading.Lock()

    def client(k):
        for i in range(8):
            h = engine.submit(
                GenerationRequest(
                    f"t{k}-{i}", prompt=f"client {k} asks {i}", params=SamplingParams(max_new_tokens=4 + i)
                )
            )
            with lock:
                handles.append(h)

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(h.result(timeout=60).reason in ("length", "eos") for h in handles)
        stats = engine.stats()
        assert stats["finished"] == 32 and stats["running"] == 0 and stats["kv_blocks_used"] == 0
    finally:
        engine.stop()


def test_missing_model_is_a_clear_error():
    with pytest.raises(ModelNotFound, match=r"not a local directory.*builtin:tiny"):
        load_model("nobody/surely-not-a-model", attn_implementation="sdpa", allow_download=False)


def test_kv_capacity_derivation(tiny_loaded):
    from weightq.batcher import ConfigError

    engine = Engine(EngineConfig(kv_cache_mb=8), loaded=tiny_loaded)
    per_token = tiny_loaded.geometry.bytes_per_token
    assert per_token == 2 * 4 * 4 * 32 * 4  # K and V x layers x kv heads x head dim x fp32
    assert engine.batcher.budget == (8 * 2**20 // (per_token * 16)) * 16
    assert "kv_cache_mb=8 MiB" in engine.kv_derivation
    sized = Engine(EngineConfig(batcher=BatcherConfig(max_batch_size=3, max_total_tokens=100)), loaded=tiny_loaded)
    assert sized.batcher.budget == 3 * 112  # 100 tokens round up to 7 blocks of 16
    with pytest.raises(ConfigError, match=r"below the weight of one max-length request.*KV cache"):
        Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=256, max_total_tokens=672)), loaded=tiny_loaded)


def test_a_request_that_breaks_the_forward_fails_alone(tiny_loaded, reference_model):
    """A forward pass that raises for one request's input (here: a 'poison' token id in its prompt)
    fails that request with the error; the others finish exactly as without it; the pool is intact."""
    poison = 1099
    reqs = [r for r in mixed_requests(12, seed=7, max_prompt=64, max_new=48) if poison not in r.prompt_token_ids]
    bad = GenerationRequest("bad", prompt_token_ids=[11, 12, poison, 13], params=SamplingParams(max_new_tokens=8))

    def guard(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and (ids == poison).any():
            raise RuntimeError("poisoned input")

    hook = tiny_loaded.model.register_forward_pre_hook(guard, with_kwargs=True)
    try:
        engine = Engine(
            EngineConfig(check_invariants=True, batcher=BatcherConfig(max_batch_weight=8192)), loaded=tiny_loaded
        )
        results = engine.generate([*reqs[:6], bad, *reqs[6:]])
    finally:
        hook.remove()
    by_id = {r.request_id: r for r in results}
    assert by_id["bad"].reason == "error" and "poisoned input" in by_id["bad"].error
    assert_greedy_equal(reference_model, reqs, [by_id[r.id] for r in reqs])
    assert engine.batcher.ledger.used == 0 and not engine.batcher.running


def test_a_hosts_running_limit_caps_the_batcher_with_max_batch_size():
    """A worker's task threads (max_running) cap the running requests; with MAX_BATCH_SIZE the lower wins."""
    from weightq.engine.builder import make_batcher

    def cap(max_batch_size: int = 0, max_running: int = 0) -> int:
        cfg = EngineConfig(max_running=max_running, batcher=BatcherConfig(max_batch_size=max_batch_size))
        return make_batcher(cfg, 4096, 256, "test", block_size=16).config.max_batch_size

    assert cap() == 0 and cap(max_running=112) == 112
    assert cap(max_batch_size=8, max_running=112) == 8 and cap(max_batch_size=200, max_running=112) == 112
