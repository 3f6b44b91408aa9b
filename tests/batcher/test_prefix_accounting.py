"""Prefix caching in the batcher: the block ledger, exact projection with shared blocks, and a brute
force run in which every request must read the KV of exactly its own tokens."""

from __future__ import annotations

import os
import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weightq.batcher import Batcher, BlockLedger, Entry, Request, TokenProfile, chain_keys
from weightq.batcher.projection import ceil_to
from weightq.batcher.sim.simulator import simulate
from weightq.batcher.sim.trace import TraceRequest

from tests.batcher.alone import alone

SETTINGS = settings(
    max_examples=int(os.environ.get("WEIGHTQ_EXAMPLES", "120")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_chain_keys_name_a_block_by_everything_before_it():
    a = chain_keys([1, 2, 3, 4, 5, 6, 7], 3)
    b = chain_keys([1, 2, 3, 4, 5, 6, 8, 9], 3)
    c = chain_keys([0, 2, 3, 4, 5, 6], 3)
    assert len(a) == 2 and len(b) == 2  # full blocks only
    assert a == b  # the same six tokens
    assert a[0] != c[0] and a[1] != c[1]  # block 1 has the same tokens, but a different prefix


def test_ledger_keeps_released_blocks_for_reuse_and_evicts_the_oldest_first():
    led = BlockLedger(4, 2)
    keys = chain_keys(list(range(8)), 2)
    t1: list[int] = []
    led.grow(t1, 4)
    assert led.register(t1[0], keys[0]) and led.register(t1[1], keys[1])
    assert not led.register(t1[1], keys[1])  # already keyed
    led.release(t1)
    assert led.used == 0 and led.idle == 2
    assert led.hits(keys, 4) == 2 and led.hits(keys, 1) == 1
    t2: list[int] = []
    led.hold(t2, keys[:1])  # a hit takes the cached block back from the idle list
    assert led.used == 1 and led.idle == 1
    t3: list[int] = []
    led.grow(t3, 6)  # two free blocks, then the idle one is evicted
    assert led.evictions == 1 and led.hits(keys, 4) == 1 and led.used == 4
    led.check([t2, t3])
    led.forget(t2)  # a failed step: the block stays held but can no longer be found
    assert led.hits(keys, 4) == 0
    led.release(t2)
    led.release(t3)
    assert led.used == 0 and led.idle == 0
    led.check([])


@st.composite
def sharing_case(draw):
    ents = []
    for _ in range(draw(st.integers(0, 10))):
        context, remaining = draw(st.integers(1, 60)), draw(st.integers(1, 60))
        delay = draw(st.sampled_from([0, 0, draw(st.integers(1, 5))]))
        ents.append(Entry(delay + remaining, context, context + remaining, delay == 0))
    context, remaining = draw(st.integers(1, 60)), draw(st.integers(1, 60))
    delay = draw(st.sampled_from([0, 0, draw(st.integers(1, 5))]))
    cand = Entry(delay + remaining, context, context + remaining, delay == 0)
    new = draw(st.integers(0, 6))
    extended = sorted(draw(st.lists(st.integers(0, cand.finish - 1), max_size=6)))
    return ents, cand, new, extended


@SETTINGS
@given(case=sharing_case(), block=st.sampled_from([1, 3, 16]), budget=st.integers(50, 900))
def test_admits_sharing_is_exact(case, block, budget):
    """Brute force over every step: own blocks of every entry, plus `new` blocks for the candidate's
    life, plus each extended block from its old holder's finish to the candidate's."""
    ents, cand, new, extended = case
    profile = TokenProfile(ents, block)
    cap = budget // block

    def load(t: int) -> int:
        alive = [e for e in [*ents, cand] if e.finish >= t]
        own = sum(ceil_to(e.offset + t if e.growing else e.final, block) // block for e in alive)
        shared = new + sum(1 for f in extended if f < t) if cand.finish >= t else 0
        return own + shared

    before = [
        sum(ceil_to(e.offset + t if e.growing else e.final, block) // block for e in ents if e.finish >= t)
        for t in range(70)
    ]
    fits = all(load(t) <= cap or load(t) == before[t] for t in range(70))
    # a profile already over budget after the candidate finishes refuses it (as admits() does)
    if any(before[t] > cap for t in range(cand.finish + 1, 70)):
        fits = False
    assert profile.admits_sharing(cand, new, extended, budget) == fits


def _tokens(rng: random.Random, prompts: list[list[int]]) -> list[int]:
    head = rng.choice(prompts)[: rng.randint(0, 40)]
    return head + [rng.randint(0, 50) for _ in range(rng.randint(1, 24))]


@SETTINGS
@given(seed=st.integers(0, 10**6), predictive=st.booleans(), block=st.sampled_from([2, 4]))
def test_every_request_reads_its_own_kv(seed, predictive, block):
    """A step loop over the batcher with shared prompts, early stops, cancellations and preemptions
    (predictive mode's, an urgent class's over background work, a light tenant's over a heavy one's:
    requests of three classes and two tenants). Each KV slot records which token prefix wrote it;
    every request must read its own prefix at every position, the budget is never exceeded, and the
    ledger stays consistent."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 50) for _ in range(40)] for _ in range(3)]
    budget = 24 * block * rng.randint(2, 4)
    cfg = alone(
        max_batch_weight=budget,
        max_total_tokens=min(budget, 64 + 2 * block),
        max_prefill_weight=rng.choice([0, 16, 48]),
        block_size=block,
        prefix_cache=True,
        mode="predictive" if predictive else "worst_case",
        predictive_min_samples=4,
    )
    b = Batcher(cfg)
    toks: dict[str, list[int]] = {}
    stop_at: dict[str, int] = {}
    slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> the token prefix whose KV is there
    for i in range(40):
        ids = _tokens(rng, prompts)
        new = rng.randint(1, min(24, cfg.max_total_tokens - len(ids)))
        req = Request(
            str(i),
            len(ids),
            new,
            arrival_s=i * 0.01,
            prefix=chain_keys(ids, block),
            priority=rng.choice([2, 5, 7]),
            tenant=rng.choice("ab"),
        )
        toks[req.id] = ids
        stop_at[req.id] = rng.randint(1, new)
        b.submit(req)
    for step in range(3000):
        if not b.running and not b.waiting:
            break
        plan = b.schedule(step * 0.01)
        for req in plan.preempted:
            del toks[req.id][req.input_len + req.generated :]
        work = [(r, r.prefilled, n) for r, n in plan.prefill] + [(r, r.prefilled, 1) for r in plan.decode]
        for r, start, n in work:  # writes first, as attention does, then reads
            ids = toks[r.id]
            for pos in range(start, start + n):
                slots[(r.block_table[pos // block], pos % block)] = tuple(ids[: pos + 1])
        for r, start, n in work:
            ids = toks[r.id]
            for pos in range(start + n):
                assert slots[(r.block_table[pos // block], pos % block)] == tuple(ids[: pos + 1]), (r.id, pos)
        for r in b.complete(plan):
            toks[r.id].append(rng.randint(0, 50))
        assert b.batch_weight() <= budget
        b.check_memory()
        for r in list(b.running.values()):
            if r.generated >= stop_at[r.id] or r.generated >= r.max_new_tokens:
                b.finish(r.id)
        if rng.random() < 0.03 and b.running:
            b.cancel(rng.choice(list(b.running)))
        b.check_memory()
    assert not b.running and not b.waiting
    assert b.ledger.used == 0
    assert b.stats.cached_tokens > 0 or b.stats.prompt_tokens < 200


def test_an_urgent_request_preempts_background_work_that_shares_a_cached_prompt():
    """A batch whose lines share a system prompt holds cached blocks; an interactive request that does
    not fit still starts at once, preempting the newest background lines (the shared blocks stay
    cached for the others), and the preempted lines finish later with all their tokens."""
    block = 4
    b = Batcher(alone(max_batch_weight=160, max_total_tokens=64, block_size=block, prefix_cache=True))
    system = list(range(24))
    for i in range(8):
        ids = [*system, 100 + i, 101 + i]
        b.submit(Request(f"bg{i}", len(ids), 20, arrival_s=0.0, priority=2, prefix=chain_keys(ids, block)))
    for _ in range(3):
        b.complete(b.schedule(0.0))
        b.check_memory()
    running = [r for r in b.running.values() if r.shared_blocks]
    assert len(running) >= 2, "the background lines share the cached prompt"
    b.submit(Request("chat", 40, 20, arrival_s=1.0, priority=7))
    plan = b.schedule(1.0)
    assert [r.id for r in plan.admitted] == ["chat"]
    assert plan.preempted and all(r.priority == 2 for r in plan.preempted)
    assert all(r.id not in b.running for r in plan.preempted)
    b.check_memory()
    generated: dict[str, int] = {}
    for step in range(400):
        emitted = b.complete(plan)
        b.check_memory()
        for r in emitted:
            if r.generated >= r.max_new_tokens:
                generated[r.id] = b.finish(r.id).generated
        if not b.running and not b.waiting:
            break
        plan = b.schedule(2.0 + step)
    assert generated == {**{f"bg{i}": 20 for i in range(8)}, "chat": 20}
    assert b.ledger.used == 0


def test_the_simulator_models_prefix_groups():
    rng = random.Random(1)
    trace = [
        TraceRequest(1200 + rng.randint(16, 64), rng.randint(4, 32), 32, 0.0, f"sys{i % 8}", 1200) for i in range(256)
    ]
    cfg = alone(max_batch_weight=32768, max_total_tokens=2048, max_prefill_weight=4096, block_size=16)
    runs = {on: simulate(trace, "weighted", replace(cfg, prefix_cache=on)) for on in (False, True)}
    assert runs[True]["overflow_steps"] == runs[False]["overflow_steps"] == 0
    assert runs[False]["cached_tokens"] == 0
    assert runs[True]["prompt_tokens_computed"] < 0.2 * runs[False]["prompt_tokens_computed"]
    assert runs[True]["output_tokens_per_s"] > 1.5 * runs[False]["output_tokens_per_s"]
