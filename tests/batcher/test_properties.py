"""Property tests: the projection is exact, and no schedule ever exceeds the budget or starves."""

from __future__ import annotations

import os
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weightq.batcher import Batcher, BatcherConfig, Entry, Request, weight_model
from weightq.batcher.projection import ceil_to
from weightq.batcher.weight import UNIFORM

from tests.batcher.alone import alone
from tests.drive import drive

# WEIGHTQ_EXAMPLES=5000 for a thorough run; CI keeps the default.
SETTINGS = settings(
    max_examples=int(os.environ.get("WEIGHTQ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# Attention kinds of the token model (batcher/weight.py): full layers only; one page per full block and
# window kinds keeping rings; no full kind at all; a full kind and two windows of several pages each.
KINDS = [UNIFORM, ((1, 0), (5, 3)), ((2, 2),), ((1, 0), (1, 2), (2, 5))]


@st.composite
def entries(draw, max_n=12, fixed=False, shared=False):
    """Projection entries; with `shared`, some hold cached prefix blocks (`extra`: the window kinds see
    them, the full kind leaves them to an anchor) and some are anchors' charges (extra = -final)."""
    out = []
    for _ in range(draw(st.integers(0, max_n))):
        context = draw(st.integers(1, 60))
        remaining = draw(st.integers(1, 60))
        delay = draw(st.sampled_from([0, 0, 0, draw(st.integers(1, 5))]))
        fix = draw(st.integers(0, context)) if fixed else 0  # encoder-decoder rows: the encoder part
        kind = draw(st.sampled_from(["own", "own", "cached", "anchor"])) if shared else "own"
        if kind == "anchor":
            n = draw(st.integers(1, 40))
            out.append(Entry(delay + remaining, 0, n, False, 0, -n))
            continue
        extra = draw(st.integers(1, 30)) if kind == "cached" else 0
        out.append(Entry(delay + remaining, context, context + remaining, delay == 0, fix, extra))
    return out


def brute_load(ents: list[Entry], model: str, block: int, t: int, kinds=UNIFORM) -> int:
    alive = [e for e in ents if e.finish >= t]
    lengths = [e.offset + t if e.growing else e.final for e in alive]
    if model == "token" and kinds != UNIFORM:
        full = kinds[0][0] if kinds[0][1] == 0 else 0
        total = 0
        for e, n in zip(alive, lengths, strict=True):
            total += full * -(-n // block)
            for pages, ring in kinds:
                if ring:
                    total += pages * min(-(-(n + e.extra) // block), ring)
        return total * block
    if model == "token":
        return sum(ceil_to(n, block) for n in lengths)
    if not alive:
        return 0
    fixed = [e.fixed for e in alive]  # padded separately: longest fixed part + longest rest
    return len(alive) * (max(fixed) + max(n - f for n, f in zip(lengths, fixed, strict=True)))


def brute_peak(ents, model, block, kinds=UNIFORM):
    return max((brute_load(ents, model, block, t, kinds) for t in range(0, 70)), default=0)


@SETTINGS
@given(
    ents=entries(),
    cand=entries(max_n=1),
    model=st.sampled_from(["token", "padded"]),
    block=st.sampled_from([1, 3, 16]),
    budget=st.integers(50, 800),
)
def test_profile_is_exact(ents, cand, model, block, budget):
    block = block if model == "token" else 1
    profile = weight_model(model, block).profile(ents)
    assert profile.peak() == brute_peak(ents, model, block)
    for t in (0, 1, 7, 30, 61):
        assert profile.load_at(t) == brute_load(ents, model, block, t)
    if cand:
        expected = brute_peak([*ents, cand[0]], model, block) <= budget
        assert profile.admits(cand[0], budget) == expected


@SETTINGS
@given(
    ents=entries(shared=True),
    cand=entries(max_n=1, shared=True),
    kinds=st.sampled_from(KINDS[1:]),
    block=st.sampled_from([1, 3, 16]),
    budget=st.integers(50, 3000),
)
def test_hybrid_profile_is_exact(ents, cand, kinds, block, budget):
    """With window kinds a request's weight is capped, not linear: still exact at every step."""
    profile = weight_model("token", block, kinds).profile(ents)
    assert profile.peak() == brute_peak(ents, "token", block, kinds)
    for t in (0, 1, 7, 30, 61):
        assert profile.load_at(t) == brute_load(ents, "token", block, t, kinds)
    if cand and cand[0].extra >= 0:
        expected = brute_peak([*ents, cand[0]], "token", block, kinds) <= budget
        assert profile.admits(cand[0], budget) == expected


@SETTINGS
@given(ents=entries(fixed=True), cand=entries(max_n=1, fixed=True), budget=st.integers(50, 1500))
def test_padded_profile_with_encoder_parts_is_exact(ents, cand, budget):
    profile = weight_model("padded").profile(ents)
    assert profile.peak() == brute_peak(ents, "padded", 1)
    for t in (0, 1, 7, 30, 61):
        assert profile.load_at(t) == brute_load(ents, "padded", 1, t)
    if cand:
        assert profile.admits(cand[0], budget) == (brute_peak([*ents, cand[0]], "padded", 1) <= budget)


@st.composite
def workloads(draw):
    model = draw(st.sampled_from(["token", "padded"]))
    block = draw(st.sampled_from([1, 4, 16])) if model == "token" else 1
    kinds = draw(st.sampled_from(KINDS)) if model == "token" else UNIFORM
    max_total = draw(st.integers(8, 80))
    one = weight_model(model, block, kinds).seq(max_total)
    budget = draw(st.integers(one, 4 * one))
    cap = draw(st.sampled_from([0, 0, draw(st.integers(1, 2 * max_total))]))
    cfg = alone(
        max_batch_weight=budget,
        max_total_tokens=max_total,
        max_batch_size=draw(st.sampled_from([0, 0, draw(st.integers(1, 6))])),
        max_prefill_weight=cap,
        chunked_prefill=draw(st.booleans()),
        weight_model=model,
        block_size=block,
        kinds=kinds,
        windows=tuple((ring - 1) * block + 1 for _pages, ring in kinds if ring),  # ring_blocks(window) = ring
        jump_window_s=draw(st.sampled_from([0.0, 0.3, 1.0, 1e9])),
        max_wait_s=draw(st.sampled_from([0.5, 2.0, 1e9])),
        tenant_cap=draw(st.sampled_from([0.0, 0.0, 0.5])),
    )
    reqs, stop_at = [], {}
    seq2seq = draw(st.booleans())
    tenants = draw(st.sampled_from([[""], [""], ["a", "b"], ["a", "b", "c"]]))  # several: fairness reorders
    t = 0.0
    for i in range(draw(st.integers(1, 25))):
        t += draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
        inp = draw(st.integers(1, max_total - 1))
        new = draw(st.integers(1, max_total - inp))
        # Padded: some workloads are encoder-decoder (the whole input is the encoder's fixed part).
        fixed = inp if model == "padded" and seq2seq else 0
        tenant = draw(st.sampled_from(tenants))
        reqs.append(Request(str(i), inp, new, arrival_s=t, fixed_len=fixed, tenant=tenant))
        if draw(st.booleans()):
            stop_at[str(i)] = draw(st.integers(1, new))
    return cfg, reqs, stop_at


def check_jumps(cfg: BatcherConfig, reqs: list[Request], run) -> None:
    """Y may be admitted before an earlier X of its tenant only within the window and before X waited
    max_wait (between tenants, fairness orders them: batcher/fairness.py)."""
    arrival = {r.id: r.arrival_s for r in reqs}
    tenant = {r.id: r.tenant for r in reqs}
    admitted_at: dict[str, tuple[int, float]] = {}
    for step, now, rid in run.admitted:  # first admissions (a preempted request is admitted again)
        admitted_at.setdefault(rid, (step, now))
    for y, (y_step, y_now) in admitted_at.items():
        for x, (x_step, _) in admitted_at.items():
            if tenant[x] != tenant[y]:
                continue
            if arrival[x] < arrival[y] and x_step > y_step and arrival[x] <= y_now:
                assert cfg.jump_window_s > 0, f"{y} jumped {x} with jumping off"
                assert arrival[y] - arrival[x] <= cfg.jump_window_s
                assert y_now - arrival[x] <= cfg.max_wait_s


@SETTINGS
@given(workloads())
def test_weight_never_exceeds_budget_and_everyone_finishes(work):
    cfg, reqs, stop_at = work
    b = Batcher(cfg)
    cap = cfg.max_prefill_weight or 10**9
    # Liveness: even one request at a time, each finishes within its prefill chunks + max_new steps.
    bound = sum(-(-r.max_total // cap) + r.max_new_tokens for r in reqs) + len(reqs)
    run = drive(b, reqs, stop_at, max_steps=bound + 200)  # asserts weight <= budget after every step
    assert len(run.finished) == len(reqs)
    check_jumps(b.config, reqs, run)
    assert not b.running and not b.waiting and b.committed == 0


@SETTINGS
@given(workloads())
def test_fifo_when_jumping_is_off(work):
    cfg, reqs, stop_at = work
    b = Batcher(replace(cfg, jump_window_s=0.0, fairness=False, tenant_cap=0.0))
    run = drive(b, reqs, stop_at)
    order = [rid for _, _, rid in run.admitted]
    assert order == [r.id for r in sorted(reqs, key=lambda r: (r.arrival_s, int(r.id)))]


@SETTINGS
@given(workloads(), st.floats(0.0, 3.0))
def test_predictive_mode_never_exceeds_budget(work, margin):
    cfg, reqs, stop_at = work
    b = Batcher(replace(cfg, mode="predictive", predictive_margin=margin, predictive_min_samples=2))
    # Repeat the workload so the estimator learns short lengths, then meets long ones.
    first = [Request(f"a{r.id}", r.input_len, r.max_new_tokens, r.arrival_s) for r in reqs]
    stops = {f"a{k}": v for k, v in stop_at.items()}
    run = drive(b, first + reqs, stops | {r.id: r.max_new_tokens for r in reqs})
    assert len(run.finished) == 2 * len(reqs)
    assert not b.running and b.committed == 0


@SETTINGS
@given(
    ops=st.lists(
        st.tuples(st.booleans(), entries(max_n=1, fixed=True, shared=True), st.integers(0, 1000)), max_size=30
    ),
    cand=entries(max_n=1, fixed=True),
    model=st.sampled_from(["token", "padded"]),
    block=st.sampled_from([1, 3, 16]),
    kinds=st.sampled_from(KINDS),
    budget=st.integers(50, 1500),
)
def test_profile_updated_in_place_matches_a_fresh_build(ops, cand, model, block, kinds, budget):
    block = block if model == "token" else 1
    kinds = kinds if model == "token" else UNIFORM
    weight = weight_model(model, block, kinds)
    profile = weight.profile([])
    alive: list[Entry] = []
    for remove, added, pick in ops:
        if remove and alive:
            profile.remove(alive.pop(pick % len(alive)))
        elif added and (model == "token" or added[0].extra == 0):
            profile.add(added[0])
            alive.append(added[0])
        fresh = weight.profile(alive)
        assert profile.peak() == fresh.peak() == brute_peak(alive, model, block, kinds)
        for t in (0, 1, 7, 30, 61):
            assert profile.load_at(t) == brute_load(alive, model, block, t, kinds)
        if model == "token":
            assert profile.points == fresh.points
        if cand:
            expected = brute_peak([*alive, cand[0]], model, block, kinds) <= budget
            assert profile.admits(cand[0], budget) == expected


def assert_profile_follows(b: Batcher) -> None:
    """The profile, updated in place since the batcher started, equals one built from scratch and the
    brute-force load of the running set at every finish point."""
    profile = b.profile()
    assert set(b.projector.entries) == set(b.running)
    for req in b.running.values():
        if req.decoding:  # a decoding request's entry stays what a rebuild would compute now
            expected = Entry(
                b.step + req.reserved_new - req.generated,
                req.context_len - b.step,
                req.reserved_total,
                True,
                req.fixed_len,
            )
            assert b.projector.entries[req.id] == expected
    entries = list(b.projector.entries.values())
    fresh = b.weight.profile(entries)
    model, block, kinds = b.weight.name, b.weight.block_size, b.config.kinds
    for t in {b.step, *(e.finish for e in entries)}:
        assert profile.load_at(t) == fresh.load_at(t) == brute_load(entries, model, block, t, kinds)
    assert profile.peak() == fresh.peak()


@SETTINGS
@given(
    workloads(),
    st.sampled_from(["worst_case", "predictive"]),
    st.sampled_from([0, 3, 32]),
    st.randoms(use_true_random=False),
)
def test_profile_follows_admissions_finishes_cancels_and_preemptions(work, mode, rebuild_after, rnd):
    cfg, reqs, stop_at = work
    b = Batcher(replace(cfg, mode=mode, predictive_min_samples=2))
    b.projector.REBUILD_AFTER = rebuild_after  # 0: every change rebuilds; 32: changes are applied in place
    # As in the predictive test: the first copies teach short lengths, the second run long (regrow, preempt).
    first = [Request(f"a{r.id}", r.input_len, r.max_new_tokens, r.arrival_s, fixed_len=r.fixed_len) for r in reqs]
    stops = {f"a{k}": v for k, v in stop_at.items()} | {r.id: r.max_new_tokens for r in reqs}
    for r in first + reqs:
        b.submit(r)
    now = 0.0
    while b.running or b.waiting:
        if b.running and rnd.random() < 0.05:
            b.cancel(rnd.choice(list(b.running)))
        for r in b.complete(b.schedule(now)):
            if r.generated >= stops.get(r.id, r.max_new_tokens):
                b.finish(r.id)
        assert_profile_follows(b)
        now += 0.1
        assert b.step < 5000, "no progress"
