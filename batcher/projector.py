"""The running set's projection: each running request's entry and the profile built from them.

The Projector knows entries, not the running set: the Batcher tells it who starts, stops and moves,
and applies what it returns (a request's own weight, the finishes that moved). Entries are in absolute
steps (batcher/projection/), so a decoding request's entry never changes until it leaves or its
reservation does; entries of requests still prefilling depend on the chunks ahead of
them and are recomputed before the first decision after any change. Changes reach the profile in
place when it is next used (after more than REBUILD_AFTER of them, it is rebuilt instead).
"""

from __future__ import annotations

from .projection import Entry, PaddedProfile, TokenProfile
from .request import Request
from .weight import PaddedWeight, TokenWeight

TYPICAL_OVER = 8  # admissions the typical reserved weight follows (an exponential moving average)


class Projector:
    REBUILD_AFTER = 32  # more entry changes than this before a decision: rebuild the profile instead

    def __init__(self, weight: TokenWeight | PaddedWeight, max_prefill_weight: int) -> None:
        self.weight = weight
        self.max_prefill_weight = max_prefill_weight
        self.profile_: TokenProfile | PaddedProfile = self.weight.profile([])
        self.entries: dict[str, Entry] = {}  # each running request's entry, as the profile has it or will
        self.shared_entries: dict[str, Entry] = {}  # each anchor's entry for the cached blocks charged to it
        self.changes: list[tuple[Entry, int]] | None = []  # to add (1) or remove (-1); None: rebuild
        self.prefilling: dict[str, Request] = {}  # running requests not decoding yet, in admission order
        self.stale = False  # the prefilling requests' entries must be recomputed before the next decision
        self.typical = 0  # moving average of admitted requests' reserved weight

    def own_final(self, req: Request) -> int:
        """The weight a request reserves for itself: its final length less the cached blocks it holds."""
        return self.weight.own(req.reserved_total, req.shared_blocks)

    def finish_of(self, request_id: str) -> int:
        return self.entries[request_id].finish

    def entry(self, req: Request, chunk: int, ahead: int, step: int) -> Entry:
        """Projection entry for `req`, which feeds `chunk` tokens at `step` with `ahead` prompt
        tokens of earlier requests still to prefill after this step."""
        remaining = req.reserved_new - req.generated
        rest = req.prefill_left - chunk
        shared = req.shared_blocks * self.weight.block_size  # cached blocks are charged apart (SharedBlocks)
        offset, final = req.context_len - step - shared, req.reserved_total - shared
        if rest <= 0:
            return Entry(step + remaining, offset, final, True, req.fixed_len, shared)
        cap = self.max_prefill_weight
        delay = -(-(ahead + rest) // cap)  # FIFO: every later step gives earlier prompts the full cap
        return Entry(step + delay + remaining, offset, final, False, req.fixed_len, shared)

    def decoding_entry(self, req: Request, step: int) -> Entry:
        """A decoding request's entry: the same at every step (absolute steps) until its reservation changes."""
        shared = req.shared_blocks * self.weight.block_size
        inp = req.input_len - shared
        gen, res = req.generated, req.reserved_new
        return Entry(step + res - gen, inp + gen - step, inp + res, True, req.fixed_len, shared)

    def start(self, req: Request, chunk: int, ahead: int, step: int) -> int:
        """A request is admitted: its entry is counted (its cached blocks' charge needs its finish);
        returns its own reserved weight."""
        w = self.own_final(req)
        self.set_entry(req.id, self.entry(req, chunk, ahead, step))
        self.typical = w if not self.typical else self.typical + (w - self.typical) // TYPICAL_OVER
        self.prefilling[req.id] = req
        return w

    def stop(self, req: Request) -> int:
        """A request leaves the running set; returns the weight it had reserved."""
        self.prefilling.pop(req.id, None)
        self.set_entry(req.id, None)
        self.set_shared(req.id, 0)
        return self.own_final(req)

    def decodes(self, req: Request, step: int) -> int | None:
        """`req`'s prompt is all fed: its entry tightens to a decoding one. Returns its old finish if it moved."""
        del self.prefilling[req.id]
        return self.set_entry(req.id, self.decoding_entry(req, step))

    def set_entry(self, request_id: str, entry: Entry | None) -> int | None:
        """Record a running request's entry (None: it left); the profile takes the change in when next
        used. Returns the old finish when the entry moved it (its cached blocks' anchors may change)."""
        old = self.change(self.entries, request_id, entry)
        if old is not None and entry is not None and old.finish != entry.finish:
            return old.finish
        return None

    def set_shared(self, request_id: str, blocks: int) -> None:
        """The cached blocks charged to a holder (SharedBlocks' anchors): a constant entry at its finish,
        with extra = -final (they are full-kind blocks: no window kind holds them)."""
        n = blocks * self.weight.block_size
        entry = Entry(self.finish_of(request_id), 0, n, False, 0, -n) if blocks else None
        self.change(self.shared_entries, request_id, entry)

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

    def refresh_prefilling(self, step: int) -> list[tuple[str, int]]:
        """Entries of requests still prefilling, from this step's chunks (assigned as in running work).
        Returns (request id, old finish) for each whose finish moved."""
        cap = self.max_prefill_weight
        left, ahead = cap, 0
        moved = []
        for req in self.prefilling.values():
            chunk = req.prefill_left
            if cap:
                chunk = min(chunk, left)
                left -= chunk
            old = self.set_entry(req.id, self.entry(req, chunk, ahead, step))
            if old is not None:
                moved.append((req.id, old))
            ahead += req.prefill_left - chunk
        self.stale = False
        return moved

    def profile(self) -> TokenProfile | PaddedProfile:
        """The running set's profile, each entry change since the last use applied in place (O(running)
        each), or, after many of them, rebuilt. Stale prefilling entries are the Batcher's to refresh first
        (Batcher.profile does, and recharges the anchors whose finish moved)."""
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
        kept = [e for rid, e in self.entries.items() if rid not in ids]
        return self.weight.profile([*kept, *self.shared_entries.values()])
