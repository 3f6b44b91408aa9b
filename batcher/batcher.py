"""The batcher: who runs next, decided once per engine step.

Each step `schedule(now)` returns a StepPlan (prompt chunks to prefill, sequences to decode,
requests admitted or preempted); the engine runs it and reports back with `complete(plan)`,
then `finish(id)` for every request that ended (EOS, stop sequence, length).

The Batcher decides; its parts own their state and answer questions. It holds the waiting queue
(WaitingQueue), the running set, the committed weight (the running requests' reserved final weights)
and each request's status; the Projector keeps the running set's projection, Paging the pages and
cached blocks, TenantShares each tenant's weight and service, Reservations the predictive margin,
AdapterSlots the LoRA slots. Each part returns values (a request's own weight, the finishes that
moved, the holders whose charge changed, a prefix-cache hit) that the Batcher applies; none of them
knows the Batcher. Admission (`_admit`), regrowth and eviction are the Batcher's own methods; whom
to preempt is chosen by pure functions of the values it passes (preemption.py).

Admission is one walk over the waiting queue per step: by priority class (higher first), within a
class by tenant (the one that has received the least service first: TenantShares) and by arrival
within a tenant. A candidate is admitted only if its policy says it fits: by default the projected
weight of the running requests plus the candidate stays within the candidate's budget at every
future step (batcher/projection/); candidates that pass the naive test (the sum of everyone's final
weight fits) skip the projection. A later request may jump one of its tenant's that does not fit,
but only if it arrived within jump_window_s after it, and never once that one has waited max_wait_s;
a lower class never jumps a higher one. Classes below headroom_priority may not take the last
priority_headroom of the budget, so a higher-class request starts at once. Nothing starves: a
request that has waited max_wait_s ranks with the top class.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import replace

from .adapters import AdapterSlots
from .admission import DOMINANCE_MEMORY, PROJECTED, Outcome, Policy, prefill_chunk, with_slot
from .blocks import BlockLedger
from .config import BatcherConfig
from .estimator import OutputLengthEstimator
from .fairness import TenantShares
from .outlook import MAX_POINTS, Urgency, spread
from .paging import NO_HIT, Hit, Paging
from .plan import BatcherStats, PrefillLoad, StepPlan
from .preemption import PREEMPT_SHARE, for_class, for_tenant, newest
from .projection import PaddedProfile, TokenProfile
from .projector import Projector
from .queue import WaitingQueue
from .request import DECODING, PREFILLING, WAITING, Request, check_request
from .reservations import Reservations
from .running import plan_running, weight_with
from .weight import weight_model


class Batcher:
    """Weight-aware admission over one waiting queue and one running set."""

    REFRESH_EVERY = 16  # predictive mode: refresh the length estimate after this many finishes (or steps)

    def __init__(
        self, config: BatcherConfig, policy: Policy = PROJECTED, pages: bool = True, adapter_slot_weight: int = 0
    ) -> None:
        """`policy`: how candidates are checked; `pages=False`: no block ledger (a simulated count
        policy); `adapter_slot_weight`: one LoRA adapter slot's weight (0: adapters are not served)."""
        self.config = cfg = config.resolved()
        self.policy = policy
        self.budget: int = cfg.max_batch_weight  # type: ignore[assignment]  # less adapter slots taken
        self.weight = weight_model(cfg.weight_model, cfg.block_size, cfg.kinds)
        predictive = (cfg.predictive_margin, cfg.predictive_min_samples, cfg.predictive_window)
        self.estimator = OutputLengthEstimator(*predictive) if cfg.mode == "predictive" else None
        self.queue = WaitingQueue()
        self.running: dict[str, Request] = {}  # admission order
        self.committed = 0  # the running requests' reserved final weights, cached blocks apart (naive test)
        self.step = 0  # steps completed
        self.stats = BatcherStats()
        self.headroom = int(cfg.priority_headroom * self.budget)  # weight kept from background classes
        self.reservations = Reservations(self.estimator, cfg.max_preemptions)
        self.idle = False  # the last pass admitted nothing and nothing has changed since
        self.tenants = TenantShares()  # fairness between tenants within a class
        self.projector = Projector(self.weight, cfg.max_prefill_weight)
        ledger_pages = self.budget // cfg.block_size if pages else None
        self.paging = Paging(self.weight, ledger_pages, cfg.prefix_cache, tuple(cfg.windows))
        # LoRA slots: as many as leave room for one request of max_total_tokens
        self.adapters = AdapterSlots.sized(adapter_slot_weight, self.budget - self.weight.seq(cfg.max_total_tokens))

    # ----- the engine's calls ----------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Reject a request that could never run; the error names the field and the limit."""
        cfg = self.config
        check_request(
            req, cfg.max_total_tokens, self.weight.seq, self.budget, self.adapters.check, req.id in self.queue
        )

    def submit(self, req: Request) -> None:
        self.check(req)
        self.tenants.arrive(req.tenant)
        req.status = WAITING
        self.queue.submit(req)
        self.idle = False

    def cancel(self, request_id: str) -> Request | None:
        """Drop a waiting or running request; its reservation is freed before the next step."""
        req = self.running.pop(request_id, None)
        if req is not None:
            self._release(req)
        else:
            req = self.queue.remove(request_id)
        if req is not None:
            self.queue.forget(req.id)
            self.tenants.leave(req.tenant)
            self.idle = False
        return req

    def requeue(self, request_id: str) -> Request:
        """Back to the queue, to be prefilled again (a failed step may have written part of a window's ring)."""
        return self.preempt(self.running[request_id])

    def finish(self, request_id: str) -> Request:
        """A running request ended (EOS, stop sequence or length); its blocks are free."""
        req = self.running.pop(request_id)
        self._release(req)
        self.queue.forget(req.id)
        self.tenants.leave(req.tenant)
        self.stats.finish(req.generated)
        if self.estimator is not None and not req.runs_to_max:
            self.estimator.observe(req.generated)
            self.estimator.relax()
        self.idle = False
        return req

    def unload_adapter(self, adapter: str) -> None:
        """`adapter` was unloaded: its slot is free now, or once no running request uses it."""
        self.adapters.forget(adapter)

    def adapter_loads(self) -> list[tuple[str, int]]:
        """The (adapter, slot) placements of requests admitted since the engine last asked."""
        return self.adapters.drain()

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(self.step)
        est = self.estimator
        if est is not None and self.running:
            if est.pending >= self.REFRESH_EVERY or (est.pending and not self.step % self.REFRESH_EVERY):
                est.refresh([r.generated for r in self.running.values() if not r.runs_to_max])
            plan.preempted = self._regrow()
        if self.policy.preempts_to_fit:  # vLLM's rule: the newest go until the next step's growth fits
            victims = []
            while self.running and self.weight_with(1) > self.budget:
                victims.append(self.preempt(max(self.running.values(), key=self.queue.key)))
            plan.preempted[:0] = victims
        load = plan_running(
            self.running.values(), self.config.max_prefill_weight, self.paging, self.projector.finish_of, plan
        )
        for req, blocks, holders in load.cached:
            self._cached(req, blocks, holders)
        waiting = self.queue.requests
        if waiting and self.queue.age(now, self.config.max_wait_s):
            self.idle = False  # a request moved up: the queue deserves a real pass
        if waiting and not self.idle:
            out = self._admit(now, plan, load)
            if out.taken:
                self.queue.take(out.taken)
            else:
                self.idle = True
            for req in out.evicted:
                self.queue.put(req)
                self.idle = False
        elif waiting:
            self.stats.idle_passes += 1
        if self.weight.windows and self.ledger is not None and self.ledger.caching and plan.prefill:
            self.paging.take_snapshots(plan)
        return plan

    def complete(self, plan: StepPlan) -> list[Request]:
        """Advance every request of the plan by its step; returns those that emitted a token."""
        self.step += 1
        running = self.running
        if self.weight.windows and self.ledger is not None and self.ledger.caching:
            self.paging.settle(plan, lambda r: running.get(r.id) is r)
        emitted: list[Request] = []
        for req, n in plan.prefill:
            if running.get(req.id) is not req:
                continue  # cancelled or preempted while the step ran
            req.prefilled += n
            if req.prefilled == req.context_len:
                req.generated += 1
                req.status = DECODING
                emitted.append(req)
                self._moved(req.id, self.projector.decodes(req, self.step))  # a chunked prompt's projection tightens
                self._running_changed()
        for req in plan.decode:
            if running.get(req.id) is not req:
                continue
            req.prefilled += 1
            req.generated += 1
            emitted.append(req)
        self.stats.generated_tokens += len(emitted)
        if self.config.fairness and self.tenants.contended:
            self.tenants.charge(running.values(), self.held_weight)
        return emitted

    def preempt(self, req: Request, enqueue: bool = True) -> Request:
        """Send a running request back to the queue; it keeps its tokens and is prefilled again."""
        del self.running[req.id]
        self._release(req)
        self.stats.preemptions += 1
        self.stats.preempted_tokens += req.prefilled
        req.preemptions += 1
        req.prefilled = 0
        req.status = WAITING
        if enqueue:
            self.queue.put(req)
            self.idle = False
        return req

    # ----- admission ---------------------------------------------------------------------------------
    def _admit(self, now: float, plan: StepPlan, load: PrefillLoad) -> Outcome:
        """One walk over the waiting queue; returns the positions it started and whom it preempted."""
        cfg, queue, tenants, running, paging = self.config, self.queue, self.tenants, self.running, self.paging
        keys, weight, reservations = queue.keys, self.weight, self.reservations
        out = Outcome()
        count, longest, total = load.chunks, load.longest_tokens, load.tokens
        ahead = sum(r.prefill_left for r in self.projector.prefilling.values()) - total  # the running not decoding
        first_blocked: Request | None = None
        first_idx = 0
        refused: list[tuple[int, int, int, int]] = []
        fair = cfg.fairness and tenants.contended
        waiting = queue.requests
        candidates = tenants.order(waiting, queue.rank, self.held_weight) if fair else enumerate(waiting)
        # background work runs that an urgent class may preempt (preemption.for_class)
        floor = cfg.headroom_priority
        background = cfg.class_preemption and any(-keys[r.id][0] < floor for r in running.values())  # rank, inline
        capped: set[str] = set()  # tenants that admit nothing more in this pass (their cap, a jump rule)
        blocked: dict[str, Request] = {}  # each tenant's first request that did not fit in this pass
        cap = cfg.max_batch_size  # running requests (a worker's task threads), 0: the weight alone limits
        for scanned, (idx, cand) in enumerate(candidates):
            full = cap and len(running) >= cap
            if full and not (fair and cfg.fair_preemption) and not (background and -keys[cand.id][0] >= floor):
                break  # no one here may take another's slot
            if fair and len(capped) >= len(tenants.requests):
                break  # every tenant is done for this pass
            if cand.tenant in capped or (
                cfg.tenant_cap and fair and tenants.reserved[cand.tenant] >= cfg.tenant_cap * self.budget
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
            cand.reserved_new = reservations.reserve(cand)
            hit = paging.lookup(cand)
            # what is checked: the candidate as it would start, its hit's blocks cached (a copy: the
            # request itself changes only if it starts)
            probe = cand if hit is NO_HIT else replace(cand, shared_blocks=hit.blocks, prefilled=hit.tokens)
            p = probe.prefill_left
            chunk = prefill_chunk(cfg, weight, p, count, longest, total)
            if chunk == 0:
                break  # this step's prefill budget is spent
            if chunk is None:  # a prompt over the cap runs only when prefilled alone
                blocked.setdefault(key, cand)
                if first_blocked is None:
                    first_blocked, first_idx = cand, scanned
                continue
            budget, limit = self._budget_for(probe, hit.pages)
            ctx, res, fix = cand.context_len, cand.reserved_new, cand.fixed_len
            # A candidate at least as long in context, reservation and fixed part (and in the rest) as
            # one refused in this pass is refused too (it weighs at least as much at every step).
            # (Not for a candidate with cached blocks: they weigh less than their length.)
            dominated = hit is NO_HIT and any(
                c <= ctx and r <= res and f <= fix and c - f <= ctx - fix and x >= budget for c, r, f, x in refused
            )
            if not dominated and fair and cfg.fair_preemption and (full or not self.fits(probe, chunk, ahead, limit)):
                victims = for_tenant(
                    probe,
                    self.projector.own_final(probe),
                    tenants,
                    self.slot_weight,
                    self.budget / len(tenants.requests),
                    running.values(),
                    self.projector.own_final,
                    cfg.max_preemptions,
                    self.step,
                    with_slot(cap, len(running), self._admits_without(probe, chunk, ahead, limit)),
                )
                if victims:
                    self._evict(victims, plan, out.evicted)
            full = cap and len(running) >= cap
            if (
                background
                and not dominated
                and -keys[cand.id][0] >= floor
                and (full or not self.fits(probe, chunk, ahead, limit))
            ):
                admits = with_slot(cap, len(running), self._admits_without(probe, chunk, ahead, limit))
                victims = for_class(running.values(), queue.rank, floor, self.step, admits)
                if victims:
                    self._evict(victims, plan, out.evicted)
            if cap and len(running) >= cap:  # no slot was freed for it
                if not fair:
                    break
                capped.add(cand.tenant)
                continue
            if dominated or not self._decide(probe, chunk, ahead, limit):
                if not dominated and hit is NO_HIT and len(refused) < DOMINANCE_MEMORY:
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
                and mine + self.projector.own_final(probe) > cfg.tenant_cap * self.budget
            ):
                capped.add(cand.tenant)  # its later requests wait behind this one (its own order is kept)
                continue  # past its tenant's share (one request always may run): wait, holding no one back
            out.taken.append(idx)
            self._start(cand, hit, chunk, ahead, plan)
            count, longest, total = count + 1, max(longest, chunk), total + chunk
            ahead += p - chunk
        return out

    def _budget_for(self, cand: Request, pinning: int = 0) -> tuple[int, int]:
        """The weight `cand` may be admitted within: the budget less the predictive margin and a low
        class's headroom while anything runs (alone, a request always fits: its worst case does), and
        its adapter's new slot; and that less the pages pinned this step for hits' copies, its own
        (`pinning`) included (the limit it is checked against: room no one else has until the step runs)."""
        budget = self.budget
        if self.running:
            res = self.reservations
            if self.estimator is not None:
                budget -= res.margin(res.variance(cand))
            if -self.queue.keys[cand.id][0] < self.config.headroom_priority:  # its rank (inline: once per candidate)
                budget -= self.headroom
        if cand.adapter:  # one more adapter slot, if its adapter needs one (no call on the base's path)
            budget -= self.adapters.extra_weight(cand.adapter)
        return budget, budget - (self.paging.pinned_pages + pinning) * self.weight.block_size

    def fits(self, req: Request, chunk: int | None = None, ahead: int = 0, limit: int | None = None) -> bool:
        """Could `req` (reservation set) start now, the weight never over `limit` (default: its budget)?
        A question: nothing changes."""
        chunk = req.prefill_left if chunk is None else chunk
        limit = self._budget_for(req)[1] if limit is None else limit
        return self._policy_fits(req, chunk, ahead, limit)[0]

    def _decide(self, req: Request, chunk: int, ahead: int, limit: int) -> bool:
        """The walk's check of a candidate, counted in the stats (by the naive sum, projected, refused)."""
        ok, fast = self._policy_fits(req, chunk, ahead, limit)
        st = self.stats
        if fast:
            st.admitted_fast += 1
        elif ok:
            st.admitted_projected += 1
        else:
            st.rejected_projected += 1
        return ok

    def _policy_fits(self, req: Request, chunk: int, ahead: int, limit: int) -> tuple[bool, bool]:
        """(fits, by the naive sum alone) under this batcher's policy."""
        rule = self.policy.rule
        if rule == "projected":  # exact projection, each cached block counted once
            if req.shared_blocks:
                return self._sharing_fits(req, chunk, ahead, limit)
            if self.naive_fits(req.reserved_total, req.fixed_len, limit):
                return True, True
            return self.profile().admits(self.projector.entry(req, chunk, ahead, self.step), limit), False
        if rule == "count":
            return len(self.running) < self.policy.slots, False
        if rule == "sum":
            return self.naive_fits(req.reserved_total, 0, limit), False
        # "current": like vLLM, the running requests' next slots are allocated before a waiting prompt's blocks
        used = self.weight.batch([r.context_len + 1 for r in self.running.values()] + [req.context_len + 1])
        return used <= self.budget, False

    def naive_fits(self, final: int, fixed_len: int, limit: int) -> bool:
        """The fast path: does the sum of every final weight, a candidate's (`final`) included, fit?"""
        w = self.weight
        if w.name == "token":  # the held cached blocks inline (Paging.shared_weight): this is the fast path
            return self.committed + self.paging.shared.held_blocks * w.block_size + w.seq(final) <= limit
        running = self.running.values()
        fixed = max((r.fixed_len for r in running), default=0)
        rest = max((r.reserved_total - r.fixed_len for r in running), default=0)
        return (len(running) + 1) * (max(fixed, fixed_len) + max(rest, final - fixed_len)) <= limit

    def _sharing_fits(self, req: Request, chunk: int, ahead: int, limit: int) -> tuple[bool, bool]:
        """A candidate that would hold cached blocks: exact, counting each block once."""
        proj, shared = self.projector, self.paging.shared
        entry = proj.entry(req, chunk, ahead, self.step)
        new, extended = shared.plan(req.prefix[: req.shared_blocks], entry.finish, proj.finish_of)
        if self.committed + (shared.held_blocks + new) * self.weight.block_size + proj.own_final(req) <= limit:
            return True, True
        return self.profile().admits_sharing(entry, new, extended, limit), False

    def _admits_without(self, req: Request, chunk: int, ahead: int, limit: int) -> Callable[[set[str]], bool]:
        """Would the projection admit `req` with these running requests preempted? Conservative, so that
        no one is preempted in vain: a candidate that found cached blocks is counted as holding them as its
        own, for its whole life (the exact check follows the preemption)."""
        entry = []

        def admits(ids: set[str]) -> bool:
            if not entry:
                alone = replace(req, shared_blocks=0) if req.shared_blocks else req
                entry.append(self.projector.entry(alone, chunk, ahead, self.step))
            self.profile()  # entries brought up to date
            return self.projector.without(ids).admits(entry[0], limit)

        return admits

    def _evict(self, victims: list[Request], plan: StepPlan, evicted: list[Request]) -> None:
        """Preempt `victims` out of this step's plan; they go back to the queue after the walk (`evicted`)."""
        gone = {r.id for r in victims}
        plan.prefill[:] = [(r, n) for r, n in plan.prefill if r.id not in gone]
        plan.decode[:] = [r for r in plan.decode if r.id not in gone]
        for r in victims:
            plan.preempted.append(self.preempt(r, enqueue=False))
            evicted.append(r)

    def _regrow(self) -> list[Request]:
        """Predictive mode: extend reservations that ran out, then, if the next step's growth would not
        fit in the budget, preempt the newest requests until it does. The budget is never exceeded.

        A projection that overflows after a reservation grows stops admission, but preempts nothing:
        reservations are estimates, and most running requests finish well inside theirs."""
        for req in self.running.values():
            if req.status is DECODING and req.generated >= req.reserved_new:
                self._grow_reservation(req)
        preempted: list[Request] = []
        while self.running and self.weight_with(1) > self.budget:
            preempted.append(self.preempt(newest(self.running.values(), self.queue.key, self.config.max_preemptions)))
        st, est = self.stats, self.estimator
        if preempted and est is not None and st.preempted_tokens > PREEMPT_SHARE * st.generated_tokens:
            est.tighten()
        return preempted

    # ----- the running set's weight ------------------------------------------------------------------
    def _start(self, req: Request, hit: Hit, chunk: int, ahead: int, plan: StepPlan) -> None:
        """Admit `req` into `plan` with a first chunk of `chunk` tokens, the cached blocks of `hit` its first."""
        if hit.blocks:
            req.shared_blocks, req.prefilled, req.ring_copies = hit.blocks, hit.tokens, hit.copies
        req.admitted_step, req.status = self.step, PREFILLING
        self.running[req.id] = req
        own = self.projector.start(req, chunk, ahead, self.step)
        self.committed += own
        self.tenants.start(req.tenant, own)
        self.budget -= self.adapters.acquire(req.adapter, self.step)  # a new slot for its adapter
        self.stats.prompt_tokens += req.context_len
        self.stats.cached_tokens += req.prefilled
        if not req.preemptions:
            req.cached_tokens = req.prefilled
        if req.shared_blocks:
            self._recharge(self.paging.hold(req, self.projector.finish_of))
        self.reservations.track(req)
        self._running_changed()
        self.stats.admitted += 1
        if self.config.fairness and self.tenants.contended:
            self.tenants.serve(req.tenant, self.held_weight(req))  # its prompt is service too
        plan.admitted.append(req)
        plan.prefill.append((req, chunk))
        blocks, holders = self.paging.allocate(req, req.prefilled + chunk, self.projector.finish_of)
        if blocks:
            self._cached(req, blocks, holders)

    def _cached(self, req: Request, blocks: int, holders: Set[str]) -> None:
        """`blocks` of `req`'s own became cached blocks: they weigh once, for all their holders, from now on."""
        w = blocks * self.weight.block_size
        self.committed -= w
        self.tenants.shift(req.tenant, -w)
        self._recharge(holders)
        self._running_changed()

    def _release(self, req: Request) -> None:
        """`req` left the running set (finished, cancelled, preempted): its weight and pages are free."""
        own = self.projector.stop(req)
        self.committed -= own
        self.tenants.stop(req.tenant, own)
        self.reservations.forget(req.id)
        self.adapters.release(req.adapter)
        self._recharge(self.paging.leave(req, self.projector.finish_of))
        self._running_changed()

    def _grow_reservation(self, req: Request) -> None:
        """Predictive mode: a decoding request outran its reservation; it reserves again."""
        proj = self.projector
        old = proj.own_final(req)
        req.reserved_new = self.reservations.reserve(req)
        grown = proj.own_final(req) - old
        self.committed += grown
        self.tenants.shift(req.tenant, grown)
        self.reservations.track(req)
        self._moved(req.id, proj.set_entry(req.id, proj.decoding_entry(req, self.step)))
        self._running_changed()

    def _moved(self, request_id: str, old_finish: int | None) -> None:
        """A running request's projected finish moved: the cached blocks it holds may change anchor."""
        if old_finish is not None:
            self._recharge(self.paging.refinish(request_id, old_finish, self.projector.finish_of))

    def _recharge(self, holders: Set[str]) -> None:  # their charge of cached blocks changed
        for rid in holders:
            self.projector.set_shared(rid, self.paging.charged(rid))

    def _running_changed(self) -> None:
        """The running set or a reservation changed: prefilling requests' entries (which depend on the
        step and on the chunks ahead of them) are recomputed before the next decision, and the queue
        gets a real pass."""
        self.projector.stale = True
        self.idle = False

    def profile(self) -> TokenProfile | PaddedProfile:
        """The running set's projection, prefilling entries refreshed first (their anchors recharged)."""
        proj = self.projector
        if proj.stale:
            for rid, old in proj.refresh_prefilling(self.step):
                self._moved(rid, old)
        return proj.profile()

    # ----- questions (the engine, the worker's outlook, tests) ---------------------------------------
    @property
    def waiting(self) -> list[Request]:
        """The waiting requests in admission order."""
        return self.queue.requests

    @property
    def ledger(self) -> BlockLedger | None:
        return self.paging.ledger  # the paged runner's pages (None for the padded weight)

    @property
    def shared_blocks_held(self) -> int:
        """Distinct cached blocks the running requests hold (each weighs once)."""
        return self.paging.shared.held_blocks

    def held_weight(self, req: Request) -> int:
        """The weight a running request holds now (what its tenant pays per step)."""
        return self.weight.own(req.context_len, req.shared_blocks)

    def batch_weight(self) -> int:
        """The weight the running requests hold now (their tokens so far, whole prompts included)."""
        return self.weight_with(0)

    def weight_with(self, more: int) -> int:
        """The running requests' weight with `more` tokens each (1: after the next step, if every one
        emits; a prefilling one emits with its last chunk: conservative by at most a block)."""
        return weight_with(self.running.values(), self.weight, self.paging.shared_weight, more)

    def room_for(self) -> int:
        """How many more requests of the typical size (recent admissions' reserved weight) would fit
        by the naive sum after everything already waiting (at its worst case) is admitted: what a
        worker may take from a shared queue without hoarding. Waiting work counts, not blocks:
        requests held back only by the prefill cap start within a few steps. Under a cap on running
        requests (max_batch_size), never more than the cap leaves."""
        w = self.weight
        typical = self.projector.typical or w.seq(self.config.max_total_tokens)
        pending = sum(w.seq(r.max_total) for r in self.waiting)
        room = max(0, (self.budget - self.committed - self.paging.shared_weight - pending) // typical)
        if cap := self.config.max_batch_size:
            room = min(room, max(0, cap - len(self.running) - len(self.waiting)))
        return room

    @property
    def slot_weight(self) -> float:
        """The budget over the cap on running requests (0: no cap): one running request's part of the
        batch where the count binds before the weight (TenantShares.use)."""
        cap = self.config.max_batch_size
        return self.budget / cap if cap else 0.0

    def projected_peak(self) -> int:
        return self.profile().peak() if self.running else 0

    def outlook(self) -> dict:
        """What this batcher knows of its near future (batcher/outlook.py), JSON-ready: finish_steps
        (ascending), running (how many finish_steps stand for), slots, waiting {class: requests},
        mean_output (tokens of recent finished requests)."""
        est = self.estimator
        finishes = []
        for r in self.running.values():
            total = r.max_new_tokens if est is None or r.runs_to_max else est.reserve(r.max_new_tokens, r.generated)
            finishes.append(max(1, total - r.generated))
        waiting: dict[str, int] = {}
        for r in self.waiting:
            waiting[str(r.priority)] = waiting.get(str(r.priority), 0) + 1
        running = len(self.running)
        return {
            "finish_steps": spread(sorted(finishes), MAX_POINTS),
            "running": running,
            "slots": running + self.room_for(),
            "waiting": waiting,
            "mean_output": round(self.mean_output(), 1),
        }

    def mean_output(self) -> float:
        """Recent finished requests' mean output; before any has finished, what the ones in hand ask
        for (a cold worker's first flood is what the queue behind it holds more of)."""
        if self.stats.finished:
            return self.stats.mean_output
        asked = [r.max_new_tokens for r in (*self.running.values(), *self.waiting)]
        return sum(asked) / len(asked) if asked else 0.0

    def urgency(self) -> Urgency:
        """What a worker needs to take jobs beyond its room (Urgency). Safe to call from another
        thread: it copies the containers, never iterates them."""
        floor = self.config.headroom_priority
        waiting, running = list(self.waiting), tuple(self.running.values())
        shares, slot = self.tenants, self.slot_weight
        weights, tenants = dict(shares.reserved), len(shares.requests)
        share = self.budget / (tenants + 1)
        # a tenant's hold on whichever binds: its weight, or its running requests' slots under a count cap
        heavy = tuple(t for t, w in weights.items() if w and shares.use(t, slot) >= share)
        urgent = [r for r in waiting if r.priority >= floor]
        return Urgency(
            len(urgent),
            sum(r.priority < floor for r in running),
            heavy,
            sum(r.tenant not in heavy for r in urgent),
        )

    def check_memory(self) -> None:
        """Invariants (tests): Paging.check, and the committed weight is the tenants' reserved weights."""
        running = list(self.running.values())
        self.profile()
        self.paging.check(running, self.batch_weight(), self.projector.finish_of)
        assert self.committed == sum(self.tenants.reserved.values()), "tenants' weights disagree with the committed"
        counts: dict[str, int] = {}
        for r in running:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
        assert {t: n for t, n in self.tenants.running.items() if n} == counts, "tenants' running counts disagree"
        assert all(r.status is not WAITING for r in running), "a running request marked waiting"
