"""One request's projected weight, in absolute steps (see the package docstring)."""

from __future__ import annotations

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


def finish_of(e: Entry) -> int:
    return e.finish
