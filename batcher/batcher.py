"""The batcher: who runs next, decided once per engine step.

Each step `schedule(now)` returns a StepPlan (prompt chunks to prefill, sequences to decode,
requests admitted or preempted); the engine runs it and reports back with `complete(plan)`,
then `finish(id)` for every request that ended (EOS, stop sequence, length).

The Batcher owns the queue and the running set and composes one piece per concern: `Admission`
(admission.py: the walk over the queue), `Projector` (projector.py: the running set's projection and
reserved weights), `Paging` (paging.py: blocks, rings and the prefix cache), `TenantShares`
(fairness.py) and the preemption rules (preemption.py). Nothing starves: a request that has waited
max_wait_s ranks with the top class.
"""

from __future__ import annotations

from bisect import bisect_right

from .adapters import AdapterSlots
from .admission import Admission
from .config import BatcherConfig
from .estimator import OutputLengthEstimator
from .fairness import TenantShares
from .paging import Paging
from .plan import BatcherStats, StepPlan
from .preemption import preempt, regrow
from .projector import Projector
from .request import TOP_PRIORITY, Request, RequestRejected
from .reservations import Reservations
from .weight import weight_model


class Batcher:
    """Weight-aware admission over one waiting queue and one running set."""

    REFRESH_EVERY = 16  # predictive mode: refresh the length estimate after this many finishes (or steps)

    def __init__(self, config: BatcherConfig) -> None:
        self.config = cfg = config.resolved()
        self.budget: int = cfg.max_batch_weight  # type: ignore[assignment]
        self.weight = weight_model(cfg.weight_model, cfg.block_size, cfg.kinds)
        predictive = (cfg.predictive_margin, cfg.predictive_min_samples, cfg.predictive_window)
        self.estimator = OutputLengthEstimator(*predictive) if cfg.mode == "predictive" else None
        self.waiting: list[Request] = []  # by class, then arrival
        self.running: dict[str, Request] = {}  # admission order
        self.step = 0  # steps completed
        self.stats = BatcherStats()
        # queue sort key of every known request: (-class, arrival, sequence); aging raises the class
        self.order: dict[str, tuple[int, float, int]] = {}
        self._classes: set[int] = set()  # priorities ever submitted (one: no aging pass needed)
        self.headroom = int(cfg.priority_headroom * self.budget)
        self._seq = 0
        self.reservations = Reservations(self.estimator, cfg.max_preemptions)
        self.idle = False  # the last pass admitted nothing and nothing has changed since
        self.tenants = TenantShares()  # fairness between tenants within a class
        self.projector = Projector(self)
        self.paging = Paging(self)
        self.ledger = self.paging.ledger  # the paged runner's pages (None for the padded weight)
        self.admission = Admission(self)
        self.adapters = AdapterSlots()  # LoRA adapters' slots (adapters.py); the engine sets slot_weight

    # ----- queue operations -------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Reject a request that could never run; the error names the field and the limit."""
        cfg = self.config
        if req.input_len < 1:
            raise RequestRejected("input_len", f"must be >= 1 (got {req.input_len})")
        if req.max_new_tokens < 1:
            raise RequestRejected("max_new_tokens", f"must be >= 1 (got {req.max_new_tokens})")
        if req.max_total > cfg.max_total_tokens:
            raise RequestRejected(
                "max_new_tokens",
                f"input_len {req.input_len} + max_new_tokens {req.max_new_tokens} = {req.max_total} "
                f"exceeds max_total_tokens {cfg.max_total_tokens}",
            )
        if req.adapter:
            self.adapters.check(req.adapter)
        alone = self.weight.seq(req.max_total)
        if alone > self.budget:
            raise RequestRejected(
                "max_new_tokens",
                f"worst-case weight {alone} (input_len {req.input_len} + max_new_tokens "
                f"{req.max_new_tokens}) exceeds max_batch_weight {self.budget}",
            )
        if req.id in self.order:
            raise RequestRejected("id", f"request id {req.id!r} is already queued or running")
        if not 0 <= req.priority <= TOP_PRIORITY:
            raise RequestRejected("priority", f"must be an integer in [0, {TOP_PRIORITY}] (got {req.priority})")

    def submit(self, req: Request) -> None:
        self.check(req)
        self.tenants.arrive(req.tenant)
        since = req.arrival_s if req.submitted_s is None else req.submitted_s
        self.order[req.id] = (-req.priority, since, self._seq)
        self._classes.add(req.priority)
        self._seq += 1
        self.enqueue(req)

    def cancel(self, request_id: str) -> Request | None:
        """Drop a waiting or running request; its reservation is freed before the next step."""
        req = self.running.pop(request_id, None)
        if req is not None:
            self.release(req)
        else:
            for i, r in enumerate(self.waiting):
                if r.id == request_id:
                    req = self.waiting.pop(i)
                    break
        if req is not None:
            del self.order[req.id]
            self.tenants.leave(req.tenant)
            self.idle = False
        return req

    def requeue(self, request_id: str) -> Request:
        """Send a running request back to the queue, to be prefilled again (its KV cannot be trusted:
        a failed step that may have written part of a window's ring)."""
        req = self.running[request_id]
        preempt(self, req)
        return req

    def finish(self, request_id: str) -> Request:
        """A running request ended (EOS, stop sequence or length); its blocks are free."""
        req = self.running.pop(request_id)
        self.release(req)
        del self.order[req.id]
        self.tenants.leave(req.tenant)
        self.stats.finish(req.generated)
        if self.estimator is not None and not req.runs_to_max:
            self.estimator.observe(req.generated)
            self.estimator.relax()
        self.idle = False
        return req

    # ----- the step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(self.step)
        est = self.estimator
        if est is not None and self.running:
            if est.pending >= self.REFRESH_EVERY or (est.pending and not self.step % self.REFRESH_EVERY):
                est.refresh([r.generated for r in self.running.values() if not r.runs_to_max])
            plan.preempted = regrow(self)
        prefill_state = self._running_work(plan)
        if len(self._classes) > 1 and self.waiting and self.admission.age(now):
            self.idle = False  # a request moved up: the queue deserves a real pass
        if self.waiting and not self.idle:
            self.admission.admit(now, plan, prefill_state)
        elif self.waiting:
            self.stats.idle_passes += 1
        if self.weight.windows and self.ledger is not None and self.ledger.caching and plan.prefill:
            self.paging.take_snapshots(plan)
        return plan

    def complete(self, plan: StepPlan) -> list[Request]:
        """Advance every request of the plan by its step; returns those that emitted a token."""
        self.step += 1
        if self.weight.windows and self.ledger is not None and self.ledger.caching:
            self.paging.settle(plan)
        emitted: list[Request] = []
        running, proj = self.running, self.projector
        for req, n in plan.prefill:
            if running.get(req.id) is not req:
                continue  # cancelled or preempted while the step ran
            req.prefilled += n
            if req.prefilled == req.context_len:
                req.generated += 1
                req.decoding = True
                emitted.append(req)
                del proj.prefilling[req.id]
                proj.set_entry(req.id, proj.decoding_entry(req))  # a chunked prompt's projection tightens
                self.running_changed()
        for req in plan.decode:
            if running.get(req.id) is not req:
                continue
            req.prefilled += 1
            req.generated += 1
            emitted.append(req)
        self.stats.generated_tokens += len(emitted)
        if self.config.fairness and self.tenants.contended:
            self.tenants.charge(running.values(), self.held)
        return emitted

    # ----- the running set ------------------------------------------------------------------------
    def start(self, req: Request, chunk: int, ahead: int) -> None:
        """Admit `req`, whose first `shared` blocks were found in the prefix cache (prefilled: skipped)."""
        req.admitted_step = self.step
        req.decoding = False
        self.running[req.id] = req
        self.tenants.weight[req.tenant] += self.projector.start(req, chunk, ahead)
        self.budget -= self.adapters.acquire(req.adapter, self.step)  # a new slot for its adapter
        self.stats.prompt_tokens += req.context_len
        self.stats.cached_tokens += req.prefilled
        if not req.preemptions:
            req.cached = req.prefilled
        if req.shared:
            self.paging.hold(req)
        self.reservations.track(req)
        self.running_changed()
        self.stats.admitted += 1

    def release(self, req: Request) -> None:
        """`req` left the running set (finished, cancelled, preempted): its weight and pages are free."""
        self.tenants.weight[req.tenant] -= self.projector.stop(req)
        self.reservations.forget(req.id)
        self.adapters.release(req.adapter)
        self.paging.leave(req)
        self.running_changed()

    def running_changed(self) -> None:
        """The running set or a reservation changed: prefilling requests' entries (which depend on the
        step and on the chunks ahead of them) are recomputed before the next decision, and the queue
        gets a real pass."""
        self.projector.stale = True
        self.idle = False

    def held(self, req: Request) -> int:
        """The weight a running request holds now (what its tenant pays per step)."""
        return self.weight.own(req.context_len, req.shared)

    def enqueue(self, req: Request) -> None:
        key = self.order[req.id]
        w = self.waiting
        if not w or self.order[w[-1].id] <= key:
            w.append(req)
        else:
            w.insert(bisect_right(w, key, key=lambda r: self.order[r.id]), req)
        self.idle = False

    def _running_work(self, plan: StepPlan) -> list[int]:
        """Decode every decoding request; give continuing prompt chunks the prefill cap first (FIFO)."""
        cap = self.config.max_prefill_weight
        count = longest = total = 0
        ledger, paging = self.ledger, self.paging
        span = ledger.block_size if ledger is not None else 0
        uniform = self.weight.name != "token" or self.weight.uniform
        full = uniform or self.weight.full_pages
        for req in self.running.values():
            if req.decoding:
                if req.generated >= req.max_new_tokens:
                    raise RuntimeError(f"request {req.id} reached max_new_tokens but was not finished")
                plan.decode.append(req)
                # its next token starts a block (a model without full layers has no block table to tell)
                if ledger is not None and (
                    req.prefilled >= len(req.block_table) * span if full else req.prefilled % span == 0
                ):
                    if uniform:
                        ledger.grow(req.block_table, req.prefilled + 1)
                    else:
                        paging.grow(req, req.prefilled + 1)
                continue
            n = req.prefill_left
            if cap:
                n = min(n, cap - total)
            if n > 0:
                plan.prefill.append((req, n))
                count, longest, total = count + 1, max(longest, n), total + n
                paging.allocate(req, req.prefilled + n)
        return [count, longest, total]

    # ----- weights ------------------------------------------------------------------------------------
    def fits(self, req: Request, chunk: int | None = None, ahead: int = 0) -> bool:
        """Could `req` (reservation set) be admitted now without the weight ever exceeding the budget?"""
        return self.admission.fits(req, chunk, ahead)

    def batch_weight(self) -> int:
        """The weight the running requests hold now (their tokens so far, whole prompts included)."""
        return self.weight_with(0)

    def weight_with(self, more: int) -> int:
        return self.projector.weight_with(more)

    def room_for(self) -> int:
        return self.projector.room_for()

    def projected_peak(self) -> int:
        return self.projector.profile().peak() if self.running else 0

    def check_memory(self) -> None:
        """Invariants (tests): see Paging.check."""
        self.paging.check()
