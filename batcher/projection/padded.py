"""The padded weight model's profile: batch size x padded length at every finish point."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from itertools import accumulate

from .entry import Entry, finish_of


def suffix_max(values: list[int]) -> list[int]:
    """out[j] = max(values[j:]), with out[len] = 0."""
    out = list(accumulate(reversed(values), max))
    out.reverse()
    out.append(0)
    return out


class PaddedProfile:
    """Weight = batch size x padded length; the padded length is the longest live context, or for
    encoder-decoder rows the longest fixed (encoder) part plus the longest rest (decoder).

    A longest length cannot be taken back out when its request leaves, so `add` and `remove` only edit
    the entry list, and the loads are rebuilt at the next query (padded batches are small)."""

    __slots__ = ("_entries", "_mc", "_mf", "_mg", "_n", "_stale", "_suffix_max", "loads", "points")

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._entries = list(entries)
        self._build()

    def add(self, e: Entry) -> None:
        self._entries.append(e)
        self._stale = True

    def remove(self, e: Entry) -> None:
        self._entries.remove(e)
        self._stale = True

    def _build(self) -> None:
        ents = sorted(self._entries, key=finish_of)
        points: list[int] = []
        loads: list[int] = []
        n_alive: list[int] = []
        max_grow: list[int | None] = []  # suffix max of growing offsets (fixed part excluded)
        max_const: list[int] = []  # suffix max of constant lengths (fixed part excluded)
        max_fixed: list[int] = []  # suffix max of fixed parts
        n, mg, mc, mf = 0, None, 0, 0
        i = len(ents) - 1
        while i >= 0:
            p = ents[i].finish
            while i >= 0 and ents[i].finish == p:
                e = ents[i]
                n += 1
                if e.growing:
                    mg = e.offset - e.fixed if mg is None else max(mg, e.offset - e.fixed)
                else:
                    mc = max(mc, e.final - e.fixed)
                mf = max(mf, e.fixed)
                i -= 1
            points.append(p)
            loads.append(n * (mf + (mc if mg is None else max(mg + p, mc))))
            n_alive.append(n)
            max_grow.append(mg)
            max_const.append(mc)
            max_fixed.append(mf)
        for arr in (points, loads, n_alive, max_grow, max_const, max_fixed):
            arr.reverse()
        self.points, self.loads, self._n = points, loads, n_alive
        self._mg, self._mc, self._mf = max_grow, max_const, max_fixed
        self._suffix_max = suffix_max(loads)
        self._stale = False

    def peak(self) -> int:
        """The highest weight the running set will reach."""
        if self._stale:
            self._build()
        return self._suffix_max[0]

    def load_at(self, step: int) -> int:
        if self._stale:
            self._build()
        j = bisect_left(self.points, step)
        if j == len(self.points):
            return 0
        return self._n[j] * (self._mf[j] + self._rest(j, step))

    def admits(self, c: Entry, budget: int) -> bool:
        if self._stale:
            self._build()
        points = self.points
        j = bisect_right(points, c.finish)
        if self._suffix_max[j] > budget:
            return False
        for k in range(j):
            own = c.offset - c.fixed + points[k] if c.growing else c.final - c.fixed
            if (self._n[k] + 1) * (max(self._mf[k], c.fixed) + max(self._rest(k, points[k]), own)) > budget:
                return False
        if j and points[j - 1] == c.finish:
            return True
        if j == len(points):
            return c.final <= budget
        rest = max(self._rest(j, c.finish), c.final - c.fixed)
        return (self._n[j] + 1) * (max(self._mf[j], c.fixed) + rest) <= budget

    def _rest(self, j: int, step: int) -> int:
        mg = self._mg[j]
        return self._mc[j] if mg is None else max(mg + step, self._mc[j])
