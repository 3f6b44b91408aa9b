"""The running set's projection: each running request's entry, the profile built from them, and the
sum of their reserved weights (the naive test).

Entries are in absolute steps (batcher/projection/), so a decoding request's entry never changes until it
leaves or its reservation does; entries of requests still prefilling depend on the chunks ahead of
them and are recomputed before the first decision after any change. Changes reach the profile in
place when it is next used (after more than REBUILD_AFTER of them, it is rebuilt instead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .projection import Entry, PaddedProfile, TokenProfile
from .request import Request

if TYPE_CHECKING:
    from .batcher import Batcher


class Projector:
    REBUILD_AFTER = 32  # more entry changes than this before a decision: rebuild the profile instead

    def __init__(self, batcher: Batcher) -> None:
        self.b = batcher
        self.weight = batcher.weight
        self.profile_: TokenProfile | PaddedProfile = self.weight.profile([])
        self.entries: dict[str, Entry] = {}  # each running request's entry, as the profile has it or will
        self.shared_entries: dict[str, Entry] = {}  # each anchor's entry for the cached blocks charged to it
        self.changes: list[tuple[Entry, int]] | None = []  # to add (1) or remove (-1); None: rebuild
        self.prefilling: dict[str, Request] = {}  # running requests not decoding yet, in admission order
        self.stale = False  # the prefilling requests' entries must be recomputed before the next decision
        self.committed = 0  # sum of running requests' reserved final weights (token model)
        self.typical = 0  # moving average of admitted requests' reserved weight

    def own_final(self, req: Request) -> int:
        """The weight a request reserves for itself: its final length less the cached blocks it holds."""
        return self.weight.own(req.reserved_total, req.shared)

    def finish_of(self, request_id: str) -> int:
        return self.entries[request_id].finish

    def entry(self, req: Request, chunk: int, ahead: int) -> Entry:
        """Projection entry for `req`, which feeds `chunk` tokens this step with `ahead` prompt
        tokens of earlier requests still to prefill after this step."""
        step = self.b.step
        remaining = req.reserved_new - req.generated
        rest = req.prefill_left - chunk
        shared = req.shared * self.weight.block_size  # cached blocks are charged apart (prefix.py)
        offset, final = req.context_len - step - shared, req.reserved_total - shared
        if rest <= 0:
            return Entry(step + remaining, offset, final, True, req.fixed_len, shared)
        cap = self.b.config.max_prefill_weight
        delay = -(-(ahead + rest) // cap)  # FIFO: every later step gives earlier prompts the full cap
        return Entry(step + delay + remaining, offset, final, False, req.fixed_len, shared)

    def decoding_entry(self, req: Request) -> Entry:
        """A decoding request's entry: the same at every step (absolute steps) until its reservation changes."""
        shared = req.shared * self.weight.block_size
        inp = req.input_len - shared
        gen, res, step = req.generated, req.reserved_new, self.b.step
        return Entry(step + res - gen, inp + gen - step, inp + res, True, req.fixed_len, shared)

    def start(self, req: Request, chunk: int, ahead: int) -> int:
        """A request is admitted: its reservation and entry are counted; returns its own weight."""
        w = self.own_final(req)
        self.committed += w
        self.set_entry(req.id, self.entry(req, chunk, ahead))  # its cached blocks' charge needs its finish
        self.typical = w if not self.typical else (7 * self.typical + w) // 8
        self.prefilling[req.id] = req
        return w

    def stop(self, req: Request) -> int:
        """A request leaves the running set; returns the weight it had reserved."""
        own = self.own_final(req)
        self.committed -= own
        self.prefilling.pop(req.id, None)
        self.set_entry(req.id, None)
        return own

    def set_entry(self, request_id: str, entry: Entry | None) -> None:
        """Record a running request's entry (None: it left); the profile takes the change in when next used.
        A holder of cached blocks whose finish moves takes or gives up the blocks it outlives or no longer does."""
        old = self.change(self.entries, request_id, entry)
        shared = self.b.paging.shared
        if old is not None and entry is not None and old.finish != entry.finish and request_id in shared.keys:
            self.b.paging.sync_shared(shared.refinish(request_id, old.finish, self.finish_of) | {request_id})

    def change(self, entries: dict[str, Entry], key: str, entry: Entry | None) -> Entry | None:
        old = entries.pop(key, None)
        if entry is not None:
            entries[key] = entry
        changes = self.changes
        if entry == old or changes is None:
            return old
        if old is not None:
            changes.append((old, -1))
        if entry is not None:
            changes.append((entry, 1))
        if len(changes) > self.REBUILD_AFTER:
            self.changes = None  # one rebuild is cheaper than applying this many
        return old

    def refresh_prefilling(self) -> None:
        """Entries of requests still prefilling, from this step's chunks (assigned as in running work)."""
        cap = self.b.config.max_prefill_weight
        left, ahead = cap, 0
        for req in self.prefilling.values():
            chunk = req.prefill_left
            if cap:
                chunk = min(chunk, left)
                left -= chunk
            self.set_entry(req.id, self.entry(req, chunk, ahead))
            ahead += req.prefill_left - chunk
        self.stale = False

    def profile(self) -> TokenProfile | PaddedProfile:
        """The running set's profile, brought up to date: each entry change since the last use is applied
        in place (O(running) each), or, after many of them, the profile is rebuilt."""
        if self.stale:
            self.refresh_prefilling()
        if self.changes is None:
            self.profile_ = self.weight.profile([*self.entries.values(), *self.shared_entries.values()])
            self.changes = []
        for entry, sign in self.changes:
            if sign > 0:
                self.profile_.add(entry)
            else:
                self.profile_.remove(entry)
        self.changes.clear()
        return self.profile_

    def without(self, ids: set[str]) -> TokenProfile | PaddedProfile:
        """A fresh profile of the running set less `ids` (what preempting them would leave)."""
        self.profile()  # entries brought up to date
        kept = [e for rid, e in self.entries.items() if rid not in ids]
        return self.weight.profile([*kept, *self.shared_entries.values()])

    def weight_with(self, more: int) -> int:
        """The running requests' weight with `more` tokens each (1: after the next step, if every one
        emits; a prefilling one emits with its last chunk: conservative by at most a block)."""
        running, w = self.b.running.values(), self.weight
        held = self.b.paging.shared.held * w.block_size
        if w.name == "token" and not w.uniform:
            return sum(w.own(r.context_len + more, r.shared) for r in running) + held
        b = w.block_size
        own = [r.context_len + more - r.shared * b for r in running]
        return w.batch(own, [r.fixed_len for r in running]) + held

    def room_for(self) -> int:
        """How many more requests of the typical size (recent admissions' reserved weight) would fit
        by the naive sum after everything already waiting (at its worst case) is admitted: what a
        worker may take from a shared queue without hoarding. Waiting work counts, not blocks:
        requests held back only by the prefill cap start within a few steps."""
        w, b = self.weight, self.b
        typical = self.typical or w.seq(b.config.max_total_tokens)
        pending = sum(w.seq(r.max_total) for r in b.waiting)
        held = b.paging.shared.held * w.block_size
        return max(0, (b.budget - self.committed - held - pending) // typical)
