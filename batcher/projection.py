"""Exact projection of the batch weight into the future.

Every running request grows by one token per step until it reaches its reserved length, then leaves.
Between finishes the total only grows, so the peaks sit at finish steps: sorting requests by finish
step and evaluating the weight at each finish point gives the exact maximum, with no step loop.

Steps are absolute (steps completed since the batcher started), so a profile stays valid while the
running set is unchanged: a decoding request's weight at step T is `offset + T` whatever T is now.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from itertools import accumulate
from typing import NamedTuple


class Entry(NamedTuple):
    """One request's projected weight (a tuple: profiles are rebuilt often and must be cheap).

    growing: weight at step T is `offset + T` until `finish` (inclusive), then 0.
    not growing (still prefilling in chunks): counted at `final` until `finish` — an upper bound,
    because its growth starts only when its prompt is fully prefilled.
    fixed: the part of the weight padded on its own (an encoder-decoder's encoder states): the padded
    model pads it to the longest fixed part and the rest to the longest rest. Included in offset/final.
    """

    finish: int
    offset: int
    final: int
    growing: bool = True
    fixed: int = 0


def ceil_to(n: int, block: int) -> int:
    return -(-n // block) * block


class _Profile:
    """Loads at the finish points of a running set, ascending; `_suffix_max[j]` = max(loads[j:])."""

    __slots__ = ("_suffix_max", "loads", "points")

    def peak(self) -> int:
        """The highest weight the running set will reach."""
        return self._suffix_max[0]


class TokenProfile(_Profile):
    """Weight = sum over requests of their token count rounded up to the KV block size."""

    __slots__ = ("_entries", "_ng", "_pm_const", "_pm_grow", "_sa", "_sc", "block")

    def __init__(self, entries: list[Entry], block: int) -> None:
        self.block = block
        self._entries = ents = sorted(entries)
        points: list[int] = []
        loads: list[int] = []
        sa: list[int] = []  # suffix sums of growing offsets (lower bound of the rounded load)
        ng: list[int] = []  # suffix counts of growing entries
        sc: list[int] = []  # suffix sums of constant (prefilling) weights
        sum_q = sum_a = n = const = 0
        residues: list[int] = []
        # Walk finish points from the last: the alive set at point P is every entry finishing at or after P.
        last = None
        for k in range(len(ents) - 1, -1, -1):
            finish, offset, final, growing, _ = ents[k]
            if finish != last and last is not None:
                self._close_point(last, sum_q, n, const, residues, points, loads)
                sa.append(sum_a)
                ng.append(n)
                sc.append(const)
            last = finish
            if growing:
                sum_a += offset
                n += 1
                if block > 1:
                    q, m = divmod(offset, block)
                    sum_q += q
                    insort(residues, m)
                else:
                    sum_q += offset
            else:
                const += -(-final // block) * block
        if last is not None:
            self._close_point(last, sum_q, n, const, residues, points, loads)
            sa.append(sum_a)
            ng.append(n)
            sc.append(const)
        for arr in (points, loads, sa, ng, sc):
            arr.reverse()
        self.points, self.loads, self._sa, self._ng, self._sc = points, loads, sa, ng, sc
        self._pm_grow = _prefix_max(list(map(int.__add__, loads, points)))
        self._pm_const = _prefix_max(loads)
        self._suffix_max = _suffix_max(loads)

    def _close_point(self, p, sum_q, n, const, residues, points, loads) -> None:
        """Append the exact load at finish point p of the alive set summarised by the arguments."""
        block = self.block
        if block == 1:
            points.append(p)
            loads.append(sum_q + n * p + const)
            return
        big_q, small_m = divmod(p, block)
        # ceil((q*B + m + Q*B + M) / B) = q + Q + ceil((m + M) / B), with ceil((m+M)/B) in {0, 1, 2}.
        if small_m == 0:
            extra = n - bisect_right(residues, 0)
        else:
            extra = n + (len(residues) - bisect_right(residues, block - small_m))
        points.append(p)
        loads.append(block * (sum_q + n * big_q + extra) + const)

    def load_at(self, step: int) -> int:
        """Exact projected weight at an absolute step."""
        j = bisect_left(self.points, step)
        if j == len(self.points):
            return 0
        if self.block == 1:
            return self._sa[j] + self._ng[j] * step + self._sc[j]
        return self._exact_load(step)

    def admits(self, c: Entry, budget: int) -> bool:
        """Would the weight stay within budget at every future step with `c` added?"""
        block = self.block
        points, loads = self.points, self.loads
        j = bisect_right(points, c.finish)  # points[:j] are the finish points the candidate lives through
        if self._suffix_max[j] > budget:
            return False
        if c.growing:
            low = self._pm_grow[j] + c.offset  # exact when block == 1
            if low > budget:
                return False
            if block > 1 and low + block - 1 > budget:
                for k in range(j):
                    if loads[k] + ceil_to(c.offset + points[k], block) > budget:
                        return False
        elif self._pm_const[j] + ceil_to(c.final, block) > budget:
            return False
        if j and points[j - 1] == c.finish:
            return True  # the candidate's own finish point was among those checked
        own = ceil_to(c.final, block)
        if j == len(points):
            return own <= budget
        low = self._sa[j] + self._ng[j] * c.finish + self._sc[j]
        if block == 1:
            return low + own <= budget
        if low + own > budget:
            return False
        if low + self._ng[j] * (block - 1) + own <= budget:
            return True
        return self._exact_load(c.finish) + own <= budget

    def _exact_load(self, step: int) -> int:
        block = self.block
        total = 0
        for e in self._entries[bisect_left(self._entries, step, key=_finish) :]:
            total += ceil_to(e.offset + step, block) if e.growing else ceil_to(e.final, block)
        return total


class PaddedProfile(_Profile):
    """Weight = batch size x padded length; the padded length is the longest live context, or for
    encoder-decoder rows the longest fixed (encoder) part plus the longest rest (decoder)."""

    __slots__ = ("_mc", "_mf", "_mg", "_n")

    def __init__(self, entries: list[Entry]) -> None:
        ents = sorted(entries, key=_finish)
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
        self._suffix_max = _suffix_max(loads)

    def load_at(self, step: int) -> int:
        j = bisect_left(self.points, step)
        if j == len(self.points):
            return 0
        return self._n[j] * (self._mf[j] + self._rest(j, step))

    def admits(self, c: Entry, budget: int) -> bool:
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


def _finish(e: Entry) -> int:
    return e.finish


def _prefix_max(values: list[int]) -> list[int]:
    """out[j] = max(values[:j]), with out[0] = 0 (no points)."""
    return [0, *accumulate(values, max)] if values else [0]


def _suffix_max(values: list[int]) -> list[int]:
    """out[j] = max(values[j:]), with out[len] = 0."""
    out = list(accumulate(reversed(values), max))
    out.reverse()
    out.append(0)
    return out
