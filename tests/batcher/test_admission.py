"""Hand-worked admission cases: the numbers here can be checked with pencil and paper."""

import math
from dataclasses import replace

import pytest
from weightq.batcher import Batcher, BatcherConfig, ConfigError, Entry, Request, RequestRejected, TokenProfile

from tests.batcher.alone import alone
from tests.drive import drive


def batcher(budget=100, **kw) -> Batcher:
    kw.setdefault("max_total_tokens", budget)
    return Batcher(alone(max_batch_weight=budget, **kw))


def test_projection_admits_what_the_naive_sum_would_refuse():
    # Running: input 10, 50 tokens left. Candidate: input 60, max_new 5.
    # Naive sum 60 + 65 = 125 > 100, but the peak is at the candidate's finish: 15 + 65 = 80.
    b = batcher()
    b.submit(Request("run", 10, 50))
    b.submit(Request("cand", 60, 5))
    plan = b.schedule(now=0.0)
    assert [r.id for r in plan.admitted] == ["run", "cand"]
    assert b.projected_peak() == 80
    assert b.stats.admitted_projected == 1


def test_projection_refuses_a_candidate_that_peaks_over_the_budget():
    # Candidate (40, 40): at step 40 the running one holds 50 and the candidate 80: 130 > 100.
    b = batcher()
    b.submit(Request("run", 10, 50))
    b.submit(Request("cand", 40, 40))
    plan = b.schedule(now=0.0)
    assert [r.id for r in plan.admitted] == ["run"]
    profile = TokenProfile([Entry(50, 10, 60), Entry(40, 40, 80)], 1)
    assert profile.peak() == 130
    assert profile.load_at(40) == 130 and profile.load_at(50) == 60


def test_profile_is_updated_in_place_as_requests_come_and_go():
    # Running (10, 50 left) and (40, 40 left): peak 50 + 80 = 130 at step 40. Without the second, 60 at
    # step 50; with (5, 20 left) added: 30 + 25 = 55 at step 20, still 60 at step 50.
    profile = TokenProfile([Entry(50, 10, 60), Entry(40, 40, 80)], 1)
    profile.remove(Entry(40, 40, 80))
    assert profile.points == [50] and profile.peak() == 60 and profile.load_at(40) == 50
    profile.add(Entry(20, 5, 25))
    assert profile.points == [20, 50] and profile.load_at(20) == 55 and profile.peak() == 60
    with pytest.raises(ValueError):
        profile.remove(Entry(20, 6, 26))  # never added


def test_a_finish_updates_the_batchers_profile_without_a_rebuild():
    b = batcher()
    b.submit(Request("run", 10, 50))
    b.submit(Request("cand", 60, 5))
    b.complete(b.schedule(now=0.0))
    profile = b.profile()
    assert b.projected_peak() == 80  # "cand" finishing at step 5: 15 + 65
    b.finish("cand")  # early (EOS): only "run" is left, at 60 when it finishes
    assert b.projected_peak() == 60
    assert b.profile() is profile


def test_rejected_candidate_is_admitted_at_the_first_step_it_fits():
    # Admitted at step s, "cand" peaks at step s+40 (with "run" still there while s+40 <= 50:
    # 50+s + 80 > 100) or at step 50 ("run" at 60 plus cand at 40 + 50-s): it fits only from s = 50.
    run = drive(batcher(), [Request("run", 10, 50), Request("cand", 40, 40)])
    assert [(step, rid) for step, _, rid in run.admitted] == [(0, "run"), (50, "cand")]
    assert run.finished == {"run": 50, "cand": 90}


def jump_setup(**kw):
    b = batcher(**kw)
    b.submit(Request("big-running", 50, 40, arrival_s=0.0))
    b.schedule(now=0.0)
    for r in (Request("X", 30, 30, 0.0), Request("Y", 2, 3, 0.5), Request("Z", 2, 3, 1.2)):
        b.submit(r)
    return b


def test_jump_window():
    # X (t=0) does not fit; Y (t=0.5) fits and jumps it; Z (t=1.2) also fits but is outside the window.
    b = jump_setup(jump_window_s=1.0)
    plan = b.schedule(now=1.3)
    assert [r.id for r in plan.admitted] == ["Y"]
    assert [r.id for r in b.waiting] == ["X", "Z"]


def test_no_jumping_when_window_is_zero():
    b = jump_setup(jump_window_s=0.0)
    assert b.schedule(now=1.3).admitted == []


def test_nothing_jumps_a_request_that_waited_too_long():
    b = jump_setup(jump_window_s=1.0, max_wait_s=5.0)
    assert b.schedule(now=5.5).admitted == []


def test_idle_step_skips_the_pass_until_something_changes():
    b = jump_setup(jump_window_s=1.0)
    b.schedule(now=1.3)  # admits Y
    b.schedule(now=1.4)  # X still blocked, Z outside the window: decides nothing, marks idle
    passes = b.stats.idle_passes
    b.schedule(now=1.5)
    assert b.stats.idle_passes == passes + 1
    b.submit(Request("W", 1, 1, 1.6))
    b.schedule(now=1.7)
    assert b.stats.idle_passes == passes + 1  # a new arrival forces a real pass


def test_prefill_cap_without_chunking_spreads_prompts_over_steps():
    b = batcher(budget=1000, max_prefill_weight=100, chunked_prefill=False)
    for i in range(3):
        b.submit(Request(f"p{i}", 60, 2))
    assert [r.id for r in b.schedule(0.0).admitted] == ["p0"]


def test_prompt_longer_than_cap_runs_alone_without_chunking():
    b = batcher(budget=1000, max_prefill_weight=100, chunked_prefill=False)
    b.submit(Request("small", 10, 2))
    b.submit(Request("long", 150, 2))
    plan = b.schedule(0.0)
    assert [r.id for r in plan.admitted] == ["small"]  # "long" may not join a step that prefills
    b.complete(plan)
    plan = b.schedule(0.1)
    assert [(r.id, n) for r, n in plan.prefill] == [("long", 150)]


def test_chunked_prefill_splits_a_long_prompt_at_the_cap():
    b = batcher(budget=1000, max_prefill_weight=100)
    b.submit(Request("long", 250, 3))
    chunks = []
    for step in range(3):
        plan = b.schedule(step * 0.1)
        chunks.append([(r.id, n) for r, n in plan.prefill])
        emitted = b.complete(plan)
        assert (emitted != []) == (step == 2)  # the first token comes with the last chunk
    assert chunks == [[("long", 100)], [("long", 100)], [("long", 50)]]


def test_chunking_shares_the_cap_fifo_with_new_prompts():
    b = batcher(budget=2000, max_prefill_weight=100)
    b.submit(Request("long", 150, 3))
    b.submit(Request("short", 30, 3))
    plan = b.schedule(0.0)
    assert [(r.id, n) for r, n in plan.prefill] == [("long", 100)]
    b.complete(plan)
    plan = b.schedule(0.1)
    assert [(r.id, n) for r, n in plan.prefill] == [("long", 50), ("short", 30)]


def test_request_that_can_never_fit_is_rejected_at_submission():
    b = batcher(budget=100, max_total_tokens=100)
    with pytest.raises(RequestRejected) as e:  # input + max_new over max_total_tokens
        b.submit(Request("huge", 60, 50))
    assert e.value.field == "max_new_tokens"
    assert "110" in str(e.value) and "100" in str(e.value)
    with pytest.raises(RequestRejected, match="max_new_tokens: must be >= 1"):
        b.submit(Request("zero", 5, 0))
    with pytest.raises(RequestRejected, match="input_len"):
        b.submit(Request("empty", 0, 5))


def test_config_inference_and_startup_error():
    cfg = alone(max_batch_size=4, max_total_tokens=2048).resolved()
    assert cfg.max_batch_weight == 8192
    with pytest.raises(ConfigError, match="below the weight of one max-length request"):
        alone(max_batch_weight=1000, max_total_tokens=2048).resolved()
    with pytest.raises(ConfigError, match="cannot be inferred"):
        alone().resolved()


def test_the_engines_share_of_the_defaults_is_refused_unresolved_and_auto_follows_the_weight_model():
    with pytest.raises(ConfigError, match=r"max_total_tokens must be >= 2 \(got 0, the engine's to fill in"):
        BatcherConfig(max_batch_weight=4096).resolved()
    with pytest.raises(ConfigError, match=r"block_size must be >= 1 \(got 0, the engine's to fill in"):
        BatcherConfig(max_batch_weight=4096, max_total_tokens=256).resolved()
    token = BatcherConfig(max_batch_weight=4096, max_total_tokens=256, block_size=16).resolved()
    assert (token.mode, token.prefix_cache, token.chunked_prefill) == ("predictive", True, True)
    padded = BatcherConfig(max_batch_weight=4096, max_total_tokens=256, block_size=1, weight_model="padded")
    resolved = padded.resolved()
    assert (resolved.mode, resolved.prefix_cache, resolved.chunked_prefill) == ("worst_case", False, False)
    assert replace(padded, mode="predictive").resolved().mode == "predictive"  # a batcher alone may (the engine: no)


def test_max_batch_size_caps_running_requests():
    b = batcher(budget=1000, max_batch_size=2)
    for i in range(4):
        b.submit(Request(str(i), 5, 5))
    assert len(b.schedule(0.0).admitted) == 2


def test_cancel_frees_the_reservation_for_the_next_step():
    b = batcher()
    b.submit(Request("a", 40, 40))
    b.submit(Request("b", 40, 40))
    b.complete(b.schedule(0.0))
    assert list(b.running) == ["a"]
    assert b.cancel("a") is not None
    assert [r.id for r in b.schedule(0.1).admitted] == ["b"]
    assert b.cancel("nope") is None


def test_block_rounding_counts_whole_blocks():
    b = Batcher(alone(max_batch_weight=64, max_total_tokens=32, block_size=16))
    b.submit(Request("a", 17, 15))  # 32 tokens at finish = 2 blocks
    b.submit(Request("b", 1, 31))  # grows to 32 = 2 blocks
    # At step 2: a holds 19 tokens (2 blocks), b 3 (1 block), c 19 (2 blocks): 5 blocks = 80 > 64,
    # though the same tokens unrounded (41) would fit.
    b.submit(Request("c", 17, 2))
    plan = b.schedule(0.0)
    assert [r.id for r in plan.admitted] == ["a", "b"]
    b.complete(plan)
    assert b.batch_weight() == 32 + 16  # 18 tokens -> 2 blocks, 2 tokens -> 1 block


def test_padded_weight_is_batch_size_times_longest_context():
    b = Batcher(alone(max_batch_weight=200, max_total_tokens=100, weight_model="padded"))
    b.submit(Request("long", 80, 20))  # peak 100 alone
    b.submit(Request("short", 5, 5))  # with "long": 2 x max(85+5, 10) = 180 at its finish, then 100
    b.submit(Request("third", 5, 5))  # 3 x 90 = 270: refused
    assert [r.id for r in b.schedule(0.0).admitted] == ["long", "short"]


def test_predictive_reserves_estimates_and_preempts_newest_instead_of_overflowing():
    cfg = alone(
        max_batch_weight=200,
        max_total_tokens=200,
        mode="predictive",
        predictive_min_samples=4,
        jump_window_s=1e9,
    )
    b = Batcher(cfg)
    # Teach the estimator that outputs are ~10 tokens.
    warm = [Request(f"w{i}", 5, 100) for i in range(6)]
    drive(b, warm, {r.id: 10 for r in warm})
    assert b.estimator.reserve(100) <= 12
    # Now four arrive together and all run far past the estimate: predictive admits them all
    # (4 x 30 reserved), then, as they grow towards 4 x 100 > 200, must preempt the newest.
    reqs = [Request(f"r{i}", 20, 80, arrival_s=10.0) for i in range(4)]
    run = drive(b, reqs)  # drive() asserts the weight never exceeds the budget
    assert set(run.finished) == {r.id for r in reqs}
    assert b.stats.preemptions > 0
    assert b.stats.preempted_tokens > 0
    assert all(r.generated == 80 for r in reqs)  # preempted requests kept their tokens and finished
    assert reqs[0].preemptions == 0 and reqs[-1].preemptions > 0  # the newest go first


def test_room_counts_waiting_work_so_prefetch_never_stalls_on_the_prefill_cap():
    # Budget 1000, requests reserve 100 each. The prefill cap (30) admits one 20-token prompt per step,
    # so two wait after the first step; the room is what remains after all three are in: 7 more.
    b = batcher(1000, max_prefill_weight=30, chunked_prefill=False)
    assert b.room_for() == 1000 // 1000  # nothing seen yet: a worst-case request
    for i in range(3):
        b.submit(Request(f"r{i}", 20, 80))
    b.schedule(now=0.0)
    assert len(b.running) == 1 and len(b.waiting) == 2
    assert b.room_for() == (1000 - 3 * 100) // 100
    for i in range(3, 10):
        b.submit(Request(f"r{i}", 20, 80))
    assert b.room_for() == 0  # what waits already fills the budget: take nothing more


def _taught(budget: int, **kw) -> Batcher:
    """A predictive batcher whose estimator has seen outputs of 10 tokens."""
    cfg = alone(
        max_batch_weight=budget, max_total_tokens=200, mode="predictive", predictive_min_samples=4,
        jump_window_s=1e9, **kw,
    )  # fmt: skip
    b = Batcher(cfg)
    warm = [Request(f"w{i}", 5, 100) for i in range(6)]
    drive(b, warm, {r.id: 10 for r in warm})
    b.estimator.refresh([])
    return b


def test_a_request_that_cannot_stop_early_reserves_its_max_and_teaches_nothing():
    b = _taught(1000)
    seen = len(b.estimator)
    sure = Request("sure", 20, 100, arrival_s=10.0, runs_to_max=True)
    maybe = Request("maybe", 20, 100, arrival_s=10.0)
    drive(b, [sure, maybe], {"maybe": 8})
    assert sure.reserved_new == 100 and maybe.reserved_new < 20
    assert len(b.estimator) == seen + 1  # only "maybe" was observed
    assert b.stats.preemptions == 0


def test_preemptions_are_capped_per_request_and_tighten_the_margin():
    b = _taught(200, max_preemptions=1)
    base = b.estimator.margin
    reqs = [Request(f"r{i}", 20, 80, arrival_s=10.0) for i in range(4)]
    run = drive(b, reqs)  # all run far past the 10-token estimate: the budget forces preemptions
    assert set(run.finished) == {r.id for r in reqs}
    assert b.stats.preemptions > 0
    assert max(r.preemptions for r in reqs) == 1  # a capped request is readmitted at its worst case, never again
    assert b.estimator.margin > base  # outgrown reservations widened the margin


def test_the_batch_margin_holds_back_standard_deviations_of_the_running_sets_remaining_output():
    def taught(margin: float) -> Batcher:
        cfg = alone(
            max_batch_weight=2000, max_total_tokens=200, mode="predictive", predictive_min_samples=4,
            predictive_margin=margin, jump_window_s=1e9,
        )  # fmt: skip
        b = Batcher(cfg)
        warm = [Request(f"w{i}", 5, 100) for i in range(8)]
        drive(b, warm, {r.id: n for r, n in zip(warm, (4, 8, 12, 16, 20, 40, 60, 80), strict=True)})
        b.estimator.refresh([])
        return b

    admitted = {}
    for margin in (0.0, 3.0):
        b = taught(margin)
        for i in range(80):
            b.submit(Request(f"r{i}", 10, 100, arrival_s=10.0))
        plan = b.schedule(10.0)
        mean, var = b.estimator.moments(100)
        assert all(r.reserved_new == math.ceil(mean) for r in plan.admitted)
        assert b.reservations.var_sum == pytest.approx(len(plan.admitted) * var)
        # what was admitted fits the budget less the margin; one more would not have
        held = b.reservations.margin() if margin else 0
        assert len(plan.admitted) * (10 + math.ceil(mean)) <= 2000 - held
        assert (len(plan.admitted) + 1) * (10 + math.ceil(mean)) > 2000 - b.reservations.margin(var)
        admitted[margin] = len(plan.admitted)
    assert admitted[3.0] < admitted[0.0]
