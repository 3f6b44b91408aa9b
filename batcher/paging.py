"""Paged memory under the batcher: blocks (and rings) from the ledger as requests grow, the prefix
cache's hits, cached blocks charged once to their longest-lived holder, and with sliding-window kinds
the copies of their window blocks that make a hit past a window possible.

Blocks are handed out for a step's tokens before the step runs; a prompt's full blocks are keyed the
moment they are handed out (a request admitted later in the same step finds them, and reads their KV
after this step's writes: attention writes a layer's K/V first). A cached block counts once for as
long as its last holder runs (prefix.py: SharedBlocks); idle cached blocks never count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .blocks import BlockLedger
from .plan import StepPlan
from .prefix import SharedBlocks
from .projection import Entry
from .request import Request

if TYPE_CHECKING:
    from .batcher import Batcher


def snap_key(key: bytes, kind: int, column: int) -> bytes:
    """The cache key of a window kind's copy of the block `key` names (one page per column)."""
    return key + bytes((kind, column))


class Paging:
    def __init__(self, batcher: Batcher) -> None:
        cfg = batcher.config
        self.b = batcher
        self.weight = batcher.weight
        self.ledger = (
            BlockLedger(batcher.budget // cfg.block_size, cfg.block_size, caching=cfg.prefix_caching)
            if cfg.weight_model == "token"
            else None
        )
        self.shared = SharedBlocks()
        self.windows_len = tuple(cfg.windows)  # each window kind's window, in tokens
        self.pinned = 0  # pages pinned this step for a hit's copies (held until the step runs)

    # ----- growth ------------------------------------------------------------------------------------
    def allocate(self, req: Request, tokens: int) -> None:
        """Blocks for a prompt chunk that ends at `tokens`; the prompt blocks it fills join the prefix cache."""
        ledger = self.ledger
        if ledger is None:
            return
        self.grow(req, tokens)
        full = min(len(req.prefix), tokens // ledger.block_size)
        first = i = req.shared
        while i < full and ledger.register(req.block_table[i], req.prefix[i]):
            i += 1
        if i > first:  # its own blocks become cached blocks it holds (and is charged for while it lives)
            self.b.projector.committed -= (i - first) * ledger.block_size
            req.shared = i
            self.sync_shared(self.shared.join(req.id, req.prefix[first:i], self.b.projector.finish_of))
            self.b.running_changed()

    def grow(self, req: Request, tokens: int) -> None:
        """Pages for `tokens` tokens of `req`: its full kind's blocks and its rings' units."""
        ledger, w = self.ledger, self.weight
        if w.full_pages:
            ledger.grow(req.block_table, tokens)  # type: ignore[union-attr]
        if w.windows:
            rings = req.rings
            if not rings:
                rings.extend([] for _ in w.windows)
            for ring, (pages, units) in zip(rings, w.windows, strict=True):
                if len(ring) < units * pages:
                    ledger.grow_ring(ring, tokens, pages, units)  # type: ignore[union-attr]

    def hold(self, req: Request) -> None:
        """An admitted request takes the cached blocks its hit found (charged once, to their anchor)."""
        keys = req.prefix[: req.shared]
        self.ledger.hold(req.block_table, keys)  # type: ignore[union-attr]
        self.sync_shared(self.shared.join(req.id, keys, self.b.projector.finish_of))

    def leave(self, req: Request) -> None:
        """A request leaves: its cached blocks go to their next holder, its pages back to the ledger."""
        if req.shared:
            changed, _freed = self.shared.leave(req.id, self.b.projector.finish_of)
            self.b.projector.change(self.b.projector.shared_entries, req.id, None)
            self.sync_shared(changed)
        if self.ledger is not None:
            self.ledger.release(req.block_table)
            for ring in req.rings:
                self.ledger.release(ring)
        req.shared = 0

    def sync_shared(self, request_ids: set[str]) -> None:
        """The cached blocks charged to these holders changed: so do their constant entries."""
        b, proj = self.weight.block_size, self.b.projector
        for rid in request_ids:
            n = self.shared.anchored.get(rid, 0)
            # extra = -final: the cached blocks are full-kind blocks, no window kind holds them
            proj.change(proj.shared_entries, rid, Entry(proj.finish_of(rid), 0, n * b, False, 0, -n * b) if n else None)

    # ----- the prefix cache --------------------------------------------------------------------------
    def lookup(self, req: Request) -> int:
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
                first = max(0, h * bs - self.windows_len[w] + 1) // bs
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
                self.pinned += sum(len(f) for _w, _j, f in fill)
                return h
        return 0

    def unlookup(self, req: Request) -> None:
        """A candidate was not admitted: forget its hit and unpin what it would have copied."""
        req.shared = req.prefilled = 0
        if req.fill:
            self._unpin(req)

    def _unpin(self, req: Request) -> None:
        for _w, _j, found in req.fill:
            self.ledger.settle(found, None)  # type: ignore[union-attr]
            self.pinned -= len(found)
        req.fill = []

    def take_snapshots(self, plan: StepPlan) -> None:
        """Spare pages for copies of the window blocks this step's prompt chunks complete (registered
        once written, see settle): a later request with this prefix finds its windows cached too. Taken
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

    def settle(self, plan: StepPlan) -> None:
        """After the step: cache the window copies its chunks wrote, unpin what its hits copied."""
        ledger = self.ledger
        for req, _n in plan.prefill:
            alive = self.b.running.get(req.id) is req
            for w, j, spare in req.snaps:
                keys = [snap_key(req.prefix[j], w, g) for g in range(len(spare))] if alive else None
                ledger.settle(spare, keys)  # type: ignore[union-attr]
            req.snaps = []
            if req.fill:
                self._unpin(req)

    def fits_sharing(self, req: Request, chunk: int, ahead: int, budget: int) -> tuple[bool, bool]:
        """Admission of a request that would hold cached blocks: exact, counting each block once.
        Returns (admitted, by the naive sum alone)."""
        b, proj = self.weight.block_size, self.b.projector
        entry = proj.entry(req, chunk, ahead)
        new, extended = self.shared.plan(req.prefix[: req.shared], entry.finish, proj.finish_of)
        if proj.committed + (self.shared.held + new) * b + proj.own_final(req) <= budget:
            return True, True
        return proj.profile().admits_sharing(entry, new, extended, budget), False

    def check(self) -> None:
        """Invariants (tests): the ledger agrees with the block tables, each cached block held is
        charged once to its longest-lived holder, and the blocks held stay within the weight."""
        if self.ledger is None:
            return
        proj = self.b.projector
        proj.profile()
        running = list(self.b.running.values())
        self.ledger.check([r.block_table for r in running] + [ring for r in running for ring in r.rings])
        self.shared.check(proj.finish_of)
        b = self.ledger.block_size
        assert self.ledger.used * b <= self.b.batch_weight(), "blocks held beyond the batch weight"
        for r in running:
            if self.weight.full_pages:
                assert len(r.block_table) * b >= r.prefilled, f"{r.id}: KV beyond its blocks"
            for ring, (pages, units) in zip(r.rings, self.weight.windows, strict=True):
                assert len(ring) == min(-(-r.prefilled // b), units) * pages, f"{r.id}: ring of the wrong size"
            assert len(self.shared.keys.get(r.id, ())) == r.shared, f"{r.id}: cached blocks miscounted"
