"""Priority classes in the batcher: order, no jumping over a higher class, aging, headroom; and the
simulator's mixed preset."""

from __future__ import annotations

from weightq.batcher import Batcher, Request, RequestRejected
from weightq.batcher.sim import simulate_mixed

from tests.batcher.alone import alone


def batcher(budget=100, **kw) -> Batcher:
    kw.setdefault("max_total_tokens", budget)
    return Batcher(alone(max_batch_weight=budget, **kw))


def test_a_higher_class_is_admitted_first_and_arrival_order_holds_within_a_class():
    b = batcher(60)
    for rid, prio, t in (("bg1", 0, 0.0), ("bg2", 0, 0.1), ("hi1", 9, 0.2), ("mid", 5, 0.3), ("hi2", 9, 0.4)):
        b.submit(Request(rid, 5, 5, arrival_s=t, priority=prio))
    assert [r.id for r in b.waiting] == ["hi1", "hi2", "mid", "bg1", "bg2"]
    assert [r.id for r in b.schedule(1.0).admitted] == ["hi1", "hi2", "mid", "bg1", "bg2"]


def test_a_lower_class_never_jumps_a_blocked_higher_one():
    b = batcher(100, jump_window_s=100.0)
    b.submit(Request("run", 10, 50, arrival_s=0.0))
    b.schedule(0.0)
    b.submit(Request("hi", 40, 40, arrival_s=1.0, priority=9))  # does not fit beside "run"
    b.submit(Request("bg", 5, 5, arrival_s=0.5, priority=0))  # would fit, and arrived earlier
    b.submit(Request("hi-small", 5, 5, arrival_s=1.5, priority=9))  # same class, in the jump window
    assert [r.id for r in b.schedule(2.0).admitted] == ["hi-small"]


def test_a_request_that_waited_max_wait_ranks_with_the_top_class():
    b = batcher(100, max_wait_s=10.0)
    b.submit(Request("run", 10, 80, arrival_s=0.0))
    b.schedule(0.0)
    b.submit(Request("old-bg", 40, 40, arrival_s=1.0, priority=0))
    b.submit(Request("new-hi", 40, 40, arrival_s=5.0, priority=9))
    b.schedule(6.0)  # neither fits beside "run"
    assert [r.id for r in b.waiting] == ["new-hi", "old-bg"]
    b.schedule(12.0)  # old-bg has waited 11 s
    assert [r.id for r in b.waiting] == ["old-bg", "new-hi"]
    b.finish("run")
    assert next(r.id for r in b.schedule(13.0).admitted) == "old-bg"


def test_background_classes_leave_the_headroom_to_higher_ones():
    b = batcher(100, priority_headroom=0.2)  # 20 tokens background work may not take
    b.submit(Request("bg1", 30, 30, priority=0))
    b.submit(Request("bg2", 10, 40, priority=0))
    assert [r.id for r in b.schedule(0.0).admitted] == ["bg1"]  # bg2 beside it peaks at 100 > 80
    b.submit(Request("hi", 10, 15, priority=9))
    assert [r.id for r in b.schedule(0.1).admitted] == ["hi"]
    assert b.batch_weight() <= 100


def test_priority_out_of_range_is_refused_by_name():
    b = batcher()
    try:
        b.submit(Request("x", 5, 5, priority=10))
    except RequestRejected as e:
        assert e.field == "priority"
    else:
        raise AssertionError("priority 10 accepted")


def test_the_mixed_preset_keeps_interactive_ttft_and_throughput():
    cfg = alone(max_batch_weight=16384, max_total_tokens=2048, max_prefill_weight=4096, block_size=16,
                        priority_headroom=0.1)  # fmt: skip
    out = simulate_mixed(cfg, n=1500)
    assert out["overflow_steps"] == 0
    assert out["interactive_ttft_p99_ratio"] <= 1.5, out
    assert out["throughput_ratio"] >= 0.95, out
    assert out["background_ttft_p99_s"] > out["interactive_ttft_p99_s"]


def test_gateway_priority_comes_from_the_header_capped_by_the_keys_class():
    import pytest
    from weightq.gateway.errors import HTTPError
    from weightq.gateway.priority import key_classes, request_priority

    assert key_classes("k1:9, k2:0,") == {"k1": 9, "k2": 0}
    with pytest.raises(ValueError, match="KEY_PRIORITIES"):
        key_classes("k3:10")
    assert request_priority(None, None) is None  # the job's default class
    assert request_priority("7", None) == 7
    assert request_priority("7", 2) == 2  # a key's class is the most its requests may ask
    assert request_priority(None, 9) == 9
    with pytest.raises(HTTPError) as e:
        request_priority("high", None)
    assert e.value.status == 400 and e.value.field == "X-Priority"


def test_within_a_class_the_submission_time_orders_and_aging_counts_the_wait_here():
    b = batcher(100, max_wait_s=10.0)
    b.submit(Request("run", 10, 80, arrival_s=0.0))
    b.schedule(0.0)
    b.submit(Request("reached-first", 40, 40, arrival_s=1.0, submitted_s=0.8))
    b.submit(Request("submitted-first", 40, 40, arrival_s=1.1, submitted_s=-30.0, priority=5))
    assert [r.id for r in b.waiting] == ["submitted-first", "reached-first"]
    b.submit(Request("bg", 40, 40, arrival_s=1.2, submitted_s=-60.0, priority=0))
    b.schedule(2.0)  # a minute in Redis does not age it past the classes: its wait here is 0.8 s
    assert [r.id for r in b.waiting][-1] == "bg"
