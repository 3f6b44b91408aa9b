"""Sending running requests back to the queue: predictive mode's regrowth, making room for a tenant
below its share (fairness.py), and making room for an urgent class over background work. A preempted
request keeps its tokens and is prefilled again."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .plan import StepPlan
from .request import Request

if TYPE_CHECKING:
    from .batcher import Batcher

# Predictive mode: while recomputed (preempted) tokens stay under this share of the generated ones, a
# preemption leaves the estimator's margin alone; past it, every preemption widens the margin.
PREEMPT_SHARE = 0.02


def preempt(b: Batcher, req: Request, enqueue: bool = True) -> None:
    """Send a running request back to the queue; it keeps its tokens and is prefilled again."""
    del b.running[req.id]
    b.release(req)
    b.stats.preemptions += 1
    b.stats.preempted_tokens += req.prefilled
    req.preemptions += 1
    req.prefilled = 0
    req.decoding = False
    if enqueue:
        b.enqueue(req)


def regrow(b: Batcher) -> list[Request]:
    """Predictive mode: extend reservations that ran out, then, if the next step's growth would not
    fit in the budget, preempt the newest requests until it does. The budget is never exceeded.

    A projection that overflows after a reservation grows stops admission, but preempts nothing:
    reservations are estimates, and most running requests finish well inside theirs."""
    proj = b.projector
    for req in b.running.values():
        if req.decoding and req.generated >= req.reserved_new:
            old = proj.own_final(req)
            req.reserved_new = b.reservations.reserve(req)
            grown = proj.own_final(req) - old
            proj.committed += grown
            b.tenants.weight[req.tenant] += grown
            b.reservations.track(req)
            proj.set_entry(req.id, proj.decoding_entry(req))
            b.running_changed()
    preempted: list[Request] = []
    cap = b.config.max_preemptions
    while b.running and b.weight_with(1) > b.budget:
        # of the lowest class, the newest request that has not used up its preemptions (else the newest):
        # it has the least work to redo, and a request never waits behind more than `cap` restarts of its own
        victim = max(b.running.values(), key=lambda r: (r.preemptions < cap, b.order[r.id]))
        preempt(b, victim)
        preempted.append(victim)
    st = b.stats
    if preempted and b.estimator is not None and st.preempted_tokens > PREEMPT_SHARE * st.generated_tokens:
        b.estimator.tighten()
    return preempted


def make_room(b: Batcher, cand: Request, chunk: int, ahead: int, plan: StepPlan, evicted: list[Request]) -> None:
    """`cand`'s tenant holds less than its fair share of the budget (an equal share among the tenants
    with requests): preempt the newest requests of the tenants holding the most, the fewest with which
    the projection admits `cand`, never leaving a victim's tenant holding less than `cand`'s would (no
    swap between equals: two busy tenants never preempt each other back and forth); or none, when no
    such set makes room. The victims go back to the queue after the walk (`evicted`)."""
    held, proj = b.tenants.weight, b.projector
    mine = held[cand.tenant] + proj.own_final(cand)
    if mine > b.budget / len(b.tenants.held):
        return
    pool = [
        r
        for r in b.running.values()
        if r.tenant != cand.tenant
        and r.preemptions < b.config.max_preemptions
        and not r.shared
        and r.admitted_step < b.step
    ]
    pool.sort(key=lambda r: (held[r.tenant], r.admitted_step), reverse=True)
    left = dict(held)

    def spare(r: Request) -> bool:  # never leaves a victim's tenant holding less than cand's would
        own = proj.own_final(r)
        if left[r.tenant] - own < mine:
            return False
        left[r.tenant] -= own
        return True

    victims = fewest(b, proj.entry(cand, chunk, ahead), pool, spare)
    if victims:
        evict(b, victims, plan, evicted)


def make_room_for_class(
    b: Batcher, cand: Request, chunk: int, ahead: int, plan: StepPlan, evicted: list[Request]
) -> None:
    """`cand` is of an urgent class (headroom_priority or above) and does not fit: preempt background
    requests (ranked below headroom_priority, so not those aged to the top), the newest first, the
    fewest with which the projection admits `cand`; or none, when no such set makes room. Background
    work yields within the step; the victims keep their tokens and go back to the queue after the walk
    (`evicted`), to be prefilled again when there is room."""
    order, floor = b.order, b.config.headroom_priority
    if -order[cand.id][0] < floor:
        return
    pool = [r for r in b.running.values() if -order[r.id][0] < floor and not r.shared and r.admitted_step < b.step]
    if not pool:
        return
    pool.sort(key=lambda r: (order[r.id][0], r.admitted_step), reverse=True)  # the lowest class, the newest
    victims = fewest(b, b.projector.entry(cand, chunk, ahead), pool, lambda r: True)
    if victims:
        evict(b, victims, plan, evicted)


def fewest(b: Batcher, entry, pool: list[Request], eligible: Callable[[Request], bool]) -> list[Request] | None:
    """The first requests of `pool` (in its order, those `eligible`) whose preemption lets the
    projection admit `entry`; None when all of them would not."""
    victims: list[Request] = []
    for r in pool:
        if not eligible(r):
            continue
        victims.append(r)
        if b.projector.without({v.id for v in victims}).admits(entry, b.admission.budget):
            return victims
    return None


def evict(b: Batcher, victims: list[Request], plan: StepPlan, evicted: list[Request]) -> None:
    """Preempt `victims` out of this step's plan; they go back to the queue after the walk (`evicted`)."""
    gone = {r.id for r in victims}
    plan.prefill[:] = [(r, n) for r, n in plan.prefill if r.id not in gone]
    plan.decode[:] = [r for r in plan.decode if r.id not in gone]
    for r in victims:
        preempt(b, r, enqueue=False)
        plan.preempted.append(r)
        evicted.append(r)
