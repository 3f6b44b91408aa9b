"""The KV block ledger: which block of the pool each running request holds, and the prefix cache.

One source of truth for the paged runner's memory: the batcher decides admission on the weight it
projects and hands out the blocks itself, so the accounting it admits by and the blocks the engine
writes can never disagree. The pool's tensors live in the engine (engine/runner/kv_cache.py).

Prefix caching (vLLM's hashed full blocks): a full block of a prompt is known by a key chained over
every token before it and its own, so equal keys mean equal KV. A registered block stays in the map
after its last holder leaves, as an idle cached block: free for allocation (least recently released
first) until it is evicted, and reusable by a later request with the same prefix until then.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def chain_keys(token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> tuple[bytes, ...]:
    """Keys of the full blocks of `token_ids`: block i's key hashes block i-1's key and its own tokens.

    A cryptographic hash (blake2b, 128 bits) so that no crafted prompt can collide with another
    tenant's prefix and read its KV. `salt` is anything else that changes the KV (a model revision)."""
    keys: list[bytes] = []
    parent = salt
    ids = array("q", token_ids)
    for i in range(len(ids) // block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(ids[i * block_size : (i + 1) * block_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return tuple(keys)


class BlockLedger:
    """Block ids, reference counts and the prefix cache's key map over a pool of `num_blocks`.

    A block is free (never registered, or evicted), held (reference count > 0), or idle: registered,
    held by no one, kept for a later hit. Allocation takes free blocks first, then evicts the idle
    block released longest ago. `used` counts held blocks only: idle ones are free for admission."""

    def __init__(self, num_blocks: int, block_size: int, *, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low block ids first
        self._ref = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # keys of idle blocks, least recently released first (OrderedDict: popping the oldest stays O(1))
        self._idle: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._idle)

    @property
    def idle(self) -> int:
        """Cached blocks no running request holds (reclaimable)."""
        return len(self._idle)

    def hits(self, keys: Sequence[bytes], limit: int) -> int:
        """How many of the first `limit` keys have their block in the pool (held or idle)."""
        n = 0
        for key in keys[:limit]:
            if key not in self._block_of:
                break
            n += 1
        return n

    def lookup(self, keys: Sequence[bytes]) -> list[int] | None:
        """The pages of `keys` if every one is cached (held or idle), else None."""
        pages = []
        for key in keys:
            page = self._block_of.get(key)
            if page is None:
                return None
            pages.append(page)
        return pages

    def pin(self, pages: Sequence[int]) -> None:
        """Take a reference on cached pages for one step (a copy reads them): they cannot be evicted."""
        for page in pages:
            if self._ref[page] == 0:
                del self._idle[self._key_of[page]]
            self._ref[page] += 1

    def spare(self, n: int) -> list[int] | None:
        """`n` pages from the free list or the oldest idle ones, or None when there are not that many:
        extra pages for one step (copies of a window's blocks for the prefix cache), never needed."""
        if len(self._free) + len(self._idle) < n:
            return None
        return [self._take() for _ in range(n)]

    def settle(self, pages: Sequence[int], keys: Sequence[bytes] | None) -> None:
        """Drop one step's reference on `pages`; with `keys`, register them first (their KV is written)."""
        if keys is not None:
            for page, key in zip(pages, keys, strict=True):
                self.register(page, key)  # False: another copy is cached already, this one is freed
        self.release(list(pages))

    def hold(self, table: list[int], keys: Sequence[bytes]) -> None:
        """Append the cached blocks of `keys` (all present: `hits`) to `table`, taking a reference."""
        for key in keys:
            page = self._block_of[key]
            if self._ref[page] == 0:
                del self._idle[key]
            self._ref[page] += 1
            table.append(page)

    def grow(self, table: list[int], tokens: int) -> None:
        """Give `table` blocks for `tokens` tokens. Running out is a batcher bug, never expected."""
        for _ in range(-(-tokens // self.block_size) - len(table)):
            table.append(self._take())

    def grow_ring(self, ring: list[int], tokens: int, pages: int, units: int) -> None:
        """Give a window kind's ring the units (of `pages` pages) for `tokens` tokens, at most `units`."""
        want = min(-(-tokens // self.block_size), units) * pages
        for _ in range(want - len(ring)):
            ring.append(self._take())

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        elif self._idle:
            key, _ = self._idle.popitem(last=False)
            page = self._block_of.pop(key)
            del self._key_of[page]
            self.evictions += 1
        else:
            raise RuntimeError(f"KV pool overflow: every one of {self.num_blocks} blocks is held")
        self._ref[page] = 1
        return page

    def register(self, block: int, key: bytes) -> bool:
        """Make a block that holds the KV of `key` findable; False when caching is off or another
        block already has that key (the caller then keeps its copy private)."""
        if not self.caching or key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def release(self, table: list[int]) -> None:
        """Drop `table`'s references (a block table, or a ring). Its last blocks are released first, so
        they are evicted first: a prefix's first blocks are the most shared and stay cached longest."""
        ref, key_of, free, idle = self._ref, self._key_of, self._free, self._idle  # hoisted: every finish runs this
        if not self.caching:  # no block is shared or keyed: each of them is free again
            for page in table:
                ref[page] = 0
            free.extend(reversed(table))
            table.clear()
            return
        for page in reversed(table):
            left = ref[page] - 1
            ref[page] = left
            if not left:
                key = key_of.get(page)
                if key is None:
                    free.append(page)
                else:
                    idle[key] = None
        table.clear()

    def drop_cache(self) -> int:
        """Evict every idle cached block (a benchmark's cold start); returns how many there were."""
        n = len(self._idle)
        for key in self._idle:
            page = self._block_of.pop(key)
            del self._key_of[page]
            self._free.append(page)
        self._idle.clear()
        return n

    def forget(self, blocks: Sequence[int]) -> None:
        """Unregister `blocks` (their KV was never written: a failed step); they stay held until released."""
        for page in blocks:
            key = self._key_of.pop(page, None)
            if key is not None:
                del self._block_of[key]

    def check(self, tables: Sequence[Sequence[int]]) -> None:
        """Invariants (tests): reference counts equal the tables holding each block; free, idle and
        held blocks partition the pool."""
        counts = [0] * self.num_blocks
        for t in tables:
            for page in t:
                counts[page] += 1
        assert counts == self._ref, "block reference counts disagree with the block tables"
        idle = {self._block_of[k] for k in self._idle}
        assert all(self._ref[page] == 0 for page in idle), "an idle block is held"
        assert all(self._ref[page] == 0 and page not in self._key_of for page in self._free), (
            "a free block is held or keyed"
        )
        held = sum(1 for r in self._ref if r)
        assert held + len(idle) + len(self._free) == self.num_blocks, "blocks lost or counted twice"
