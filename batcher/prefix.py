"""The prefix cache's side of the weight: a cached block counts once, however many requests hold it.

A held cached block weighs one block until its last holder finishes. In the projection it is charged
to that holder (its anchor: the holder whose projected finish is latest) as part of a constant entry
at the anchor's finish, so the projection stays exact: the block is counted at every step up to its
last use and never twice. Holders of a chain of keys are nested (whoever holds block i+1 of a prefix
holds block i), so keys with as many holders have the same holders, and re-anchoring after a holder
leaves scans the holders once per distinct count, not once per key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class SharedBlocks:
    """Holders and anchors of every cached block some running request holds."""

    def __init__(self) -> None:
        self._holders: dict[bytes, dict[str, None]] = {}
        self._anchor: dict[bytes, str] = {}
        self.keys: dict[str, list[bytes]] = {}  # each holder's keys: the leading blocks of its prompt
        self.anchored: dict[str, int] = {}  # how many held blocks each holder is charged with

    @property
    def held_blocks(self) -> int:
        """Distinct cached blocks held by running requests."""
        return len(self._holders)

    def plan(self, keys: Iterable[bytes], finish: int, finish_of: Callable[[str], int]) -> tuple[int, list[int]]:
        """What a candidate finishing at `finish` and holding `keys` would add: the number of keys no
        one holds (new load), and, ascending, the finish steps of the anchors it would outlive (their
        blocks' load is extended up to `finish`)."""
        new = 0
        extended: list[int] = []
        for key in keys:
            a = self._anchor.get(key)
            if a is None:
                new += 1
            else:
                f = finish_of(a)
                if f < finish:
                    extended.append(f)
        extended.sort()
        return new, extended

    def join(self, rid: str, keys: Iterable[bytes], finish_of: Callable[[str], int]) -> set[str]:
        """`rid` holds `keys` too (after those it holds); returns the holders whose charge changed."""
        changed: set[str] = set()
        mine = self.keys.setdefault(rid, [])
        finish = finish_of(rid)
        for key in keys:
            mine.append(key)
            self._holders.setdefault(key, {})[rid] = None
            a = self._anchor.get(key)
            if a is None or finish_of(a) < finish:
                self._move(key, a, rid, changed)
        return changed

    def leave(self, rid: str, finish_of: Callable[[str], int]) -> tuple[set[str], int]:
        """`rid` holds nothing any more: its blocks go to their next-longest holder. Returns the holders
        whose charge changed and how many blocks no one holds now."""
        changed: set[str] = set()
        freed = 0
        best: tuple[int, str] | None = None  # (holder count, anchor) of the last re-anchored key
        for key in reversed(self.keys.pop(rid, [])):  # holder sets grow towards the first key
            hs = self._holders[key]
            del hs[rid]
            if not hs:
                del self._holders[key], self._anchor[key]
                freed += 1
            elif self._anchor[key] == rid:
                if best is None or best[0] != len(hs):
                    best = (len(hs), max(hs, key=finish_of))
                self._move(key, None, best[1], changed)
        self.anchored.pop(rid, None)
        changed.discard(rid)
        return changed, freed

    def refinish(self, rid: str, old: int, finish_of: Callable[[str], int]) -> set[str]:
        """`rid`'s projected finish moved from `old` (finish_of gives the new one): blocks it outlives
        now come to it, blocks another holder outlives it on go to that holder."""
        changed: set[str] = set()
        new = finish_of(rid)
        best: tuple[int, str] | None = None
        for key in reversed(self.keys.get(rid, [])):
            a = self._anchor[key]
            if a != rid:
                if finish_of(a) < new:
                    self._move(key, a, rid, changed)
            elif new < old:
                hs = self._holders[key]
                if best is None or best[0] != len(hs):
                    best = (len(hs), max(hs, key=finish_of))
                if best[1] != rid and finish_of(best[1]) > new:
                    self._move(key, rid, best[1], changed)
        return changed

    def _move(self, key: bytes, old: str | None, new: str, changed: set[str]) -> None:
        if old is not None:
            self.anchored[old] -= 1
            changed.add(old)
        self._anchor[key] = new
        self.anchored[new] = self.anchored.get(new, 0) + 1
        changed.add(new)

    def check(self, finish_of: Callable[[str], int]) -> None:
        """Invariants (tests): every held key's anchor is a holder with the latest finish."""
        for key, hs in self._holders.items():
            a = self._anchor[key]
            assert a in hs, "a block's anchor does not hold it"
            assert finish_of(a) == max(finish_of(h) for h in hs), "a block is charged to a holder that finishes early"
        assert sum(self.anchored.values()) == len(self._holders), "charges disagree with the held blocks"
