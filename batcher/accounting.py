"""The batcher's accounting of its running set: each request's projection entry, the profile built
from them, and paged memory (blocks from the ledger, cached prefix blocks charged once to their
longest-lived holder), and predictive mode's growing reservations and preemption. A mixin of Batcher
(admission.py), which owns the state it reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .projection import Entry, PaddedProfile, TokenProfile
from .request import Request

if TYPE_CHECKING:
    from .blocks import BlockLedger
    from .config import BatcherConfig
    from .estimator import OutputLengthEstimator
    from .fairness import TenantShares
    from .prefix import SharedBlocks
    from .reservations import Reservations
    from .weight import PaddedWeight, TokenWeight


def snap_key(key: bytes, kind: int, column: int) -> bytes:
    """The cache key of a window kind's copy of the block `key` names (one page per column)."""
    return key + bytes((kind, column))


class Accounting:
    config: BatcherConfig
    weight: TokenWeight | PaddedWeight
    step: int
    running: dict[str, Request]
    reservations: Reservations
    ledger: BlockLedger | None
    shared: SharedBlocks
    stats: object
    _admit_budget: int
    _committed: int
    _profile: TokenProfile | PaddedProfile
    _entries: dict[str, Entry]
    _shared_entries: dict[str, Entry]
    _changes: list[tuple[Entry, int]] | None
    _prefilling: dict[str, Request]
    _stale: bool
    REBUILD_AFTER: int

    _typical: int
    tenants: TenantShares
    _pinned: int
    _windows_len: tuple[int, ...]
    _idle: bool
    _order: dict[str, tuple[int, float, int]]
    estimator: OutputLengthEstimator | None
    PREEMPT_SHARE: float
    waiting: list[Request]

    # ----- weights ----------------------------------------------------------------------------------
    def batch_weight(self) -> int:
        """The weight the running requests hold now (their tokens so far, whole prompts included)."""
        return self._weight_with(0)

    def _weight_with(self, more: int) -> int:
        """The running requests' weight with `more` tokens each."""
        running, w = self.running.values(), self.weight
        if w.name == "token" and not w.uniform:
            return sum(w.own(r.context_len + more, r.shared) for r in running) + self.shared.held * w.block_size
        b = w.block_size
        own = [r.context_len + more - r.shared * b for r in running]
        return w.batch(own, [r.fixed_len for r in running]) + self.shared.held * b

    def room_for(self) -> int:
        """How many more requests of the typical size (recent admissions' reserved weight) would fit
        by the naive sum after everything already waiting (at its worst case) is admitted: what a
        worker may take from a shared queue without hoarding. Waiting work counts, not blocks:
        requests held back only by the prefill cap start within a few steps."""
        typical = self._typical or self.weight.seq(self.config.max_total_tokens)
        pending = sum(self.weight.seq(r.max_total) for r in self.waiting)
        held = self.shared.held * self.weight.block_size
        return max(0, (self.budget - self._committed - held - pending) // typical)

    def projected_peak(self) -> int:
        return self._get_profile().peak() if self.running else 0

    def _next_weight(self) -> int:
        """The weight after the next step if every running request emits a token (a prefilling one
        emits with its last chunk, so it is counted as growing too: conservative by at most a block)."""
        return self._weight_with(1)

    def _running_changed(self) -> None:
        """The running set or a reservation changed: prefilling requests' entries (which depend on the
        step and on the chunks ahead of them) are recomputed before the next decision, and the queue
        gets a real pass."""
        self._stale = True
        self._idle = False

    # ----- projection entries ---------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        own = self._own_final(req)
        self._committed -= own
        self.tenants.weight[req.tenant] -= own
        self.reservations.forget(req.id)
        self._prefilling.pop(req.id, None)
        if req.shared:
            changed, _freed = self.shared.leave(req.id, self._finish_of)
            self._set_shared_entry(req.id, None)
            self._sync_shared(changed)
        self._set_entry(req.id, None)
        if self.ledger is not None:
            self.ledger.release(req.block_table)
            for ring in req.rings:
                self.ledger.release(ring)
        req.shared = 0
        self._running_changed()

    def _own_final(self, req: Request) -> int:
        """The weight a request reserves for itself: its final length less the cached blocks it holds."""
        return self.weight.own(req.reserved_total, req.shared)

    def _finish_of(self, request_id: str) -> int:
        return self._entries[request_id].finish

    def _entry(self, req: Request, chunk: int, ahead: int) -> Entry:
        """Projection entry for `req`, which feeds `chunk` tokens this step with `ahead` prompt
        tokens of earlier requests still to prefill after this step."""
        remaining = req.reserved_new - req.generated
        rest = req.prefill_left - chunk
        shared = req.shared * self.weight.block_size  # cached blocks are charged apart (prefix.py)
        offset, final = req.context_len - self.step - shared, req.reserved_total - shared
        if rest <= 0:
            return Entry(self.step + remaining, offset, final, True, req.fixed_len, shared)
        cap = self.config.max_prefill_weight
        delay = -(-(ahead + rest) // cap)  # FIFO: every later step gives earlier prompts the full cap
        return Entry(self.step + delay + remaining, offset, final, False, req.fixed_len, shared)

    def _decoding_entry(self, req: Request) -> Entry:
        """A decoding request's entry: the same at every step (absolute steps) until its reservation changes."""
        shared = req.shared * self.weight.block_size
        inp = req.input_len - shared
        gen, res, step = req.generated, req.reserved_new, self.step
        return Entry(step + res - gen, inp + gen - step, inp + res, True, req.fixed_len, shared)

    def _set_entry(self, request_id: str, entry: Entry | None) -> None:
        """Record a running request's entry (None: it left); the profile takes the change in when next used.
        A holder of cached blocks whose finish moves takes or gives up the blocks it outlives or no longer does."""
        old = self._change(self._entries, request_id, entry)
        if old is not None and entry is not None and old.finish != entry.finish and request_id in self.shared.keys:
            self._sync_shared(self.shared.refinish(request_id, old.finish, self._finish_of) | {request_id})

    def _change(self, entries: dict[str, Entry], key: str, entry: Entry | None) -> Entry | None:
        old = entries.pop(key, None)
        if entry is not None:
            entries[key] = entry
        changes = self._changes
        if entry == old or changes is None:
            return old
        if old is not None:
            changes.append((old, -1))
        if entry is not None:
            changes.append((entry, 1))
        if len(changes) > self.REBUILD_AFTER:
            self._changes = None  # one rebuild is cheaper than applying this many
        return old

    def _refresh_prefilling(self) -> None:
        """Entries of requests still prefilling, from this step's chunks (assigned as in _running_work)."""
        cap = self.config.max_prefill_weight
        left, ahead = cap, 0
        for req in self._prefilling.values():
            chunk = req.prefill_left
            if cap:
                chunk = min(chunk, left)
                left -= chunk
            self._set_entry(req.id, self._entry(req, chunk, ahead))
            ahead += req.prefill_left - chunk
        self._stale = False

    def _get_profile(self) -> TokenProfile | PaddedProfile:
        """The running set's profile, brought up to date: each entry change since the last use is applied
        in place (O(running) each), or, after many of them, the profile is rebuilt."""
        if self._stale:
            self._refresh_prefilling()
        if self._changes is None:
            self._profile = self.weight.profile([*self._entries.values(), *self._shared_entries.values()])
            self._changes = []
        for entry, sign in self._changes:
            if sign > 0:
                self._profile.add(entry)
            else:
                self._profile.remove(entry)
        self._changes.clear()
        return self._profile

    # ----- paged memory: blocks and the prefix cache ------------------------------------------------

    def _allocate(self, req: Request, tokens: int) -> None:
        """Blocks for a prompt chunk that ends at `tokens`; the prompt blocks it fills join the prefix
        cache. Keyed the moment they are handed out: a request admitted later in this same step finds
        them, and reads their KV after this step's writes (attention writes a layer's K/V first)."""
        ledger = self.ledger
        if ledger is None:
            return
        self._grow(req, tokens)
        full = min(len(req.prefix), tokens // ledger.block_size)
        first = i = req.shared
        while i < full and ledger.register(req.block_table[i], req.prefix[i]):
            i += 1
        if i > first:  # its own blocks become cached blocks it holds (and is charged for while it lives)
            self._committed -= (i - first) * ledger.block_size
            req.shared = i
            self._sync_shared(self.shared.join(req.id, req.prefix[first:i], self._finish_of))
            self._running_changed()

    def _grow(self, req: Request, tokens: int) -> None:
        """Pages for `tokens` tokens of `req`: its full kind's blocks and its rings' units."""
        ledger = self.ledger
        w = self.weight
        if w.full_pages:
            ledger.grow(req.block_table, tokens)  # type: ignore[union-attr]
        if w.windows:
            rings = req.rings
            if not rings:
                rings.extend([] for _ in w.windows)
            for ring, (pages, units) in zip(rings, w.windows, strict=True):
                if len(ring) < units * pages:
                    ledger.grow_ring(ring, tokens, pages, units)  # type: ignore[union-attr]

    def _lookup(self, req: Request) -> int:
        """A waiting request's prompt blocks found in the cache: they become its first blocks, and its
        prefill starts after them (at least one token is always computed, for its logits). With window
        kinds, a hit at block h also needs each window's blocks before h (their KV, kept as copies when
        they were written): the hit is the longest prefix that has them, and they are copied into the
        request's ring before its first chunk (pinned until then)."""
        ledger = self.ledger
        if ledger is None or not ledger.caching or not req.prefix:
            return 0
        hits = ledger.hits(req.prefix, (req.context_len - 1) // ledger.block_size)
        if hits and self.weight.windows:
            hits = self._window_hits(req, hits)
        req.shared, req.prefilled = hits, hits * ledger.block_size
        return hits

    def _window_hits(self, req: Request, hits: int) -> int:
        """The longest hit of at most `hits` blocks whose windows' blocks are cached too; pins them."""
        ledger, bs = self.ledger, self.weight.block_size
        assert ledger is not None
        for h in range(hits, 0, -1):
            fill = []
            for w, (pages, _ring) in enumerate(self.weight.windows):
                first = max(0, h * bs - self._windows_len[w] + 1) // bs
                for j in range(first, h):
                    found = ledger.lookup([snap_key(req.prefix[j], w, g) for g in range(pages)])
                    if found is None:
                        break
                    fill.append((w, j, found))
                else:
                    continue
                break
            else:
                req.fill = fill
                for _w, _j, found in fill:
                    ledger.pin(found)
                self._pinned += sum(len(f) for _w, _j, f in fill)
                return h
        return 0

    def _unlookup(self, req: Request) -> None:
        """A candidate was not admitted: forget its hit and unpin what it would have copied."""
        req.shared = req.prefilled = 0
        if req.fill:
            self._unpin(req)

    def _unpin(self, req: Request) -> None:
        for _w, _j, found in req.fill:
            self.ledger.settle(found, None)  # type: ignore[union-attr]
            self._pinned -= len(found)
        req.fill = []

    def _take_snapshots(self, plan) -> None:
        """Spare pages for copies of the window blocks this step's prompt chunks complete (registered
        once written, see _settle): a later request with this prefix finds its windows cached too. Taken
        last, from pages no running request needs; none taken when there are none to spare."""
        ledger, bs = self.ledger, self.weight.block_size
        assert ledger is not None
        for req, n in plan.prefill:
            start, end = req.prefilled, req.prefilled + n
            for j in range(-(-start // bs), min(end // bs, len(req.prefix))):
                for w, (pages, _ring) in enumerate(self.weight.windows):
                    if ledger.lookup([snap_key(req.prefix[j], w, g) for g in range(pages)]) is not None:
                        continue
                    spare = ledger.spare(pages)
                    if spare is None:
                        return
                    req.snaps.append((w, j, spare))

    def _settle(self, plan) -> None:
        """After the step: cache the window copies its chunks wrote, unpin what its hits copied."""
        ledger = self.ledger
        for req, _n in plan.prefill:
            alive = self.running.get(req.id) is req
            for w, j, spare in req.snaps:
                keys = [snap_key(req.prefix[j], w, g) for g in range(len(spare))] if alive else None
                ledger.settle(spare, keys)  # type: ignore[union-attr]
            req.snaps = []
            if req.fill:
                self._unpin(req)

    def _fits_sharing(self, req: Request, chunk: int, ahead: int) -> bool:
        """fits() for a request that would hold cached blocks: exact, counting each block once."""
        b = self.weight.block_size
        profile = self._get_profile()
        entry = self._entry(req, chunk, ahead)
        new, extended = self.shared.plan(req.prefix[: req.shared], entry.finish, self._finish_of)
        if self._committed + (self.shared.held + new) * b + self._own_final(req) <= self._admit_budget:
            self.stats.admitted_fast += 1
            return True
        if profile.admits_sharing(entry, new, extended, self._admit_budget):
            self.stats.admitted_projected += 1
            return True
        self.stats.rejected_projected += 1
        return False

    def _set_shared_entry(self, request_id: str, entry: Entry | None) -> None:
        self._change(self._shared_entries, request_id, entry)

    def _sync_shared(self, request_ids: set[str]) -> None:
        """The cached blocks charged to these holders changed: so do their constant entries."""
        b = self.weight.block_size
        for rid in request_ids:
            n = self.shared.anchored.get(rid, 0)
            # extra = -final: the cached blocks are full-kind blocks, no window kind holds them
            self._set_shared_entry(rid, Entry(self._finish_of(rid), 0, n * b, False, 0, -n * b) if n else None)

    def check_memory(self) -> None:
        """Invariants (tests): the ledger agrees with the block tables, each cached block held is
        charged once to its longest-lived holder, and the blocks held stay within the weight."""
        if self.ledger is None:
            return
        self._get_profile()
        running = list(self.running.values())
        self.ledger.check([r.block_table for r in running] + [ring for r in running for ring in r.rings])
        self.shared.check(self._finish_of)
        b = self.ledger.block_size
        assert self.ledger.used * b <= self.batch_weight(), "blocks held beyond the batch weight"
        for r in running:
            if self.weight.full_pages:
                assert len(r.block_table) * b >= r.prefilled, f"{r.id}: KV beyond its blocks"
            for ring, (pages, units) in zip(r.rings, self.weight.windows, strict=True):
                assert len(ring) == min(-(-r.prefilled // b), units) * pages, f"{r.id}: ring of the wrong size"
            assert len(self.shared.keys.get(r.id, ())) == r.shared, f"{r.id}: cached blocks miscounted"

    # ----- predictive mode: reservations that grow, and preemption ------------------------------------
    def _regrow(self) -> list[Request]:
        """Predictive mode: extend reservations that ran out, then, if the next step's growth would not
        fit in the budget, preempt the newest requests until it does. The budget is never exceeded.

        A projection that overflows after a reservation grows stops admission, but preempts nothing:
        reservations are estimates, and most running requests finish well inside theirs."""
        for req in self.running.values():
            if req.decoding and req.generated >= req.reserved_new:
                old = self._own_final(req)
                req.reserved_new = self.reservations.reserve(req)
                self._committed += self._own_final(req) - old
                self.tenants.weight[req.tenant] += self._own_final(req) - old
                self.reservations.track(req)
                self._set_entry(req.id, self._decoding_entry(req))
                self._running_changed()
        preempted: list[Request] = []
        cap = self.config.max_preemptions
        while self.running and self._next_weight() > self.budget:
            # of the lowest class, the newest request that has not used up its preemptions (else the newest):
            # it has the least work to redo, and a request never waits behind more than `cap` restarts of its own
            victim = max(self.running.values(), key=lambda r: (r.preemptions < cap, self._order[r.id]))
            self._preempt(victim)
            preempted.append(victim)
        st = self.stats
        if preempted and self.estimator is not None and st.preempted_tokens > self.PREEMPT_SHARE * st.generated_tokens:
            self.estimator.tighten()
        return preempted

    def _preempt(self, req: Request, enqueue: bool = True) -> None:
        """Send a running request back to the queue; it keeps its tokens and is prefilled again."""
        del self.running[req.id]
        self._release(req)
        self.stats.preemptions += 1
        self.stats.preempted_tokens += req.prefilled
        req.preemptions += 1
        req.prefilled = 0
        req.decoding = False
        if enqueue:
            self._enqueue(req)
