"""Fairness between tenants inside a class (batcher/fairness.py): virtual counters in weight units,
a returning tenant saves no credit, a light tenant's request starts beside another's flood."""

from __future__ import annotations

from weightq.batcher import Batcher, BatcherConfig, Request
from weightq.batcher.fairness import TenantShares, jain_index
from weightq.batcher.sim import simulate_tenants

from tests.drive import drive


def test_the_tenant_with_the_least_service_goes_first_and_tenants_interleave():
    shares = TenantShares()
    waiting = [Request(f"{t}{i}", 10, 10, tenant=t) for t in ("a", "b") for i in range(3)]
    for r in waiting:
        shares.arrive(r.tenant)
    shares.counter["a"] = 100.0  # a has been served more
    order = [r.id for _, r in shares.order(waiting, lambda r: 0, lambda r: 60.0)]
    assert order == ["b0", "b1", "a0", "b2", "a1", "a2"]  # b catches up, then they alternate by cost


def test_a_tenant_back_from_idle_starts_at_the_active_minimum():
    shares = TenantShares()
    shares.arrive("a")
    shares.counter["a"] = 500.0
    shares.arrive("b")  # new: no credit for having been away
    assert shares.counter["b"] == 500.0
    shares.leave("b")
    shares.counter["a"] = 900.0
    shares.arrive("b")
    assert shares.counter["b"] == 900.0


def test_one_tenant_is_served_in_arrival_order_and_charged_nothing():
    b = Batcher(BatcherConfig(max_batch_weight=64, max_total_tokens=32, jump_window_s=0.0))
    reqs = [Request(str(i), 8, 8, arrival_s=i * 0.1) for i in range(12)]
    for r in reqs:
        b.submit(r)
    admitted = []
    while b.running or b.waiting:
        plan = b.schedule(1.0)
        admitted += [r.id for r in plan.admitted]
        for r in b.complete(plan):
            if r.generated >= r.max_new_tokens:
                b.finish(r.id)
    assert admitted == [str(i) for i in range(12)] and not b.tenants.counter.get("", 0.0)


def test_a_light_tenant_is_not_starved_by_a_flood_and_throughput_holds():
    """The `weightq sim --preset tenants` case: a 1,000-request batch at t=0 and one request a second from
    another tenant, one class. First come first served makes the light tenant wait for the whole batch."""
    cfg = BatcherConfig(max_batch_weight=16384, max_total_tokens=2048, max_prefill_weight=4096).resolved()
    out = simulate_tenants(cfg, flood=400, light_rate=1.0)
    assert out["light_ttft_p99_fcfs_s"] > 20 * out["light_ttft_p99_s"]
    assert out["light_ttft_p99_ratio"] < 4  # of its TTFT alone: it starts within a step or two
    assert out["throughput_ratio"] >= 0.95 and out["overflow_steps"] == 0
    assert out["jain_index"] >= out["jain_index_fcfs"] and out["jain_index"] > 0.95


def test_jain_index():
    assert jain_index([1.0, 1.0, 1.0]) == 1.0
    assert abs(jain_index([1.0, 0.0]) - 0.5) < 1e-9


def test_a_tenant_at_its_share_keeps_its_own_order_when_a_preemption_frees_it():
    """Tenant a at its share is passed over; b's request then preempts one of a's, which frees a's
    share in the same pass: a's later, smaller request must not start ahead of its earlier one
    (found by test_properties with jumping off)."""
    cfg = BatcherConfig(
        max_batch_weight=81, max_total_tokens=28, weight_model="padded", block_size=1, jump_window_s=0.0,
        mode="worst_case", fairness=True, tenant_cap=0.5, fair_preemption=True,
    )  # fmt: skip
    reqs = [
        Request("0", 1, 12, arrival_s=0.0, tenant="a"),
        Request("1", 25, 3, arrival_s=0.0, tenant="a"),
        Request("2", 1, 3, arrival_s=0.0, tenant="a"),
        Request("3", 1, 2, arrival_s=0.05, tenant="b"),
        Request("4", 1, 1, arrival_s=0.05, tenant="a"),
    ]
    run = drive(Batcher(cfg), reqs)
    first = {}
    for step, _, rid in run.admitted:
        first.setdefault(rid, step)
    assert first["2"] <= first["4"], run.admitted  # a's own arrival order
    assert first["3"] == 1  # b still started as soon as it came
    assert len(run.finished) == 5
