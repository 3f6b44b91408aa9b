"""The batcher: who runs next, decided once per engine step.

Each step `schedule(now)` returns a StepPlan (prompt chunks to prefill, sequences to decode,
requests admitted or preempted); the engine runs it and reports back with `complete(plan)`,
then `finish(id)` for every request that ended (EOS, stop sequence, length).

Admission walks the waiting queue by priority class (higher first), in arrival order within a class,
and admits a candidate only if the projected weight of the running requests plus the candidate stays
within max_batch_weight at every future step (see projection.py). Candidates that pass the naive
test — the sum of everyone's final weight fits — skip the projection. A later request of the same
class may jump one that does not fit, but only if it arrived within jump_window_s after it, and never
once that one has waited max_wait_s; a lower class never jumps a higher one. Nothing starves: a
request that has waited max_wait_s ranks with the top class. Classes below headroom_priority may
not take the last priority_headroom of the budget, so a higher-class request starts at once.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from .accounting import Accounting
from .blocks import BlockLedger
from .config import BatcherConfig
from .estimator import OutputLengthEstimator
from .fairness import TenantShares
from .prefix import SharedBlocks
from .projection import Entry, PaddedProfile, TokenProfile
from .request import TOP_PRIORITY, Request, RequestRejected
from .reservations import Reservations
from .weight import weight_model


@dataclass(slots=True)
class StepPlan:
    """What the engine runs this step; chunks and decodes are in admission order."""

    step: int
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + len(self.decode)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


@dataclass(slots=True)
class BatcherStats:
    admitted: int = 0
    admitted_fast: int = 0
    admitted_projected: int = 0
    rejected_projected: int = 0
    preemptions: int = 0
    preempted_tokens: int = 0
    idle_passes: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # context tokens of every admission (readmissions too)
    cached_tokens: int = 0  # of those, found in the prefix cache instead of computed


class Batcher(Accounting):
    """Weight-aware admission over one waiting queue and one running set."""

    REFRESH_EVERY = 16  # predictive mode: refresh the length estimate after this many finishes (or steps)
    # predictive mode: while recomputed (preempted) tokens stay under this share of the generated ones, a
    # preemption leaves the estimator's margin alone; past it, every preemption widens the margin
    PREEMPT_SHARE = 0.02
    REBUILD_AFTER = 32  # more entry changes than this before a decision: rebuild the profile instead

    def __init__(self, config: BatcherConfig) -> None:
        self.config = cfg = config.resolved()
        self.budget: int = cfg.max_batch_weight  # type: ignore[assignment]
        self.weight = weight_model(cfg.weight_model, cfg.block_size, cfg.kinds)
        self.estimator = (
            OutputLengthEstimator(cfg.predictive_margin, cfg.predictive_min_samples, cfg.predictive_window)
            if cfg.mode == "predictive"
            else None
        )
        self.waiting: list[Request] = []  # arrival order
        self.running: dict[str, Request] = {}  # admission order
        self.step = 0  # steps completed
        self.stats = BatcherStats()
        # queue sort key of every known request: (-class, arrival, sequence); aging raises the class
        self._order: dict[str, tuple[int, float, int]] = {}
        self._classes: set[int] = set()  # priorities ever submitted (one: no aging pass needed)
        self._headroom = int(cfg.priority_headroom * self.budget)
        self._seq = 0
        self._committed = 0  # sum of reserved final weights (token model)
        self._typical = 0  # moving average of admitted requests' reserved weight
        self.reservations = Reservations(self.estimator, cfg.max_preemptions)
        self._admit_budget = self.budget  # the budget less the predictive margin, for this step's admissions
        self._profile: TokenProfile | PaddedProfile = self.weight.profile([])
        self._entries: dict[str, Entry] = {}  # each running request's entry, as the profile has it or will
        self._changes: list[tuple[Entry, int]] | None = []  # for the profile to add (1) or remove (-1); None: rebuild
        self._prefilling: dict[str, Request] = {}  # running requests not decoding yet, in admission order
        self._stale = False  # the prefilling requests' entries must be recomputed before the next decision
        self._idle = False  # the last pass admitted nothing and nothing has changed since
        # paged memory: the block ledger (token model) and the cached blocks held by running requests
        self.ledger = (
            BlockLedger(self.budget // cfg.block_size, cfg.block_size, caching=cfg.prefix_caching)
            if cfg.weight_model == "token"
            else None
        )
        self.shared = SharedBlocks()
        self._shared_entries: dict[str, Entry] = {}  # each anchor's entry for the cached blocks charged to it
        # prefix cache with window kinds: their windows (in tokens), and pages pinned this step for copies
        self._windows_len = tuple(cfg.windows)
        self._pinned = 0
        self.tenants = TenantShares()  # fairness between tenants within a class

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
        alone = self.weight.seq(req.max_total)
        if alone > self.budget:
            raise RequestRejected(
                "max_new_tokens",
                f"worst-case weight {alone} (input_len {req.input_len} + max_new_tokens "
                f"{req.max_new_tokens}) exceeds max_batch_weight {self.budget}",
            )
        if req.id in self._order:
            raise RequestRejected("id", f"request id {req.id!r} is already queued or running")
        if not 0 <= req.priority <= TOP_PRIORITY:
            raise RequestRejected("priority", f"must be an integer in [0, {TOP_PRIORITY}] (got {req.priority})")

    def submit(self, req: Request) -> None:
        self.check(req)
        self.tenants.arrive(req.tenant)
        self._order[req.id] = (-req.priority, req.arrival_s, self._seq)
        self._classes.add(req.priority)
        self._seq += 1
        self._enqueue(req)

    def cancel(self, request_id: str) -> Request | None:
        """Drop a waiting or running request; its reservation is freed before the next step."""
        req = self.running.pop(request_id, None)
        if req is not None:
            self._release(req)
        else:
            for i, r in enumerate(self.waiting):
                if r.id == request_id:
                    req = self.waiting.pop(i)
                    break
        if req is not None:
            del self._order[req.id]
            self.tenants.leave(req.tenant)
            self._idle = False
        return req

    def requeue(self, request_id: str) -> Request:
        """Send a running request back to the queue, to be prefilled again (its KV cannot be trusted:
        a failed step that may have written part of a window's ring)."""
        req = self.running[request_id]
        self._preempt(req)
        return req

    def finish(self, request_id: str) -> Request:
        """A running request ended (EOS, stop sequence or length); its blocks are free."""
        req = self.running.pop(request_id)
        self._release(req)
        del self._order[req.id]
        self.tenants.leave(req.tenant)
        if self.estimator is not None and not req.runs_to_max:
            self.estimator.observe(req.generated)
            self.estimator.relax()
        self._idle = False
        return req

    # ----- the step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(self.step)
        est = self.estimator
        if est is not None and self.running:
            if est.pending >= self.REFRESH_EVERY or (est.pending and not self.step % self.REFRESH_EVERY):
                est.refresh([r.generated for r in self.running.values() if not r.runs_to_max])
            plan.preempted = self._regrow()
        prefill_state = self._running_work(plan)
        if len(self._classes) > 1 and self.waiting and self._age(now):
            self._idle = False  # a request moved up: the queue deserves a real pass
        if self.waiting and not self._idle:
            self._admit(now, plan, prefill_state)
        elif self.waiting:
            self.stats.idle_passes += 1
        if self.weight.windows and self.ledger is not None and self.ledger.caching and plan.prefill:
            self._take_snapshots(plan)
        return plan

    def complete(self, plan: StepPlan) -> list[Request]:
        """Advance every request of the plan by its step; returns those that emitted a token."""
        self.step += 1
        if self.weight.windows and self.ledger is not None and self.ledger.caching:
            self._settle(plan)
        emitted: list[Request] = []
        running = self.running
        for req, n in plan.prefill:
            if running.get(req.id) is not req:
                continue  # cancelled or preempted while the step ran
            req.prefilled += n
            if req.prefilled == req.context_len:
                req.generated += 1
                req.decoding = True
                emitted.append(req)
                del self._prefilling[req.id]
                self._set_entry(req.id, self._decoding_entry(req))  # a chunked prompt's projection tightens
                self._running_changed()
        for req in plan.decode:
            if running.get(req.id) is not req:
                continue
            req.prefilled += 1
            req.generated += 1
            emitted.append(req)
        self.stats.generated_tokens += len(emitted)
        if self.config.fairness and self.tenants.contended:
            self.tenants.charge(running.values(), self._held)
        return emitted

    def _held(self, req: Request) -> int:
        """The weight a running request holds now (what its tenant pays per step)."""
        return self.weight.own(req.context_len, req.shared)

    # ----- internals ----------------------------------------------------------------------------
    def _enqueue(self, req: Request) -> None:
        key = self._order[req.id]
        w = self.waiting
        if not w or self._order[w[-1].id] <= key:
            w.append(req)
        else:
            w.insert(bisect_right(w, key, key=lambda r: self._order[r.id]), req)
        self._idle = False

    def _running_work(self, plan: StepPlan) -> list[int]:
        """Decode every decoding request; give continuing prompt chunks the prefill cap first (FIFO)."""
        cap = self.config.max_prefill_weight
        count = longest = total = 0
        ledger = self.ledger
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
                        self._grow(req, req.prefilled + 1)
                continue
            n = req.prefill_left
            if cap:
                n = min(n, cap - total)
            if n > 0:
                plan.prefill.append((req, n))
                count, longest, total = count + 1, max(longest, n), total + n
                self._allocate(req, req.prefilled + n)
        return [count, longest, total]

    def _naive_fits(self, final: int, fixed_len: int = 0) -> bool:
        """The fast path: does the sum of every final weight, the candidate's included, fit?"""
        if self.weight.name == "token":
            held = self.shared.held * self.weight.block_size
            return self._committed + held + self.weight.seq(final) <= self._admit_budget
        running = self.running.values()
        fixed = max((r.fixed_len for r in running), default=0)
        rest = max((r.reserved_total - r.fixed_len for r in running), default=0)
        return (len(running) + 1) * (max(fixed, fixed_len) + max(rest, final - fixed_len)) <= self._admit_budget

    def fits(self, req: Request, chunk: int | None = None, ahead: int = 0) -> bool:
        """Could `req` (reservation set) be admitted now without the weight ever exceeding the budget?"""
        if req.shared:
            return self._fits_sharing(req, req.prefill_left if chunk is None else chunk, ahead)
        if self._naive_fits(req.reserved_total, req.fixed_len):
            self.stats.admitted_fast += 1
            return True
        entry = self._entry(req, req.prefill_left if chunk is None else chunk, ahead)
        if self._get_profile().admits(entry, self._admit_budget):
            self.stats.admitted_projected += 1
            return True
        self.stats.rejected_projected += 1
        return False

    def _age(self, now: float) -> bool:
        """A request that has waited max_wait_s ranks with the top class from now on: nothing starves.
        True when one moved up."""
        cut = now - self.config.max_wait_s
        order, aged = self._order, False
        for r in self.waiting:
            rank, arrival, seq = order[r.id]
            if rank > -TOP_PRIORITY and arrival <= cut:
                order[r.id] = (-TOP_PRIORITY, arrival, seq)
                aged = True
        if aged:
            self.waiting.sort(key=lambda r: order[r.id])
        return aged

    def _admit(self, now: float, plan: StepPlan, prefill_state: list[int]) -> None:
        cfg = self.config
        order = self._order
        size_cap = cfg.max_batch_size
        count, longest, total = prefill_state
        ahead = sum(r.prefill_left for r in self.running.values() if not r.decoding) - total
        first_blocked: Request | None = None
        first_idx = 0
        taken: list[int] = []
        refused: list[tuple[int, int, int, int]] = []
        tenants = self.tenants
        fair = cfg.fairness and tenants.contended
        candidates = (
            tenants.order(self.waiting, lambda r: order[r.id][0], self._held) if fair else enumerate(self.waiting)
        )
        evicted: list[Request] = []  # preempted for a tenant below its share: back to the queue below
        capped: set[str] = set()  # tenants that admit nothing more in this pass (their cap, a jump rule)
        blocked: dict[str, Request] = {}  # each tenant's first request that did not fit in this pass
        for scanned, (idx, cand) in enumerate(candidates):
            if size_cap and len(self.running) >= size_cap:
                break
            if cand.tenant in capped or (
                cfg.tenant_cap and fair and tenants.weight[cand.tenant] >= cfg.tenant_cap * self.budget
            ):
                continue  # its tenant has its share: the others' requests may still start
            if first_blocked is not None and (
                scanned - first_idx > cfg.jump_scan
                or order[cand.id][0] != order[first_blocked.id][0]  # a lower class never jumps a higher one
            ):
                break
            # the jump rules hold in arrival order: within a tenant when fairness orders the tenants
            mine_blocked = blocked.get(cand.tenant if fair else "")
            if mine_blocked is not None and (
                cfg.jump_window_s <= 0
                or cand.arrival_s - mine_blocked.arrival_s > cfg.jump_window_s
                or now - mine_blocked.arrival_s > cfg.max_wait_s
            ):
                if not fair:
                    break
                capped.add(cand.tenant)  # nothing more of this tenant jumps its blocked request
                continue
            hits = self._lookup(cand)
            p = cand.prefill_left
            chunk = self._prefill_chunk(p, count, longest, total)
            if chunk == 0:
                self._unlookup(cand)
                break  # this step's prefill budget is spent
            if chunk is None:  # a prompt over the cap runs only when prefilled alone
                self._unlookup(cand)
                blocked.setdefault(cand.tenant if fair else "", cand)
                if first_blocked is None:
                    first_blocked, first_idx = cand, scanned
                continue
            res = self.reservations
            cand.reserved_new = res.reserve(cand)
            # alone, a request always fits: its worst case does (check); no margin or headroom then
            budget = self.budget
            if self.running:
                if self.estimator is not None:
                    budget -= res.margin(res.variance(cand))
                if -order[cand.id][0] < cfg.headroom_priority:
                    budget -= self._headroom
            # pages pinned this step for a hit's copies are held until the step runs: room no one else has
            self._admit_budget = budget - self._pinned * self.weight.block_size
            ctx, res, fix = cand.context_len, cand.reserved_new, cand.fixed_len
            # A candidate at least as long in context, reservation and fixed part (and in the rest) as
            # one refused in this pass is refused too (it weighs at least as much at every step).
            # (Not for a candidate with cached blocks: they weigh less than their length.)
            dominated = not hits and any(
                c <= ctx and r <= res and f <= fix and c - f <= ctx - fix and b >= budget for c, r, f, b in refused
            )
            if not dominated and fair and cfg.fair_preemption and not self._fits_quietly(cand, chunk, ahead):
                self._make_room(cand, chunk, ahead, plan, evicted)
            if dominated or not self.fits(cand, chunk, ahead):
                self._unlookup(cand)
                if not dominated and not hits and len(refused) < 16:
                    refused.append((ctx, res, fix, budget))
                blocked.setdefault(cand.tenant if fair else "", cand)
                if first_blocked is None:
                    first_blocked, first_idx = cand, scanned
                continue
            mine = tenants.weight[cand.tenant]
            if cfg.tenant_cap and fair and mine and mine + self._own_final(cand) > cfg.tenant_cap * self.budget:
                self._unlookup(cand)
                capped.add(cand.tenant)  # its later requests wait behind this one (its own order is kept)
                continue  # past its tenant's share (one request always may run): wait, holding no one back
            taken.append(idx)
            self._start(cand, chunk, ahead)
            if fair:
                tenants.counter[cand.tenant] += self._held(cand)  # its prompt is service too
            plan.admitted.append(cand)
            plan.prefill.append((cand, chunk))
            self._allocate(cand, cand.prefilled + chunk)
            count, longest, total = count + 1, max(longest, chunk), total + chunk
            ahead += p - chunk
        if taken:
            drop = set(taken)
            self.waiting = [r for i, r in enumerate(self.waiting) if i not in drop]
        else:
            self._idle = True
        for req in evicted:
            self._enqueue(req)

    def _fits_quietly(self, req: Request, chunk: int, ahead: int) -> bool:
        """fits() without counting it in the statistics (a check before making room)."""
        stats = (self.stats.admitted_fast, self.stats.admitted_projected, self.stats.rejected_projected)
        ok = self.fits(req, chunk, ahead)
        self.stats.admitted_fast, self.stats.admitted_projected, self.stats.rejected_projected = stats
        return ok

    def _make_room(self, cand: Request, chunk: int, ahead: int, plan: StepPlan, evicted: list[Request]) -> None:
        """`cand`'s tenant holds less than its fair share of the budget (an equal share among the
        tenants with requests): preempt the newest requests of the tenants holding the most, the fewest
        with which the projection admits `cand`, never leaving a victim's tenant holding less than
        `cand`'s would (no swap between equals: two busy tenants never preempt each other back and
        forth); or none, when no such set makes room."""
        held, tenants = self.tenants.weight, self.tenants
        mine = held[cand.tenant] + self._own_final(cand)
        if mine > self.budget / len(tenants.held):
            return
        pool = [
            r
            for r in self.running.values()
            if r.tenant != cand.tenant
            and r.preemptions < self.config.max_preemptions
            and not r.shared
            and r.admitted_step < self.step
        ]
        pool.sort(key=lambda r: (held[r.tenant], r.admitted_step), reverse=True)
        self._get_profile()  # entries brought up to date
        entries = dict(self._entries)
        entry = self._entry(cand, chunk, ahead)
        left = dict(held)
        victims: list[Request] = []
        for r in pool:
            own = self._own_final(r)
            if left[r.tenant] - own < mine:
                continue
            left[r.tenant] -= own
            victims.append(r)
            del entries[r.id]
            if self.weight.profile([*entries.values(), *self._shared_entries.values()]).admits(
                entry, self._admit_budget
            ):
                break
        else:
            return
        gone = {r.id for r in victims}
        plan.prefill[:] = [(r, n) for r, n in plan.prefill if r.id not in gone]
        plan.decode[:] = [r for r in plan.decode if r.id not in gone]
        for r in victims:
            self._preempt(r, enqueue=False)
            plan.preempted.append(r)
            evicted.append(r)

    def _prefill_chunk(self, prompt: int, count: int, longest: int, total: int) -> int | None:
        """Tokens of `prompt` to prefill this step given the chunks already planned: the whole prompt
        when it fits the cap, a chunk of what is left (chunked prefill), 0 when nothing is left, or
        None when the prompt must wait to be prefilled alone."""
        cap = self.config.max_prefill_weight
        w = self.weight
        if not cap or w.prefill(count + 1, max(longest, prompt), total + prompt) <= cap:
            return prompt
        if w.name == "token" and total >= cap:
            return 0
        if self.config.chunked_prefill and w.name == "token":
            return cap - total
        return None if count else prompt

    def _start(self, req: Request, chunk: int, ahead: int) -> None:
        """Admit `req`, whose first `shared` blocks were found in the prefix cache (prefilled: skipped)."""
        req.admitted_step = self.step
        req.decoding = False
        self.running[req.id] = req
        w = self._own_final(req)
        self._committed += w
        self.tenants.weight[req.tenant] += w
        self.stats.prompt_tokens += req.context_len
        self.stats.cached_tokens += req.prefilled
        if not req.preemptions:
            req.cached = req.prefilled
        self._set_entry(req.id, self._entry(req, chunk, ahead))  # its cached blocks' charge needs its finish
        if req.shared:
            keys = req.prefix[: req.shared]
            self.ledger.hold(req.block_table, keys)  # type: ignore[union-attr]
            self._sync_shared(self.shared.join(req.id, keys, self._finish_of))
        self._typical = w if not self._typical else (7 * self._typical + w) // 8
        self.reservations.track(req)
        self._prefilling[req.id] = req
        self._running_changed()
        self.stats.admitted += 1
