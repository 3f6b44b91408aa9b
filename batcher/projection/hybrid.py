"""The token profile of a model with sliding-window layers (attention kinds)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

from .entry import Entry
from .token import TokenProfile


class HybridProfile(TokenProfile):
    """TokenProfile for a model with sliding-window layers (batcher/weight.py: kinds). A request holds
    `full` pages per block of its full-kind tokens plus, per window kind, `pages` per block of its
    context up to `ring` blocks: still non-decreasing until it finishes, so the finish points still hold
    every peak and the loads stay exact. A capped growth has no closed sum over residues, so each entry's
    blocks are evaluated at the points it lives through (still one pass, in place)."""

    __slots__ = ("_full", "_grow_extra", "_windows")

    def __init__(self, entries: Iterable[Entry] = (), block: int = 1, kinds: tuple[tuple[int, int], ...] = ()) -> None:
        self._full = kinds[0][0] if kinds and kinds[0][1] == 0 else 0
        self._windows = tuple((p, r) for p, r in kinds if r)
        self._grow_extra: list[int] = []
        super().__init__(entries, block)

    def _at(self, tokens: int, extra: int) -> int:
        """Blocks of a sequence whose full kind holds `tokens` and window kinds `tokens + extra`."""
        bs = self.block
        n = self._full * -(-tokens // bs)
        w = -(-(tokens + extra) // bs)
        for pages, ring in self._windows:
            n += pages * (w if w < ring else ring)
        return n

    def _const_of(self, e: Entry) -> int:
        return self._at(e.final, e.extra)

    def _final_of(self, c: Entry) -> int:
        return self._at(c.final, c.extra)

    def _cand_at(self, c: Entry, p: int) -> int:
        return self._at(c.offset + p, c.extra)

    def _loads_from_scratch(self, ents: list[Entry]) -> list[int]:
        self._grow_extra = [e.extra for e in ents if e.growing]
        self._const_blocks = [self._const_of(e) for e in ents if not e.growing]
        return [self._load_blocks(p) for p in self.points]

    def add(self, e: Entry) -> None:
        if e.growing:
            self._grow_extra.insert(bisect_right(self._grow_finish, e.finish), e.extra)
        super().add(e)

    def _index_of(self, e: Entry, fin: list[int], values: list[int], value: int) -> int:
        lo, hi = bisect_left(fin, e.finish), bisect_right(fin, e.finish)
        if not e.growing:
            return values.index(value, lo, hi)
        extras = self._grow_extra
        i = next(k for k in range(lo, hi) if values[k] == value and extras[k] == e.extra)
        del extras[i]
        return i

    def _series(self, offset: int, extra: int, points: list[int]) -> list[int]:
        """A growing sequence's blocks at each of `points` (the hot loop of updates and decisions)."""
        bs, full = self.block, self._full
        co, cw = offset + bs - 1, offset + extra + bs - 1
        if len(self._windows) == 1:
            (pages, ring), cap = self._windows[0], self._windows[0][1] * bs - cw
            return [full * ((co + p) // bs) + pages * ((cw + p) // bs if p < cap else ring) for p in points]
        return [self._at(offset + p, extra) for p in points]

    def _shift(self, e: Entry, j: int, sign: int) -> None:
        blocks = self._blocks
        if not e.growing:
            w = sign * self._const_of(e)
            blocks[:j] = [x + w for x in blocks[:j]]
            return
        series = self._series(e.offset, e.extra, self.points[:j])
        if sign > 0:
            blocks[:j] = [x + y for x, y in zip(blocks[:j], series, strict=True)]
        else:
            blocks[:j] = [x - y for x, y in zip(blocks[:j], series, strict=True)]

    def _fits_while_alive(self, c: Entry, j: int, cap: int, own: int) -> bool:
        blocks = self._blocks[:j]
        if max(blocks, default=0) + own <= cap:
            return True
        if not c.growing:
            return False
        series = self._series(c.offset, c.extra, self.points[:j])
        return all(x + y <= cap for x, y in zip(blocks, series, strict=True))

    def _load_blocks(self, step: int) -> int:
        i = bisect_left(self._grow_finish, step)
        bs, full = self.block, self._full
        offsets, extras = self._grow_offset[i:], self._grow_extra[i:]
        grow = full * sum((o + step + bs - 1) // bs for o in offsets)
        for pages, ring in self._windows:
            cw = step + bs - 1
            grow += pages * sum(min((o + x + cw) // bs, ring) for o, x in zip(offsets, extras, strict=True))
        return grow + sum(self._const_blocks[bisect_left(self._const_finish, step) :])
