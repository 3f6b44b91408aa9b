"""Whom to send back to the queue: predictive mode's regrowth, room for a tenant below its share
(TenantShares), and room for an urgent class over background work.

These functions choose from the values the Batcher passes and change nothing; the Batcher preempts
whom they return (a preempted request keeps its tokens and is prefilled again). A decoding victim may hold
cached blocks (a batch's shared system prompt): the check of a set of victims (`admits`) keeps the blocks
they are charged with where they are, at their finish, which is never less than what preempting them
leaves (the blocks go to a holder that finishes no later, or are freed)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .fairness import TenantShares
from .request import DECODING, Request

# Predictive mode: while recomputed (preempted) tokens stay under this share of the generated ones, a
# preemption leaves the estimator's margin alone; past it, every preemption widens the margin.
PREEMPT_SHARE = 0.02

Key = Callable[[Request], tuple]
Admits = Callable[[set[str]], bool]  # would the candidate fit with these requests preempted?


def newest(running: Iterable[Request], key: Key, max_preemptions: int) -> Request:
    """Regrowth's victim: of the lowest class, the newest request that has not used up its preemptions
    (else the newest): it has the least work to redo, and a request never waits behind more than
    `max_preemptions` restarts of its own."""
    return max(running, key=lambda r: (r.preemptions < max_preemptions, key(r)))


def for_tenant(
    cand: Request,
    cand_weight: int,
    tenants: TenantShares,
    slot_weight: float,
    share: float,
    running: Iterable[Request],
    own_weight: Callable[[Request], int],
    max_preemptions: int,
    step: int,
    admits: Admits,
) -> list[Request] | None:
    """`cand`'s tenant holds less than its fair `share` of the budget (an equal share among the tenants
    with requests) with `cand` (`cand_weight`), counted in whichever resource binds (TenantShares.use:
    reserved weight, or running requests in slots of `slot_weight`): the newest requests of the tenants
    holding the most, the fewest with which `cand` is admitted, never leaving a victim's tenant holding
    less than `cand`'s would (no swap between equals: two busy tenants never preempt each other back
    and forth); or None, when no such set makes room."""
    mine = tenants.use(cand.tenant, slot_weight, cand_weight, 1)
    if mine > share:
        return None
    weights, counts = dict(tenants.reserved), dict(tenants.running)  # as the victims leave

    def use(tenant: str, weight: int = 0, count: int = 0) -> float:  # TenantShares.use of what is left
        return max(weights.get(tenant, 0) + weight, (counts.get(tenant, 0) + count) * slot_weight)

    pool = [
        r
        for r in running
        if r.tenant != cand.tenant and r.preemptions < max_preemptions and r.admitted_step < step and evictable(r)
    ]
    pool.sort(key=lambda r: (use(r.tenant), r.admitted_step), reverse=True)

    def spare(r: Request) -> bool:  # never leaves a victim's tenant holding less than cand's would
        own = own_weight(r)
        if use(r.tenant, -own, -1) < mine:
            return False
        weights[r.tenant] -= own
        counts[r.tenant] -= 1
        return True

    return fewest(pool, spare, admits)


def for_class(
    running: Iterable[Request], rank: Callable[[Request], int], floor: int, step: int, admits: Admits
) -> list[Request] | None:
    """A candidate of an urgent class (`floor`, headroom_priority, or above) does not fit: background
    requests (ranked below `floor`, so not those aged to the top), the newest first, the fewest with
    which the projection admits it; or None, when no such set makes room. Background work yields
    within the step."""
    pool = [r for r in running if rank(r) < floor and r.admitted_step < step and evictable(r)]
    if not pool:
        return None
    pool.sort(key=lambda r: (-rank(r), r.admitted_step), reverse=True)  # the lowest class, the newest
    return fewest(pool, lambda r: True, admits)


def evictable(r: Request) -> bool:
    """Can `r` leave this step's plan? Not while a prompt chunk of its that holds cached blocks runs:
    the blocks a chunk fills are keyed when handed out, before the step writes them, so dropping the
    chunk would leave keys on KV never written. A decoding request keys nothing and may go, cached
    blocks and all."""
    return r.status is DECODING or not r.shared_blocks


def fewest(pool: list[Request], eligible: Callable[[Request], bool], admits: Admits) -> list[Request] | None:
    """The first requests of `pool` (in its order, those `eligible`) whose preemption lets the
    candidate in; None when all of them would not."""
    victims: list[Request] = []
    for r in pool:
        if not eligible(r):
            continue
        victims.append(r)
        if admits({v.id for v in victims}):
            return victims
    return None
