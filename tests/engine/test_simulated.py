"""RUNNER=simulated, the measuring tool: the real engine around a modelled device time."""

from __future__ import annotations

import pytest

from batcher import ConfigError
from batcher.sim.cost import StepCost
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams


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
            runner="simulated", max_batch_weight=512, max_total_tokens=128, sim_step_cost=cost, check_invariants=True
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
    engine = Engine(EngineConfig(runner="simulated", max_batch_weight=4096, sim_step_cost="0.002,1e-5,1e-7"))
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
