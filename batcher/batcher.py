"""The batcher: who runs next, decided once per engine step.

Each step `schedule(now)` returns a StepPlan (prompt chunks to prefill, sequences to decode,
requests admitted or preempted); the engine runs it and reports back with `complete(plan)`,
then `finish(id)` for every request that ended (EOS, stop sequence, length).

The Batcher alone holds the state that admission depends on: the waiting queue (WaitingQueue), the
running set, the committed weight (the running requests' reserved final weights), each tenant's
reserved weight and service (TenantShares), and each request's status. Its parts take no Batcher and
never call back: the Projector keeps the running set's projection, Paging the pages and cached
blocks, Reservations the predictive margin; each returns values (a request's own weight, the
finishes that moved, the holders whose charge changed) that the Batcher applies. The admission walk
and the preemption choices read it and change it only through the methods below. Nothing starves: a
request that has waited max_wait_s ranks with the top class.
"""

from __future__ import annotations

from collections.abc import Set

from . import admission, preemption
from .adapters import AdapterSlots
from .admission import Policy, Projected
from .config import BatcherConfig
from .estimator import OutputLengthEstimator
from .fairness import TenantShares
from .paging import Paging
from .plan import BatcherStats, StepPlan
from .projection import PaddedProfile, TokenProfile
from .projector import Projector
from .queue import WaitingQueue
from .request import DECODING, PREFILLING, WAITING, Request, check_request
from .reservations import Reservations
from .running import plan_running
from .view import BatcherView
from .weight import weight_model


class Batcher(BatcherView):
    """Weight-aware admission over one waiting queue and one running set."""

    REFRESH_EVERY = 16  # predictive mode: refresh the length estimate after this many finishes (or steps)

    def __init__(self, config: BatcherConfig, policy: Policy | None = None, pages: bool = True) -> None:
        """`policy`: how candidates are checked; `pages=False`: no block ledger (a simulated count policy)."""
        self.config = cfg = config.resolved()
        self.policy = policy or Projected()
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
        self.adapters = AdapterSlots()  # LoRA adapters' slots; the engine sets slot_weight

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

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(self.step)
        est = self.estimator
        if est is not None and self.running:
            if est.pending >= self.REFRESH_EVERY or (est.pending and not self.step % self.REFRESH_EVERY):
                est.refresh([r.generated for r in self.running.values() if not r.runs_to_max])
            plan.preempted = preemption.regrow(self)
        if self.policy.preempts_to_fit:  # vLLM's rule: the newest go until the next step's growth fits
            victims = []
            while self.running and self.weight_with(1) > self.budget:
                victims.append(self.preempt(max(self.running.values(), key=self.queue.key)))
            plan.preempted[:0] = victims
        load = plan_running(
            self.running.values(),
            self.config.max_prefill_weight,
            self.paging,
            self.projector.finish_of,
            self._cached,
            plan,
        )
        waiting = self.queue.requests
        if waiting and self.queue.age(now, self.config.max_wait_s):
            self.idle = False  # a request moved up: the queue deserves a real pass
        if waiting and not self.idle:
            out = admission.admit(self, now, plan, load)  # it starts and evicts through start() and preempt()
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
                self.running_changed()
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

    def start(self, req: Request, chunk: int, ahead: int, plan: StepPlan) -> None:
        """Admit `req` into `plan` with a first chunk of `chunk` tokens (its `shared_blocks` are cached)."""
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
        self.running_changed()
        self.stats.admitted += 1
        if self.config.fairness and self.tenants.contended:
            self.tenants.counter[req.tenant] += self.held_weight(req)  # its prompt is service too
        plan.admitted.append(req)
        plan.prefill.append((req, chunk))
        self.allocate(req, req.prefilled + chunk)

    def allocate(self, req: Request, tokens: int) -> None:
        """Pages for `req`'s prompt up to `tokens` (its full blocks join the prefix cache)."""
        blocks, holders = self.paging.allocate(req, tokens, self.projector.finish_of)
        if blocks:
            self._cached(req, blocks, holders)

    def _cached(self, req: Request, blocks: int, holders: Set[str]) -> None:
        """`blocks` of `req`'s own became cached blocks: they weigh once, for all their holders, from now on."""
        w = blocks * self.weight.block_size
        self.committed -= w
        self.tenants.reserved[req.tenant] -= w
        self._recharge(holders)
        self.running_changed()

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

    def _release(self, req: Request) -> None:
        """`req` left the running set (finished, cancelled, preempted): its weight and pages are free."""
        own = self.projector.stop(req)
        self.committed -= own
        self.tenants.stop(req.tenant, own)
        self.reservations.forget(req.id)
        self.adapters.release(req.adapter)
        self._recharge(self.paging.leave(req, self.projector.finish_of))
        self.running_changed()

    def grow_reservation(self, req: Request) -> None:
        """Predictive mode: a decoding request outran its reservation; it reserves again."""
        proj = self.projector
        old = proj.own_final(req)
        req.reserved_new = self.reservations.reserve(req)
        grown = proj.own_final(req) - old
        self.committed += grown
        self.tenants.reserved[req.tenant] += grown
        self.reservations.track(req)
        self._moved(req.id, proj.set_entry(req.id, proj.decoding_entry(req, self.step)))
        self.running_changed()

    def _moved(self, request_id: str, old_finish: int | None) -> None:
        """A running request's projected finish moved: the cached blocks it holds may change anchor."""
        if old_finish is not None:
            self._recharge(self.paging.refinish(request_id, old_finish, self.projector.finish_of))

    def _recharge(self, holders: Set[str]) -> None:  # their charge of cached blocks changed
        for rid in holders:
            self.projector.set_shared(rid, self.paging.charged(rid))

    def running_changed(self) -> None:
        """The running set or a reservation changed: prefilling requests' entries (which depend on the
        step and on the chunks ahead of them) are recomputed before the next decision, and the queue
        gets a real pass."""
        self.projector.stale = True
        self.idle = False

    def fits(
        self, req: Request, chunk: int | None = None, ahead: int = 0, limit: int | None = None, counted: bool = True
    ) -> bool:
        """Could `req` (reservation set) start now, the weight never over `limit` (default: its budget)?"""
        chunk = req.prefill_left if chunk is None else chunk
        limit = admission.candidate_budget(self, req)[1] if limit is None else limit
        ok, fast = self.policy.fits(self, req, chunk, ahead, limit)
        if counted:
            st = self.stats
            if fast:
                st.admitted_fast += 1
            elif ok:
                st.admitted_projected += 1
            else:
                st.rejected_projected += 1
        return ok

    def profile(self) -> TokenProfile | PaddedProfile:
        """The running set's projection, prefilling entries refreshed first (their anchors recharged)."""
        proj = self.projector
        if proj.stale:
            for rid, old in proj.refresh_prefilling(self.step):
                self._moved(rid, old)
        return proj.profile()
