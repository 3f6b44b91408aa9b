"""The batcher's LoRA adapter slots (batcher/adapters.py): a slot's weight leaves the budget when it is
allocated, an idle adapter gives its slot up (least recently used first), a request waits while every
slot there may be is in use, and admission projects the slot with the request."""

from __future__ import annotations

import pytest
from weightq.batcher import Batcher, Request, RequestRejected
from weightq.batcher.adapters import NEVER, AdapterSlots

from tests.batcher.alone import alone


def test_slots_grow_then_the_least_recently_used_idle_adapter_gives_its_up():
    s = AdapterSlots(slot_weight=100, max_capacity=2)
    assert s.extra_weight("") == 0 and s.acquire("", 0) == 0  # the base model's requests hold no slot
    assert s.extra_weight("a") == 100 and s.acquire("a", 1) == 100
    assert s.extra_weight("a") == 0 and s.acquire("a", 2) == 0  # resident: no weight, one more user
    assert s.acquire("b", 3) == 100 and s.capacity == 2
    assert s.extra_weight("c") == NEVER  # both slots in use and no more may be: c waits
    s.release("a")
    assert s.extra_weight("c") == NEVER  # a still has a user
    s.release("a")
    s.release("b")
    assert s.extra_weight("c") == 0  # idle adapters can give a slot up: no new weight
    assert s.acquire("c", 4) == 0 and s.slot_of == {"b": 1, "c": 0}  # a (used at step 2) before b (3)
    assert s.drain() == [("a", 0), ("b", 1), ("c", 0)] and s.drain() == []


def test_an_adapter_unloaded_in_use_keeps_its_slot_until_its_last_request_leaves():
    s = AdapterSlots(slot_weight=10, max_capacity=4)
    s.acquire("a", 0)
    s.forget("a")
    assert s.slot_of == {"a": 0}
    s.release("a")
    assert s.slot_of == {} and s.capacity == 1  # the slot stays allocated for the next adapter


def test_admission_counts_the_slot_and_a_request_whose_adapter_can_never_fit_is_refused():
    b = Batcher(alone(max_batch_weight=1000, max_total_tokens=400, mode="worst_case"), adapter_slot_weight=300)
    assert b.adapters.max_capacity == 2  # (1000 - one request of 400) // 300: one request still fits beside them
    b.submit(Request("base", 300, 100))
    b.submit(Request("x", 300, 100, adapter="a"))  # 400 + 400 + a slot of 300 > 1000: waits
    plan = b.schedule(0.0)
    assert [r.id for r in plan.admitted] == ["base"] and b.budget == 1000
    b.cancel("base")
    plan = b.schedule(0.0)
    assert [r.id for r in plan.admitted] == ["x"] and b.budget == 700 and b.adapters.capacity == 1
    none = Batcher(alone(max_batch_weight=1000, max_total_tokens=400))
    with pytest.raises(RequestRejected, match="model: adapter 'a': no LoRA adapter slot fits"):
        none.submit(Request("y", 10, 10, adapter="a"))
