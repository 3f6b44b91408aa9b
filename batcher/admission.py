"""Admission: one walk over the waiting queue per step, deciding who starts.

The walk goes by priority class (higher first), within a class by tenant (the one that has received
the least service first: fairness.py) and by arrival within a tenant, and admits a candidate only if
the projected weight of the running requests plus the candidate stays within max_batch_weight at
every future step (batcher/projection/). Candidates that pass the naive test — the sum of everyone's final
weight fits — skip the projection. A later request may jump one of its tenant's that does not fit,
but only if it arrived within jump_window_s after it, and never once that one has waited max_wait_s;
a lower class never jumps a higher one. Classes below headroom_priority may not take the last
priority_headroom of the budget, so a higher-class request starts at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .plan import StepPlan
from .preemption import make_room, make_room_for_class
from .request import TOP_PRIORITY, Request

if TYPE_CHECKING:
    from .batcher import Batcher


class Admission:
    def __init__(self, batcher: Batcher) -> None:
        self.b = batcher
        self.budget = batcher.budget  # this candidate's: the budget less margin, headroom and pinned pages

    def age(self, now: float) -> bool:
        """A request that has waited max_wait_s ranks with the top class from now on: nothing starves.
        True when one moved up."""
        b = self.b
        cut = now - b.config.max_wait_s
        order, aged = b.order, False
        for r in b.waiting:
            rank, since, seq = order[r.id]
            if rank > -TOP_PRIORITY and r.arrival_s <= cut:  # its wait here: a queue upstream ordered it by class
                order[r.id] = (-TOP_PRIORITY, since, seq)
                aged = True
        if aged:
            b.waiting.sort(key=lambda r: order[r.id])
        return aged

    def naive_fits(self, final: int, fixed_len: int = 0) -> bool:
        """The fast path: does the sum of every final weight, the candidate's included, fit?"""
        b = self.b
        if b.weight.name == "token":
            held = b.paging.shared.held * b.weight.block_size
            return b.projector.committed + held + b.weight.seq(final) <= self.budget
        running = b.running.values()
        fixed = max((r.fixed_len for r in running), default=0)
        rest = max((r.reserved_total - r.fixed_len for r in running), default=0)
        return (len(running) + 1) * (max(fixed, fixed_len) + max(rest, final - fixed_len)) <= self.budget

    def fits(self, req: Request, chunk: int | None = None, ahead: int = 0) -> bool:
        """Could `req` (reservation set) be admitted now without the weight ever exceeding the budget?"""
        b, stats = self.b, self.b.stats
        chunk = req.prefill_left if chunk is None else chunk
        if req.shared:
            ok, fast = b.paging.fits_sharing(req, chunk, ahead, self.budget)
        elif self.naive_fits(req.reserved_total, req.fixed_len):
            ok, fast = True, True
        else:
            ok, fast = b.projector.profile().admits(b.projector.entry(req, chunk, ahead), self.budget), False
        if fast:
            stats.admitted_fast += 1
        elif ok:
            stats.admitted_projected += 1
        else:
            stats.rejected_projected += 1
        return ok

    def fits_quietly(self, req: Request, chunk: int, ahead: int) -> bool:
        """fits() without counting it in the statistics (a check before making room)."""
        stats = self.b.stats
        saved = (stats.admitted_fast, stats.admitted_projected, stats.rejected_projected)
        ok = self.fits(req, chunk, ahead)
        stats.admitted_fast, stats.admitted_projected, stats.rejected_projected = saved
        return ok

    def prefill_chunk(self, prompt: int, count: int, longest: int, total: int) -> int | None:
        """Tokens of `prompt` to prefill this step given the chunks already planned: the whole prompt
        when it fits the cap, a chunk of what is left (chunked prefill), 0 when nothing is left, or
        None when the prompt must wait to be prefilled alone."""
        cfg, w = self.b.config, self.b.weight
        cap = cfg.max_prefill_weight
        if not cap or w.prefill(count + 1, max(longest, prompt), total + prompt) <= cap:
            return prompt
        if w.name == "token" and total >= cap:
            return 0
        if cfg.chunked_prefill and w.name == "token":
            return cap - total
        return None if count else prompt

    def candidate_budget(self, cand: Request) -> int:
        """The budget `cand` is checked against: less the predictive margin and a low class's headroom
        while anything runs (alone, a request always fits: its worst case does), less the pages pinned
        this step for a hit's copies (held until the step runs: room no one else has)."""
        b = self.b
        budget = b.budget
        if b.running:
            res = b.reservations
            if b.estimator is not None:
                budget -= res.margin(res.variance(cand))
            if -b.order[cand.id][0] < b.config.headroom_priority:
                budget -= b.headroom
        if cand.adapter:  # one more adapter slot, if its adapter needs one (no call on the base's path)
            budget -= b.adapters.extra_weight(cand.adapter)
        self.budget = budget - b.paging.pinned * b.weight.block_size
        return budget

    def admit(self, now: float, plan: StepPlan, prefill_state: list[int]) -> None:
        b, cfg = self.b, self.b.config
        order, tenants = b.order, b.tenants
        count, longest, total = prefill_state
        ahead = sum(r.prefill_left for r in b.running.values() if not r.decoding) - total
        first_blocked: Request | None = None
        first_idx = 0
        taken: list[int] = []
        refused: list[tuple[int, int, int, int]] = []
        fair = cfg.fairness and tenants.contended
        candidates = tenants.order(b.waiting, lambda r: order[r.id][0], b.held) if fair else enumerate(b.waiting)
        evicted: list[Request] = []  # preempted for a tenant below its share: back to the queue below
        # background work runs that an urgent class may preempt (preemption.py: make_room_for_class)
        background = cfg.class_preemption and any(-order[r.id][0] < cfg.headroom_priority for r in b.running.values())
        capped: set[str] = set()  # tenants that admit nothing more in this pass (their cap, a jump rule)
        blocked: dict[str, Request] = {}  # each tenant's first request that did not fit in this pass
        for scanned, (idx, cand) in enumerate(candidates):
            if cfg.max_batch_size and len(b.running) >= cfg.max_batch_size:
                break
            if cand.tenant in capped or (
                cfg.tenant_cap and fair and tenants.weight[cand.tenant] >= cfg.tenant_cap * b.budget
            ):
                continue  # its tenant has its share: the others' requests may still start
            if first_blocked is not None and (
                scanned - first_idx > cfg.jump_scan
                or order[cand.id][0] != order[first_blocked.id][0]  # a lower class never jumps a higher one
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
            hits = b.paging.lookup(cand)
            p = cand.prefill_left
            chunk = self.prefill_chunk(p, count, longest, total)
            if chunk == 0:
                b.paging.unlookup(cand)
                break  # this step's prefill budget is spent
            if chunk is None:  # a prompt over the cap runs only when prefilled alone
                b.paging.unlookup(cand)
                blocked.setdefault(key, cand)
                if first_blocked is None:
                    first_blocked, first_idx = cand, scanned
                continue
            cand.reserved_new = b.reservations.reserve(cand)
            budget = self.candidate_budget(cand)
            ctx, res, fix = cand.context_len, cand.reserved_new, cand.fixed_len
            # A candidate at least as long in context, reservation and fixed part (and in the rest) as
            # one refused in this pass is refused too (it weighs at least as much at every step).
            # (Not for a candidate with cached blocks: they weigh less than their length.)
            dominated = not hits and any(
                c <= ctx and r <= res and f <= fix and c - f <= ctx - fix and x >= budget for c, r, f, x in refused
            )
            if not dominated and fair and cfg.fair_preemption and not self.fits_quietly(cand, chunk, ahead):
                make_room(b, cand, chunk, ahead, plan, evicted)
            if (
                background
                and not dominated
                and -order[cand.id][0] >= cfg.headroom_priority
                and not self.fits_quietly(cand, chunk, ahead)
            ):
                make_room_for_class(b, cand, chunk, ahead, plan, evicted)
            if dominated or not b.fits(cand, chunk, ahead):  # (a simulated policy may override fits)
                b.paging.unlookup(cand)
                if not dominated and not hits and len(refused) < 16:
                    refused.append((ctx, res, fix, budget))
                blocked.setdefault(key, cand)
                if first_blocked is None:
                    first_blocked, first_idx = cand, scanned
                continue
            mine = tenants.weight[cand.tenant]
            if cfg.tenant_cap and fair and mine and mine + b.projector.own_final(cand) > cfg.tenant_cap * b.budget:
                b.paging.unlookup(cand)
                capped.add(cand.tenant)  # its later requests wait behind this one (its own order is kept)
                continue  # past its tenant's share (one request always may run): wait, holding no one back
            taken.append(idx)
            b.start(cand, chunk, ahead)
            if fair:
                tenants.counter[cand.tenant] += b.held(cand)  # its prompt is service too
            plan.admitted.append(cand)
            plan.prefill.append((cand, chunk))
            b.paging.allocate(cand, cand.prefilled + chunk)
            count, longest, total = count + 1, max(longest, chunk), total + chunk
            ahead += p - chunk
        if taken:
            drop = set(taken)
            b.waiting = [r for i, r in enumerate(b.waiting) if i not in drop]
        else:
            b.idle = True
        for req in evicted:
            b.enqueue(req)
