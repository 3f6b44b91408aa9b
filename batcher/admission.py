"""Admission: one walk over the waiting queue per step, deciding who starts.

The walk goes by priority class (higher first), within a class by tenant (the one that has received
the least service first: TenantShares) and by arrival within a tenant, and admits a candidate only if
its policy says it fits: by default (Projected) the projected weight of the running requests plus the
candidate stays within the candidate's budget at every future step (batcher/projection/), and
candidates that pass the naive test (the sum of everyone's final weight fits) skip the projection. A
later request may jump one of its tenant's that does not fit, but only if it arrived within
jump_window_s after it, and never once that one has waited max_wait_s; a lower class never jumps a
higher one. Classes below headroom_priority may not take the last priority_headroom of the budget, so
a higher-class request starts at once.

`admit` reads the Batcher and changes it only through its narrow methods (start, preempt) and a
candidate's tentative prefix-cache hit (Paging.lookup, undone by unlookup); what it took and what it
preempted come back in an Outcome, which the Batcher applies to its queue. The simulator's policies
(a static count, TGI's sum, vLLM's optimism) are strategies of the same walk (Policy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from . import preemption
from .config import BatcherConfig
from .plan import PrefillLoad, StepPlan
from .projection import Entry
from .request import Request
from .weight import PaddedWeight, TokenWeight

if TYPE_CHECKING:
    from .batcher import Batcher


class Policy(Protocol):
    """Does `req` fit now against `limit` (its budget)? Returns (fits, by the naive sum alone)."""

    name: str
    preempts_to_fit: bool  # before each step, preempt the newest while the next step's growth does not fit

    def fits(self, batcher: Batcher, req: Request, chunk: int, ahead: int, limit: int) -> tuple[bool, bool]: ...


class Projected:
    """The batcher's own rule: exact projection, each cached block counted once."""

    name, preempts_to_fit = "weighted", False

    def fits(self, batcher: Batcher, req: Request, chunk: int, ahead: int, limit: int) -> tuple[bool, bool]:
        if req.shared_blocks:
            return sharing_fits(batcher, req, chunk, ahead, limit)
        if naive_fits(batcher, req.reserved_total, req.fixed_len, limit):
            return True, True
        return batcher.profile().admits(batcher.projector.entry(req, chunk, ahead, batcher.step), limit), False


def naive_fits(batcher: Batcher, final: int, fixed_len: int, limit: int) -> bool:
    """The fast path: does the sum of every final weight, the candidate's included, fit?"""
    if batcher.weight.name == "token":
        w = batcher.weight  # the held cached blocks inline (Paging.shared_weight): this is the fast path
        return batcher.committed + batcher.paging.shared.held_blocks * w.block_size + w.seq(final) <= limit
    running = batcher.running.values()
    fixed = max((r.fixed_len for r in running), default=0)
    rest = max((r.reserved_total - r.fixed_len for r in running), default=0)
    return (len(running) + 1) * (max(fixed, fixed_len) + max(rest, final - fixed_len)) <= limit


def sharing_fits(batcher: Batcher, req: Request, chunk: int, ahead: int, limit: int) -> tuple[bool, bool]:
    """A candidate that would hold cached blocks: exact, counting each block once. Returns
    (admitted, by the naive sum alone)."""
    proj, shared = batcher.projector, batcher.paging.shared
    entry = proj.entry(req, chunk, ahead, batcher.step)
    new, extended = shared.plan(req.prefix[: req.shared_blocks], entry.finish, proj.finish_of)
    if batcher.committed + (shared.held_blocks + new) * batcher.weight.block_size + proj.own_final(req) <= limit:
        return True, True
    return batcher.profile().admits_sharing(entry, new, extended, limit), False


def admits_without(batcher: Batcher, req: Request, chunk: int, ahead: int, limit: int) -> Callable[[set[str]], bool]:
    """Would the projection admit `req` with these running requests preempted? Conservative, so that
    no one is preempted in vain: a candidate that found cached blocks is counted as holding them as its
    own, for its whole life (the exact check follows the preemption)."""
    entry: list[Entry] = []

    def admits(ids: set[str]) -> bool:
        if not entry:
            alone = replace(req, shared_blocks=0) if req.shared_blocks else req
            entry.append(batcher.projector.entry(alone, chunk, ahead, batcher.step))
        batcher.profile()  # entries brought up to date
        return batcher.projector.without(ids).admits(entry[0], limit)

    return admits


def with_slot(cap: int, running: int, admits: Callable[[set[str]], bool]) -> Callable[[set[str]], bool]:
    """`admits`, and a running slot free under the cap (0: none) once these requests are preempted."""
    if not cap:
        return admits
    return lambda ids: running - len(ids) < cap and admits(ids)


@dataclass(slots=True)
class Outcome:
    """What a walk did: the queue positions it started (none: the queue is idle until something
    changes) and the requests it preempted (back to the queue after the walk)."""

    taken: list[int] = field(default_factory=list)
    evicted: list[Request] = field(default_factory=list)


def candidate_budget(batcher: Batcher, cand: Request) -> tuple[int, int]:
    """The weight `cand` may be admitted within: the budget less the predictive margin and a low
    class's headroom while anything runs (alone, a request always fits: its worst case does), and
    its adapter's new slot; and that less the pages pinned this step for a hit's copies (the limit
    it is checked against: room no one else has until the step runs)."""
    budget = batcher.budget
    if batcher.running:
        res = batcher.reservations
        if batcher.estimator is not None:
            budget -= res.margin(res.variance(cand))
        if -batcher.queue.keys[cand.id][0] < batcher.config.headroom_priority:  # its rank (inline: once per candidate)
            budget -= batcher.headroom
    if cand.adapter:  # one more adapter slot, if its adapter needs one (no call on the base's path)
        budget -= batcher.adapters.extra_weight(cand.adapter)
    return budget, budget - batcher.paging.pinned_pages * batcher.weight.block_size


def evict(batcher: Batcher, victims: list[Request], plan: StepPlan, evicted: list[Request]) -> None:
    """Preempt `victims` out of this step's plan; they go back to the queue after the walk (`evicted`)."""
    gone = {r.id for r in victims}
    plan.prefill[:] = [(r, n) for r, n in plan.prefill if r.id not in gone]
    plan.decode[:] = [r for r in plan.decode if r.id not in gone]
    for r in victims:
        plan.preempted.append(batcher.preempt(r, enqueue=False))
        evicted.append(r)


def prefill_chunk(
    cfg: BatcherConfig, w: TokenWeight | PaddedWeight, prompt: int, chunks: int, longest: int, total: int
) -> int | None:
    """Tokens of `prompt` to prefill this step given the chunks already planned (how many, the longest,
    their tokens: PrefillLoad's fields, passed as they are kept in the walk): the whole
    prompt when it fits the cap, a chunk of what is left (chunked prefill), 0 when nothing is left, or
    None when the prompt must wait to be prefilled alone."""
    cap = cfg.max_prefill_weight
    if not cap or w.prefill(chunks + 1, max(longest, prompt), total + prompt) <= cap:
        return prompt
    if w.name == "token" and total >= cap:
        return 0
    if cfg.chunked_prefill and w.name == "token":
        return cap - total
    return None if chunks else prompt


def admit(batcher: Batcher, now: float, plan: StepPlan, load: PrefillLoad) -> Outcome:
    cfg, queue, tenants, running, paging = (
        batcher.config,
        batcher.queue,
        batcher.tenants,
        batcher.running,
        batcher.paging,
    )
    keys, weight, reservations = queue.keys, batcher.weight, batcher.reservations
    out = Outcome()
    count, longest, total = load.chunks, load.longest_tokens, load.tokens
    ahead = sum(r.prefill_left for r in batcher.projector.prefilling.values()) - total  # the running not decoding
    first_blocked: Request | None = None
    first_idx = 0
    refused: list[tuple[int, int, int, int]] = []
    fair = cfg.fairness and tenants.contended
    waiting = queue.requests
    candidates = tenants.order(waiting, queue.rank, batcher.held_weight) if fair else enumerate(waiting)
    # background work runs that an urgent class may preempt (preemption.for_class)
    floor = cfg.headroom_priority
    background = cfg.class_preemption and any(-keys[r.id][0] < floor for r in running.values())  # rank, inline
    capped: set[str] = set()  # tenants that admit nothing more in this pass (their cap, a jump rule)
    blocked: dict[str, Request] = {}  # each tenant's first request that did not fit in this pass
    cap = cfg.max_batch_size  # running requests (a worker's task threads), 0: the weight alone limits
    slot = batcher.slot_weight
    for scanned, (idx, cand) in enumerate(candidates):
        full = cap and len(running) >= cap
        if full and not (fair and cfg.fair_preemption) and not (background and -keys[cand.id][0] >= floor):
            break  # no one here may take another's slot
        if fair and len(capped) >= len(tenants.requests):
            break  # every tenant is done for this pass
        if cand.tenant in capped or (
            cfg.tenant_cap and fair and tenants.reserved[cand.tenant] >= cfg.tenant_cap * batcher.budget
        ):
            # its tenant has its share: the others' requests may still start, and none of this tenant's
            # later ones in this pass (a preemption further on may free its share: they must not jump it)
            capped.add(cand.tenant)
            continue
        if first_blocked is not None and (
            scanned - first_idx > cfg.jump_scan
            or keys[cand.id][0] != keys[first_blocked.id][0]  # a lower class never jumps a higher one
        ):
            break
        # the jump rules hold in arrival order: within a tenant when fairness orders the tenants
        key = cand.tenant if fair else ""
        mine_blocked = blocked.get(key)
        if mine_blocked is not None and (
            cfg.jump_window_s <= 0
            or cand.arrival_s - mine_blocked.arrival_s > cfg.jump_window_s
            or now - mine_blocked.arrival_s > cfg.max_wait_s
        ):
            if not fair:
                break
            capped.add(cand.tenant)  # nothing more of this tenant jumps its blocked request
            continue
        hits = paging.lookup(cand)  # tentative: its pins are undone if it does not start
        p = cand.prefill_left
        chunk = prefill_chunk(cfg, weight, p, count, longest, total)
        if chunk == 0:
            paging.unlookup(cand)
            break  # this step's prefill budget is spent
        if chunk is None:  # a prompt over the cap runs only when prefilled alone
            paging.unlookup(cand)
            blocked.setdefault(key, cand)
            if first_blocked is None:
                first_blocked, first_idx = cand, scanned
            continue
        cand.reserved_new = reservations.reserve(cand)
        budget, limit = candidate_budget(batcher, cand)
        ctx, res, fix = cand.context_len, cand.reserved_new, cand.fixed_len
        # A candidate at least as long in context, reservation and fixed part (and in the rest) as
        # one refused in this pass is refused too (it weighs at least as much at every step).
        # (Not for a candidate with cached blocks: they weigh less than their length.)
        dominated = not hits and any(
            c <= ctx and r <= res and f <= fix and c - f <= ctx - fix and x >= budget for c, r, f, x in refused
        )
        if (
            not dominated
            and fair
            and cfg.fair_preemption
            and (full or not batcher.fits(cand, chunk, ahead, limit, counted=False))
        ):
            victims = preemption.for_tenant(
                cand,
                batcher.projector.own_final(cand),
                tenants,
                slot,
                batcher.budget / len(tenants.requests),
                running.values(),
                batcher.projector.own_final,
                cfg.max_preemptions,
                batcher.step,
                with_slot(cap, len(running), admits_without(batcher, cand, chunk, ahead, limit)),
            )
            if victims:
                evict(batcher, victims, plan, out.evicted)
        full = cap and len(running) >= cap
        if (
            background
            and not dominated
            and -keys[cand.id][0] >= floor
            and (full or not batcher.fits(cand, chunk, ahead, limit, counted=False))
        ):
            admits = with_slot(cap, len(running), admits_without(batcher, cand, chunk, ahead, limit))
            victims = preemption.for_class(running.values(), queue.rank, floor, batcher.step, admits)
            if victims:
                evict(batcher, victims, plan, out.evicted)
        if cap and len(running) >= cap:  # no slot was freed for it
            paging.unlookup(cand)
            if not fair:
                break
            capped.add(cand.tenant)
            continue
        if dominated or not batcher.fits(cand, chunk, ahead, limit):
            paging.unlookup(cand)
            if not dominated and not hits and len(refused) < 16:
                refused.append((ctx, res, fix, budget))
            blocked.setdefault(key, cand)
            if first_blocked is None:
                first_blocked, first_idx = cand, scanned
            continue
        mine = tenants.reserved[cand.tenant]
        if (
            cfg.tenant_cap
            and fair
            and mine
            and mine + batcher.projector.own_final(cand) > cfg.tenant_cap * batcher.budget
        ):
            paging.unlookup(cand)
            capped.add(cand.tenant)  # its later requests wait behind this one (its own order is kept)
            continue  # past its tenant's share (one request always may run): wait, holding no one back
        out.taken.append(idx)
        batcher.start(cand, chunk, ahead, plan)
        count, longest, total = count + 1, max(longest, chunk), total + chunk
        ahead += p - chunk
    return out
