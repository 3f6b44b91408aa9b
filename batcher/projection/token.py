"""The token weight model's profile: the running set's exact load, in KV blocks, at every finish point."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from itertools import repeat
from operator import add, floordiv, sub

from .entry import Entry, finish_of


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
        ents = sorted(entries, key=finish_of)
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
        bs = self.block
        residues = [0] * bs
        quotients = growing = const = 0
        loads: list[int] = []
        i = len(ents) - 1
        for p in reversed(self.points):
            while i >= 0 and ents[i].finish >= p:
                e = ents[i]
                i -= 1
                if e.growing:
                    q, m = divmod(e.offset, bs)
                    quotients, growing = quotients + q, growing + 1
                    residues[m] += 1
                else:
                    const += -(-e.final // bs)
            loads.append(quotients + growing * -(-p // bs) + sum(residues[-p % bs + 1 :]) + const)
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
        blocks, bs = self._blocks, self.block
        if not e.growing:
            w = sign * self._const_of(e)
            blocks[:j] = [x + w for x in blocks[:j]]
            return
        c = e.offset + bs - 1  # blocks held at step p: ceil((offset + p) / bs) = (c + p) // bs
        held = map(floordiv, map(add, self.points[:j], repeat(c)), repeat(bs))  # map chains: in C, not bytecode
        blocks[:j] = map(add if sign > 0 else sub, blocks[:j], held)

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
        bs = self.block
        offsets = self._grow_offset[bisect_left(self._grow_finish, step) :]
        if bs == 1:
            grow = sum(offsets) + len(offsets) * step
        else:
            grow = sum(map(floordiv, map(add, offsets, repeat(step + bs - 1)), repeat(bs)))
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
        held = map(floordiv, map(add, self.points[:j], repeat(c.offset + self.block - 1)), repeat(self.block))
        return max(map(add, blocks, held), default=0) <= cap

    def _final_of(self, c: Entry) -> int:
        """A candidate's blocks at its finish (its most)."""
        return -(-c.final // self.block)

    def _cand_at(self, c: Entry, p: int) -> int:
        """A growing candidate's blocks at step p."""
        return -(-(c.offset + p) // self.block)
