"""The Batcher's parts, each alone: they own their state, answer questions without side effects and
return values the Batcher applies (batcher/batcher.py). None of them is handed a Batcher."""

from __future__ import annotations

from weightq.batcher import Request, chain_keys, weight_model
from weightq.batcher.adapters import AdapterSlots
from weightq.batcher.admission import prefill_chunk, with_slot
from weightq.batcher.fairness import TenantShares
from weightq.batcher.outlook import spread
from weightq.batcher.paging import NO_HIT, Paging
from weightq.batcher.preemption import for_class, for_tenant, newest
from weightq.batcher.projector import Projector
from weightq.batcher.request import DECODING, PREFILLING

from tests.batcher.alone import alone


def _decoding(rid: str, tenant: str = "", admitted: int = 0, priority: int = 5, n: int = 10) -> Request:
    r = Request(rid, n, n, tenant=tenant, priority=priority, admitted_step=admitted)
    r.status, r.reserved_new = DECODING, n
    return r


def test_a_prefix_cache_lookup_is_a_question_and_holding_the_hit_takes_the_blocks():
    w = weight_model("token", 4)
    paging = Paging(w, 16, True, ())
    keys = chain_keys(list(range(12)), 4)
    first = Request("a", 12, 4, prefix=keys)
    paging.allocate(first, 12, lambda rid: 10)  # its three full blocks join the cache
    paging.leave(first, lambda rid: 10)
    idle_before = paging.ledger.idle
    again = Request("b", 12, 4, prefix=keys)
    hit = paging.lookup(again)
    assert (hit.blocks, hit.tokens) == (2, 8)  # the last block is computed again: its logits are needed
    assert paging.lookup(again) == hit  # asked twice, the same answer ...
    assert again.shared_blocks == again.prefilled == 0 and again.block_table == []  # ... and nothing changed
    assert paging.ledger.idle == idle_before and paging.pinned_pages == 0
    assert paging.lookup(Request("c", 12, 4, prefix=chain_keys(list(range(1, 13)), 4))) is NO_HIT
    again.shared_blocks, again.prefilled = hit.blocks, hit.tokens  # the Batcher applies the hit when it starts
    changed = paging.hold(again, lambda rid: 10)
    assert changed == {"b"} and paging.ledger.idle == idle_before - 2 and paging.shared.held_blocks == 2


def test_the_projector_returns_each_requests_own_weight_and_the_finish_that_moved():
    proj = Projector(weight_model("token", 1), 0)
    r = Request("r", 10, 5)
    r.reserved_new = 5
    assert proj.start(r, 10, 0, step=3) == 15  # its reserved final weight
    assert proj.finish_of("r") == 3 + 5 and "r" in proj.prefilling
    r.prefilled, r.generated, r.status = 10, 1, DECODING
    assert proj.decodes(r, 4) is None  # the same finish: step 4 + 4 left
    assert proj.profile().peak() == 15
    assert proj.stop(r) == 15 and proj.profile().peak() == 0


def test_tenant_shares_count_weight_and_requests_and_judge_by_whichever_binds():
    t = TenantShares()
    t.start("a", 100)
    t.start("a", 50)
    t.shift("a", -30)  # blocks became cached, charged apart
    assert t.reserved["a"] == 120 and t.running["a"] == 2
    assert t.use("a", 0.0) == 120 and t.use("a", 100.0) == 200  # in slots of 100 the count binds
    assert t.use("b", 100.0, 10, 1) == 100  # reads without inserting
    assert "b" not in t.reserved
    t.stop("a", 70)
    assert t.reserved["a"] == 50 and t.running["a"] == 1


def test_adapter_slots_are_sized_once_and_leave_room_for_one_request():
    assert AdapterSlots.sized(300, 600).max_capacity == 2
    assert AdapterSlots.sized(0, 600).max_capacity == 0  # adapters not served
    s = AdapterSlots.sized(300, 600)
    assert s.acquire("x", 0) == 300 and s.acquire("y", 0) == 300 and s.extra_weight("z") > 10**9


def test_preemption_chooses_from_values_and_changes_nothing():
    running = [
        _decoding("a1", "a", 0),
        _decoding("a2", "a", 1),
        _decoding("a3", "a", 2),
        _decoding("b1", "b", 0, priority=2),
    ]
    shares = TenantShares()
    for r in running:
        shares.start(r.tenant, 20)
    snapshot = (dict(shares.reserved), dict(shares.running), [r.status for r in running])
    # the candidate fits once 40 weight is freed: the newest two of the tenant holding the most
    freed = lambda ids: 20 * len(ids) >= 40  # noqa: E731
    cand = Request("c", 10, 10, tenant="c")
    got = for_tenant(cand, 20, shares, 0.0, 40.0, running, lambda r: 20, 2, 5, freed)
    assert [r.id for r in got] == ["a3", "a2"]
    assert (dict(shares.reserved), dict(shares.running), [r.status for r in running]) == snapshot
    # background (below class 5) goes first, the newest of the lowest class
    assert [r.id for r in for_class(running, lambda r: r.priority, 5, 5, lambda ids: True)] == ["b1"]
    assert for_class(running, lambda r: r.priority, 5, 5, lambda ids: False) is None
    assert newest(running, lambda r: r.admitted_step, 2).id == "a3"


def test_a_slot_under_the_cap_and_the_prefill_chunk_are_plain_rules():
    admits = with_slot(4, 4, lambda ids: True)
    assert not admits(set()) and admits({"x"})
    assert with_slot(0, 99, lambda ids: True)(set())  # no cap
    cfg = alone(max_batch_weight=10_000, max_prefill_weight=100)
    w = weight_model("token", 1)
    assert prefill_chunk(cfg, w, 60, 0, 0, 0) == 60
    assert prefill_chunk(cfg, w, 60, 1, 60, 60) == 40  # chunked: what the cap leaves
    assert prefill_chunk(cfg, w, 60, 2, 60, 100) == 0  # the step's prefill is spent
    padded = alone(max_batch_weight=10_000, max_prefill_weight=100, weight_model="padded").resolved()
    assert prefill_chunk(padded, weight_model("padded", 1), 80, 1, 60, 60) is None  # waits to run alone


def test_the_outlook_spreads_many_finishes_as_quantiles():
    assert spread([1, 2, 3], 64) == [1, 2, 3]
    many = list(range(1000))
    out = spread(many, 64)
    assert len(out) == 64 and out[0] == 0 and out == sorted(out) and out[-1] >= 980


def test_a_request_admitted_with_a_hit_starts_after_its_cached_blocks():
    from weightq.batcher import Batcher

    b = Batcher(alone(max_batch_weight=4000, block_size=4, prefix_cache=True))
    keys = chain_keys(list(range(16)), 4)
    b.submit(Request("a", 16, 2, prefix=keys))
    b.complete(b.schedule(0.0))
    b.finish("a")
    later = Request("b", 16, 2, prefix=keys)
    b.submit(later)
    plan = b.schedule(0.0)
    assert plan.prefill == [(later, 4)] and later.shared_blocks == 3 and later.status is PREFILLING
    b.check_memory()
    b.submit(Request("filler", 2000, 48))
    b.complete(b.schedule(0.0))
    blocked = Request("c", 2000, 40, prefix=chain_keys(list(range(2000)), 4))
    assert b.paging.lookup(blocked).blocks == 4  # the blocks `later` holds and the one it cached
    b.submit(blocked)  # does not fit beside the filler: its lookup left it as it was
    assert not b.schedule(0.0).admitted
    assert blocked.shared_blocks == blocked.prefilled == 0 and b.paging.pinned_pages == 0
    b.check_memory()
