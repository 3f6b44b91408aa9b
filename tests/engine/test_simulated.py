"""RUNNER=simulated, the measuring tool: the real engine around a modelled device time."""

from __future__ import annotations

import pytest
from weightq.batcher import BatcherConfig, ConfigError
from weightq.batcher.sim.cost import StepCost
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams


def reqs(n: int, tag: str = "r", max_new: int = 24) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"{tag}{i}", prompt_token_ids=list(range(10, 30 + 7 * i)),
                          params=SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        for i in range(n)
    ]  # fmt: skip


def test_outputs_are_deterministic_and_the_budget_and_blocks_hold():
    cost = "0.0005,0.000001,0.0000001"
    engine = Engine(
        EngineConfig(
            runner="simulated",
            sim_step_cost=cost,
            check_invariants=True,
            batcher=BatcherConfig(max_batch_weight=512, max_total_tokens=128),
        )
    )
    first = engine.generate(reqs(12))
    again = engine.generate(reqs(12, "again"))
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 24 and o.reason == "length" for o in first)
    assert len({tuple(o.token_ids) for o in first}) == 12  # a function of each prompt, not a constant
    st = engine.stats()
    assert st["runner"] == "simulated" and st["overflow_steps"] == 0 and st["kv_blocks_used"] == 0
    assert st["max_batch_weight"] == 512  # 12 requests did not fit at once: admission was exercised


def test_the_modelled_device_time_is_the_step_cost_model():
    cost = StepCost(0.002, 1e-5, 1e-7)
    engine = Engine(
        EngineConfig(runner="simulated", sim_step_cost="0.002,1e-5,1e-7", batcher=BatcherConfig(max_batch_weight=4096))
    )
    engine.generate(reqs(4))
    st = engine.stats()
    # every step costs at least fixed_s; together no more than fixed_s + per-token terms of all the work
    assert st["forward_s"] >= st["steps"] * cost.fixed_s
    tokens = st["prefill_tokens"] + st["decode_tokens"]
    assert st["forward_s"] <= st["steps"] * cost.fixed_s + tokens * (cost.per_token_s + 300 * cost.per_kv_token_s)


def test_a_bad_step_cost_names_the_setting():
    with pytest.raises(ConfigError, match="sim_step_cost"):
        Engine(EngineConfig(runner="simulated", sim_step_cost="fast"))


def test_a_worker_runs_jobs_on_the_simulated_device(service):
    service.worker(runner="simulated", sim_step_cost="0.001,0.000001,0").wait_ready()
    job = service.client.submit(prompt_token_ids=list(range(10, 40)), max_new_tokens=16, ignore_eos=True)
    text = "".join(job.stream(timeout=120))
    result = job.result(timeout=60)
    assert result["usage"]["completion_tokens"] == 16 and text == result["text"]


def _mixed(tag: str, stop_id: int, stop_text: str) -> list[GenerationRequest]:
    base = list(range(10, 40))
    params = [
        SamplingParams(max_new_tokens=20, ignore_eos=True),
        SamplingParams(max_new_tokens=20, stop_token_ids=(stop_id,)),
        SamplingParams(max_new_tokens=20, stop=(stop_text,)),
    ]
    return [GenerationRequest(f"{tag}{i}", prompt_token_ids=base, params=p) for i, p in enumerate(params)] + reqs(
        5, tag + "x", max_new=12
    )


def _shape(events: dict) -> list:
    return [(type(e), getattr(e, "index", None), getattr(e, "text", None)) for ev in events.values() for e in ev]


def test_deferred_text_and_events_match_the_immediate_ones():
    """The simulated device is asynchronous: a step's text and events are made during the next
    forward. Outputs, finish reasons and each request's events must be what an immediate engine gives."""
    config = EngineConfig(
        runner="simulated",
        sim_step_cost="0.0005,0,0",
        check_invariants=True,
        batcher=BatcherConfig(max_batch_weight=2048),
    )
    probe = Engine(config).generate(_mixed("probe", 0, "unused")[:1])[0]
    stop_id, stop_text = probe.token_ids[6], probe.text[len(probe.text) // 2 :][:3] or probe.text
    runs = []
    for asynchronous in (True, False):
        events: list = []
        engine = Engine(config, sink=events.append)
        engine.runner.asynchronous = asynchronous
        finals = engine.generate(_mixed("m", stop_id, stop_text))
        per_request = {f.request_id: [e for e in events if e.request_id == f.request_id] for f in finals}
        runs.append((finals, per_request))
        assert engine.idle() and engine.stats()["kv_blocks_used"] == 0
    (deferred, d_events), (immediate, i_events) = runs
    assert [(f.reason, f.token_ids, f.text) for f in deferred] == [(f.reason, f.token_ids, f.text) for f in immediate]
    assert deferred[1].reason == "stop" and deferred[1].token_ids[-1] == stop_id
    assert deferred[2].reason == "stop" and stop_text not in deferred[2].text
    assert _shape(d_events) == _shape(i_events)


def test_a_cancel_on_the_asynchronous_device_comes_after_the_tokens_already_made():
    engine = Engine(
        EngineConfig(runner="simulated", sim_step_cost="0.002,0,0", batcher=BatcherConfig(max_batch_weight=2048))
    )
    engine.start()
    try:
        handle = engine.submit(reqs(1, "c", max_new=1000)[0], stream=True)
        events = handle.events(timeout=30)
        seen = [next(events) for _ in range(3)]
        engine.cancel("c0")
        rest = list(events)
    finally:
        engine.stop()
    tokens = seen + rest[:-1]
    assert [e.index for e in tokens] == list(range(len(tokens)))
    assert rest[-1].reason == "cancelled" and len(rest[-1].token_ids) == len(tokens)
