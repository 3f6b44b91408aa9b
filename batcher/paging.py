"""Paged memory under the batcher: blocks (and rings) from the ledger as requests grow, the prefix
cache's hits, cached blocks charged once to their longest-lived holder, and with sliding-window kinds
the copies of their window blocks that make a hit past a window possible.

Blocks are handed out for a step's tokens before the step runs; a prompt's full blocks are keyed the
moment they are handed out (a request admitted later in the same step finds them, and reads their KV
after this step's writes: attention writes a layer's K/V first). A cached block counts once for as
long as its last holder runs (SharedBlocks); idle cached blocks never count.

Paging owns the pages and the cached blocks' holders; it never reaches the projection or the running
set. What changes the weight comes back as values the Batcher applies: the blocks a prompt turned into
cached ones, and the holders whose charge of cached blocks changed. `finish_of` (each holder's
projected finish) is read, never changed.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass, field

from .blocks import BlockLedger
from .plan import StepPlan
from .prefix import SharedBlocks
from .request import Request
from .weight import PaddedWeight, TokenWeight

FinishOf = Callable[[str], int]
NONE_CACHED: tuple[int, frozenset[str]] = (0, frozenset())  # allocate()'s usual answer, not rebuilt per call


@dataclass(frozen=True, slots=True)
class Hit:
    """A prefix-cache hit: its leading `blocks` (`tokens` of context) are cached; with window kinds, the
    (window kind, block, pages) copies its ring needs and how many `pages` they are."""

    blocks: int = 0
    tokens: int = 0
    copies: list[tuple[int, int, list[int]]] = field(default_factory=list)
    pages: int = 0


NO_HIT = Hit()


def snap_key(key: bytes, kind: int, column: int) -> bytes:
    """The cache key of a window kind's copy of the block `key` names (one page per column)."""
    return key + bytes((kind, column))


class Paging:
    def __init__(
        self, weight: TokenWeight | PaddedWeight, pages: int | None, prefix_cache: bool, windows: tuple[int, ...]
    ) -> None:
        """`pages`: the ledger's pages (the budget in blocks) for the token weight; None or the padded
        weight: no ledger."""
        self.weight = weight
        keep = pages is not None and weight.name == "token"
        self.ledger = BlockLedger(pages, weight.block_size, caching=prefix_cache) if keep else None
        self.shared = SharedBlocks()
        self.windows_len = windows  # each window kind's window, in tokens
        self.pinned_pages = 0  # pinned this step for a hit's copies (held until the step runs)

    @property
    def shared_weight(self) -> int:
        """The weight of the cached blocks running requests hold (each counted once)."""
        return self.shared.held_blocks * self.weight.block_size

    def charged(self, request_id: str) -> int:
        """The cached blocks charged to a holder (it outlives their other holders)."""
        return self.shared.anchored.get(request_id, 0)

    # ----- growth ------------------------------------------------------------------------------------
    def allocate(self, req: Request, tokens: int, finish_of: FinishOf) -> tuple[int, Set[str]]:
        """Blocks for a prompt chunk that ends at `tokens`; the prompt blocks it fills join the prefix
        cache. Returns how many of its own blocks became cached blocks it holds (no longer its own
        weight: charged once to their anchor) and the holders whose charge changed."""
        ledger = self.ledger
        if ledger is None:
            return NONE_CACHED
        self.grow(req, tokens)
        full = min(len(req.prefix), tokens // ledger.block_size)
        first = i = req.shared_blocks
        while i < full and ledger.register(req.block_table[i], req.prefix[i]):
            i += 1
        if i == first:
            return NONE_CACHED
        req.shared_blocks = i
        return i - first, self.shared.join(req.id, req.prefix[first:i], finish_of)

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

    def hold(self, req: Request, finish_of: FinishOf) -> set[str]:
        """An admitted request takes the cached blocks its hit found (charged once, to their anchor) and
        pins the window copies it will copy (until the step runs); returns the holders whose charge changed."""
        keys = req.prefix[: req.shared_blocks]
        ledger = self.ledger
        assert ledger is not None
        ledger.hold(req.block_table, keys)
        for _w, _j, found in req.ring_copies:
            ledger.pin(found)
            self.pinned_pages += len(found)
        return self.shared.join(req.id, keys, finish_of)

    def leave(self, req: Request, finish_of: FinishOf) -> set[str]:
        """A request leaves: its cached blocks go to their next holder, its pages back to the ledger.
        Returns the other holders whose charge changed."""
        changed: set[str] = set()
        if req.shared_blocks:
            changed, _freed = self.shared.leave(req.id, finish_of)
        if self.ledger is not None:
            self.ledger.release(req.block_table)
            for ring in req.rings:
                self.ledger.release(ring)
        req.shared_blocks = 0
        return changed

    def refinish(self, request_id: str, old: int, finish_of: FinishOf) -> set[str]:
        """A holder's projected finish moved from `old`: it takes the blocks it now outlives others on,
        or gives up those another outlives it on. Returns the holders whose charge changed."""
        if request_id not in self.shared.keys:
            return set()
        return self.shared.refinish(request_id, old, finish_of) | {request_id}

    # ----- the prefix cache --------------------------------------------------------------------------
    def lookup(self, req: Request) -> Hit:
        """A waiting request's prompt blocks found in the cache (a question: nothing is held or pinned
        until it starts, `hold`). They would be its first blocks, its prefill starting after them (at
        least one token is always computed, for its logits). With window kinds, a hit at block h also
        needs each window's blocks before h (their KV, kept as copies when they were written): the hit
        is the longest prefix that has them, and they are copied into the request's ring before its
        first chunk."""
        ledger = self.ledger
        if ledger is None or not ledger.caching or not req.prefix:
            return NO_HIT
        hits = ledger.hits(req.prefix, (req.context_len - 1) // ledger.block_size)
        if not hits:
            return NO_HIT
        if not self.weight.windows:
            return Hit(hits, hits * ledger.block_size)
        return self._window_hit(req, hits)

    def _window_hit(self, req: Request, hits: int) -> Hit:
        """The longest hit of at most `hits` blocks whose windows' blocks are cached too."""
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
                return Hit(h, h * bs, fill, sum(len(f) for _w, _j, f in fill))
        return NO_HIT

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
                    req.window_snapshots.append((w, j, spare))

    def settle(self, plan: StepPlan, alive: Callable[[Request], bool]) -> None:
        """After the step: cache the window copies its chunks wrote (those of requests still `alive`),
        unpin what its hits copied."""
        ledger = self.ledger
        for req, _n in plan.prefill:
            kept = alive(req)
            for w, j, spare in req.window_snapshots:
                keys = [snap_key(req.prefix[j], w, g) for g in range(len(spare))] if kept else None
                ledger.settle(spare, keys)  # type: ignore[union-attr]
            req.window_snapshots = []
            for _w, _j, found in req.ring_copies:
                ledger.settle(found, None)  # type: ignore[union-attr]
                self.pinned_pages -= len(found)
            req.ring_copies = []

    def check(self, running: list[Request], batch_weight: int, finish_of: FinishOf) -> None:
        """Invariants (tests): the ledger agrees with the block tables, each cached block held is
        charged once to its longest-lived holder, and the blocks held stay within the weight."""
        if self.ledger is None:
            return
        self.ledger.check([r.block_table for r in running] + [ring for r in running for ring in r.rings])
        self.shared.check(finish_of)
        bs = self.ledger.block_size
        assert self.ledger.used * bs <= batch_weight, "blocks held beyond the batch weight"
        for r in running:
            if self.weight.full_pages:
                assert len(r.block_table) * bs >= r.prefilled, f"{r.id}: KV beyond its blocks"
            for ring, (pages, units) in zip(r.rings, self.weight.windows, strict=True):
                assert len(ring) == min(-(-r.prefilled // bs), units) * pages, f"{r.id}: ring of the wrong size"
            assert len(self.shared.keys.get(r.id, ())) == r.shared_blocks, f"{r.id}: cached blocks miscounted"
