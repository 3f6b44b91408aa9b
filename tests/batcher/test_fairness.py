"""Fairness between tenants inside a class (batcher/fairness.py): virtual counters in weight units,
a returning tenant saves no credit, a light tenant's request starts beside another's flood."""

from __future__ import annotations

from weightq.batcher import Batcher, BatcherConfig, Request
from weightq.batcher.fairness import TenantShares, jain_index
from weightq.batcher.sim import simulate_tenants

from tests.batcher.alone import alone
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
    b = Batcher(alone(max_batch_weight=64, max_total_tokens=32, jump_window_s=0.0))
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
    cfg = alone(max_batch_weight=16384, max_total_tokens=2048, max_prefill_weight=4096).resolved()
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
    cfg = alone(
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


def _count_bound(**kw) -> BatcherConfig:
    """A budget with room for everyone: the cap on running requests (a worker's task threads) binds."""
    return alone(max_batch_weight=100_000, max_total_tokens=256, max_batch_size=8, mode="worst_case", **kw)


def _capped(b: Batcher) -> None:
    assert len(b.running) <= b.config.max_batch_size
    b.check_memory()


def test_a_light_tenant_takes_a_slot_from_a_flood_when_the_count_binds_not_the_weight():
    flood = [Request(f"a{i}", 8, 120, arrival_s=0.0, tenant="a") for i in range(40)]
    light = [Request(f"b{i}", 4, 4, arrival_s=1.0 + i, tenant="b") for i in range(5)]
    run = drive(Batcher(_count_bound()), flood + light, on_step=_capped)
    first = {}
    for _step, now, rid in run.admitted:
        first.setdefault(rid, now)
    for r in light:  # each starts in the step it arrives in (dt 0.1 s), not after a wave of 120 tokens
        assert first[r.id] - r.arrival_s <= 0.15, (r.id, first[r.id])
    assert len(run.finished) == 45


def test_an_urgent_class_takes_a_background_slot_when_the_count_binds():
    batch = [Request(f"l{i}", 8, 120, arrival_s=0.0, priority=2) for i in range(30)]
    chat = [Request(f"c{i}", 4, 4, arrival_s=0.5 + i, priority=5) for i in range(4)]
    b = Batcher(_count_bound(fairness=False))
    run = drive(b, batch + chat, on_step=_capped)
    first = {rid: now for _, now, rid in reversed(run.admitted)}
    assert all(first[c.id] - c.arrival_s <= 0.15 for c in chat), first
    assert b.stats.preemptions >= len(chat)


def test_without_a_reason_to_preempt_the_count_cap_holds_the_queue():
    """One tenant, one class: a full batch preempts no one, and room_for says there is none."""
    b = Batcher(_count_bound())
    for i in range(12):
        b.submit(Request(f"r{i}", 8, 50, arrival_s=0.0))
    b.schedule(0.0)
    assert len(b.running) == 8 and b.stats.preemptions == 0
    assert b.room_for() == 0


def test_room_for_counts_the_slots_the_cap_leaves():
    b = Batcher(_count_bound())
    assert b.room_for() == 8
    for i in range(3):
        b.submit(Request(f"r{i}", 8, 50, arrival_s=0.0))
    assert b.room_for() == 5  # waiting requests take slots too
    b.schedule(0.0)
    assert b.room_for() == 5


def test_a_flood_holding_the_slots_is_heavy_though_its_weight_is_small():
    b = Batcher(_count_bound())
    for i in range(8):
        b.submit(Request(f"a{i}", 8, 50, arrival_s=0.0, tenant="a"))
    b.schedule(0.0)
    assert b.committed < b.budget / 10  # the weight is far from binding
    assert b.urgency().heavy_tenants == ("a",)
