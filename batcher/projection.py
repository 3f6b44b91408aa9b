"""Exact projection of the batch weight into the future.

Every running request grows by one token per step until it reaches its reserved length, then leaves.
Between finishes the total only grows, so the peaks sit at finish steps: the weight at each finish
point gives the exact maximum, with no step loop.

Steps are absolute (steps completed since the batcher started), so a profile stays valid while the
running set is unchanged: a decoding request's weight at step T is `offset + T` whatever T is now.
That is also what lets a profile be updated in place: adding or removing one request changes the
weight only at the finish points it lives through, and nothing else has to be recomputed.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from itertools import accumulate, repeat
from operator import add, floordiv
from typing import NamedTuple


class Entry(NamedTuple):
    """One request's projected weight (a tuple: compared by value, cheap to make).

    growing: weight at step T is `offset + T` until `finish` (inclusive), then 0; `final` is then
    `offset + finish`.
    not growing (still prefilling in chunks): counted at `final` until `finish` — an upper bound,
    because its growth starts only when its prompt is fully prefilled.
    fixed: the part of the weight padded on its own (an encoder-decoder's encoder states): the padded
    model pads it to the longest fixed part and the rest to the longest rest. Included in offset/final.
    extra: with attention kinds (HybridProfile), tokens its window kinds hold beyond `offset`/`final`,
    which count its full kind's: the cached prefix blocks it shares, charged to their anchor. A
    constant entry of cached blocks (an anchor's charge) has extra = -final: no window holds any of it.
    """

    finish: int
    offset: int
    final: int
    growing: bool = True
    fixed: int = 0
    extra: int = 0


def ceil_to(n: int, block: int) -> int:
    return -(-n // block) * block


class TokenProfile:
    """Weight = sum over requests of their token count rounded up to the KV block size.

    Kept as the exact load, in blocks, at every distinct finish point, and updated in place: a request
    changes the load only at the points it lives through (a prefix), so `add` and `remove` are one pass
    over that prefix, with no sorting and no rebuild. A decision is a max over a slice or two, plus,
    only when a growing candidate comes within a block per point of the budget, an exact pass over
    the points it lives through.
    """

    __slots__ = (
        "_blocks",
        "_const_blocks",
        "_const_finish",
        "_grow_finish",
        "_grow_offset",
        "_peak",
        "block",
        "points",
    )

    def __init__(self, entries: Iterable[Entry] = (), block: int = 1) -> None:
        self.block = block
        ents = sorted(entries, key=_finish)
        self._grow_finish = [e.finish for e in ents if e.growing]
        self._grow_offset = [e.offset for e in ents if e.growing]
        self._const_finish = [e.finish for e in ents if not e.growing]
        self._const_blocks = [-(-e.final // block) for e in ents if not e.growing]
        self.points = sorted({e.finish for e in ents})  # distinct finish steps, ascending
        self._blocks = self._loads_from_scratch(ents)  # exact load at each point, in blocks
        self._peak: int | None = None

    def _loads_from_scratch(self, ents: list[Entry]) -> list[int]:
        """Walk the points from the last: the alive set at P is every entry finishing at or after P.
        A growing entry holds ceil((q*B + m + P) / B) = q + ceil(P / B) + (1 if m > -P mod B) blocks,
        so the alive set is summed by its quotients, its size and a histogram of its residues m."""
        b = self.block
        residues = [0] * b
        quotients = growing = const = 0
        loads: list[int] = []
        i = len(ents) - 1
        for p in reversed(self.points):
            while i >= 0 and ents[i].finish >= p:
                e = ents[i]
                i -= 1
                if e.growing:
                    q, m = divmod(e.offset, b)
                    quotients, growing = quotients + q, growing + 1
                    residues[m] += 1
                else:
                    const += -(-e.final // b)
            loads.append(quotients + growing * -(-p // b) + sum(residues[-p % b + 1 :]) + const)
        loads.reverse()
        return loads

    # ----- updates --------------------------------------------------------------------------------
    def add(self, e: Entry) -> None:
        """Count one more request: its blocks at each point it lives through, and its finish as a point."""
        if e.growing:
            i = bisect_right(self._grow_finish, e.finish)
            self._grow_finish.insert(i, e.finish)
            self._grow_offset.insert(i, e.offset)
        else:
            i = bisect_right(self._const_finish, e.finish)
            self._const_finish.insert(i, e.finish)
            self._const_blocks.insert(i, self._const_of(e))
        points = self.points
        j = bisect_left(points, e.finish)
        if j < len(points) and points[j] == e.finish:
            self._shift(e, j + 1, 1)
        else:
            self._shift(e, j, 1)
            points.insert(j, e.finish)
            self._blocks.insert(j, self._load_blocks(e.finish))  # e is counted: it is alive at its finish
        self._peak = None

    def remove(self, e: Entry) -> None:
        """Forget one request added before (an equal entry); ValueError if there is none."""
        if e.growing:
            fin, values, value = self._grow_finish, self._grow_offset, e.offset
        else:
            fin, values, value = self._const_finish, self._const_blocks, self._const_of(e)
        i = self._index_of(e, fin, values, value)
        del fin[i], values[i]
        j = bisect_left(self.points, e.finish)
        self._shift(e, j + 1, -1)
        if not self._finishes_at(e.finish):
            del self.points[j], self._blocks[j]
        self._peak = None

    def _index_of(self, e: Entry, fin: list[int], values: list[int], value: int) -> int:
        return values.index(value, bisect_left(fin, e.finish), bisect_right(fin, e.finish))

    def _const_of(self, e: Entry) -> int:
        """Blocks of an entry counted at its final weight (not growing)."""
        return -(-e.final // self.block)

    def _shift(self, e: Entry, j: int, sign: int) -> None:
        """Add (sign 1) or take away (-1) `e`'s blocks at the first j points, all of which it lives through."""
        blocks, b = self._blocks, self.block
        if not e.growing:
            w = sign * self._const_of(e)
            blocks[:j] = [x + w for x in blocks[:j]]
            return
        c = e.offset + b - 1  # blocks held at step p: ceil((offset + p) / b) = (c + p) // b
        if sign > 0:
            blocks[:j] = [x + (c + p) // b for x, p in zip(blocks[:j], self.points[:j], strict=True)]
        else:
            blocks[:j] = [x - (c + p) // b for x, p in zip(blocks[:j], self.points[:j], strict=True)]

    def _finishes_at(self, step: int) -> bool:
        return any(bisect_right(fin, step) > bisect_left(fin, step) for fin in (self._grow_finish, self._const_finish))

    # ----- queries --------------------------------------------------------------------------------
    def peak(self) -> int:
        """The highest weight the running set will reach."""
        return self._peak_blocks() * self.block

    def _peak_blocks(self) -> int:
        if self._peak is None:
            self._peak = max(self._blocks, default=0)
        return self._peak

    def load_at(self, step: int) -> int:
        """Exact projected weight at an absolute step."""
        return self._load_blocks(step) * self.block

    def _load_blocks(self, step: int) -> int:
        """Blocks held at `step` by the entries still alive then (O(alive), in C)."""
        b = self.block
        offsets = self._grow_offset[bisect_left(self._grow_finish, step) :]
        if b == 1:
            grow = sum(offsets) + len(offsets) * step
        else:
            grow = sum(map(floordiv, map(add, offsets, repeat(step + b - 1)), repeat(b)))
        return grow + sum(self._const_blocks[bisect_left(self._const_finish, step) :])

    def admits(self, c: Entry, budget: int) -> bool:
        """Would the weight stay within budget at every future step with `c` added?"""
        cap = budget // self.block  # weights are whole blocks
        own = self._final_of(c)  # the candidate's blocks at its finish, its most
        peak = self._peak_blocks()
        if peak + own <= cap:
            return True
        points, blocks = self.points, self._blocks
        j = bisect_right(points, c.finish)  # points[:j] are the finish points the candidate lives through
        if peak > cap and max(blocks[j:], default=0) > cap:
            return False
        if not self._fits_while_alive(c, j, cap, own):
            return False
        if j and points[j - 1] == c.finish:
            return True  # the candidate's own finish point was among those checked
        if j == len(points):
            return own <= cap
        if blocks[j] + own <= cap:
            return True  # the next point has the same alive set, each grown further: its load bounds this one
        return self._load_blocks(c.finish) + own <= cap

    def admits_sharing(self, c: Entry, new: int, extended: list[int], budget: int) -> bool:
        """admits() for a candidate that holds cached prefix blocks besides its own (`c`): `new` of them
        no running request holds (they load every step the candidate lives), and the others' last
        holders finish at the steps in `extended` (ascending), before the candidate: their blocks stay
        loaded from there until it finishes. Exact: one pass over the points it lives through."""
        cap = budget // self.block
        own_final = self._final_of(c)
        if self._peak_blocks() + own_final + new + len(extended) <= cap:
            return True
        points, blocks = self.points, self._blocks
        j = bisect_right(points, c.finish)
        if max(blocks[j:], default=0) > cap:
            return False
        k = 0
        for p, x in zip(points[:j], blocks[:j], strict=True):
            while k < len(extended) and extended[k] < p:
                k += 1  # that block's last holder has finished by p: the candidate keeps it loaded
            if x + (self._cand_at(c, p) if c.growing else own_final) + new + k > cap:
                return False
        if j and points[j - 1] == c.finish:
            return True
        return self._load_blocks(c.finish) + own_final + new + len(extended) <= cap

    def _fits_while_alive(self, c: Entry, j: int, cap: int, own: int) -> bool:
        """Does `c` fit at each of the first j points (those it lives through)? It holds at most `own`
        blocks at any of them, so room for that at every point settles it without a pass."""
        blocks = self._blocks[:j]
        if max(blocks, default=0) + own <= cap:
            return True
        if not c.growing:
            return False
        return all(x + self._cand_at(c, p) <= cap for x, p in zip(blocks, self.points[:j], strict=True))

    def _final_of(self, c: Entry) -> int:
        """A candidate's blocks at its finish (its most)."""
        return -(-c.final // self.block)

    def _cand_at(self, c: Entry, p: int) -> int:
        """A growing candidate's blocks at step p."""
        return -(-(c.offset + p) // self.block)


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
        ents = sorted(self._entries, key=_finish)
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


def _finish(e: Entry) -> int:
    return e.finish


def _suffix_max(values: list[int]) -> list[int]:
    """out[j] = max(values[j:]), with out[len] = 0."""
    out = list(accumulate(reversed(values), max))
    out.reverse()
    out.append(0)
    return out


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
        b = self.block
        n = self._full * -(-tokens // b)
        w = -(-(tokens + extra) // b)
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
        b, full = self.block, self._full
        co, cw = offset + b - 1, offset + extra + b - 1
        if len(self._windows) == 1:
            (pages, ring), cap = self._windows[0], self._windows[0][1] * b - cw
            return [full * ((co + p) // b) + pages * ((cw + p) // b if p < cap else ring) for p in points]
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
        b, full = self.block, self._full
        offsets, extras = self._grow_offset[i:], self._grow_extra[i:]
        grow = full * sum((o + step + b - 1) // b for o in offsets)
        for pages, ring in self._windows:
            cw = step + b - 1
            grow += pages * sum(min((o + x + cw) // b, ring) for o, x in zip(offsets, extras, strict=True))
        return grow + sum(self._const_blocks[bisect_left(self._const_finish, step) :])
