"""Weight models: how many units of KV memory a set of sequences occupies.

token:  paged/flash attention. Each sequence holds its tokens rounded up to the KV block size; with
        attention kinds (engine/runner/kv_cache.py: full layers and sliding-window layers), a window kind
        holds at most its ring of blocks, so a sequence's weight grows with its context until every
        window is full, then with its full layers alone. Either way it never decreases until the
        request finishes, which is what keeps the projection's peaks at finish steps.
padded: regular attention over a left-padded batch. Every row is as long as the longest context,
        so the batch weighs batch_size x longest context. An encoder-decoder row holds two padded
        parts, its encoder states (`fixed`, padded to the longest) and its decoder cache (padded to the
        longest): batch_size x (longest fixed + longest rest).
The admission code is the same for both; only these functions differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from .projection import Entry, HybridProfile, PaddedProfile, TokenProfile, ceil_to

Kinds = tuple[tuple[int, int], ...]  # per attention kind: (pages per block, ring blocks; 0 for full)
UNIFORM: Kinds = ((1, 0),)  # every layer full: one page per block of the context


class TokenWeight:
    """Weight in slots: pages x block_size. A full kind (at most one, first) has one page per block of
    the context, less the cached blocks a request shares; a window kind of `pages` pages per block
    keeps at most `ring` blocks."""

    name = "token"

    def __init__(self, block_size: int = 1, kinds: Kinds = UNIFORM) -> None:
        self.block_size = block_size
        self.kinds = kinds
        self.full_pages = kinds[0][0] if kinds and kinds[0][1] == 0 else 0
        self.windows = tuple((pages, ring) for pages, ring in kinds if ring)
        self.uniform = not self.windows and self.full_pages == 1

    def pages(self, tokens: int, shared: int = 0) -> int:
        """Pages a sequence of `tokens` holds, less its `shared` leading cached (full) blocks."""
        blocks = -(-tokens // self.block_size)
        n = self.full_pages * (blocks - shared)
        for pages, ring in self.windows:
            n += pages * min(blocks, ring)
        return n

    def seq(self, tokens: int) -> int:
        if self.uniform:
            return ceil_to(tokens, self.block_size)
        return self.pages(tokens) * self.block_size

    def own(self, tokens: int, shared: int) -> int:
        """A request's own weight: its sequence less the cached blocks it shares (charged apart)."""
        return self.pages(tokens, shared) * self.block_size

    def batch(self, lengths: Sequence[int], fixed: Sequence[int] = ()) -> int:
        bs = self.block_size
        if self.uniform:
            return sum(-(-n // bs) for n in lengths) * bs
        return sum(self.pages(n) for n in lengths) * bs

    def prefill(self, count: int, longest: int, total: int) -> int:
        """Prefill weight of `count` prompt chunks: the tokens actually computed."""
        return total

    def profile(self, entries: list[Entry]) -> TokenProfile:
        if self.uniform:
            return TokenProfile(entries, self.block_size)
        return HybridProfile(entries, self.block_size, self.kinds)


class PaddedWeight:
    name = "padded"
    block_size = 1
    windows: tuple[tuple[int, int], ...] = ()  # no attention kinds: a padded row is the model's own cache
    uniform = True

    def seq(self, tokens: int) -> int:
        return tokens

    def own(self, tokens: int, shared: int) -> int:
        return tokens  # nothing is shared in a padded batch

    def batch(self, lengths: Sequence[int], fixed: Sequence[int] = ()) -> int:
        if not any(fixed):
            return len(lengths) * max(lengths, default=0)
        rest = max(n - f for n, f in zip(lengths, fixed, strict=True))
        return len(lengths) * (max(fixed) + rest)

    def prefill(self, count: int, longest: int, total: int) -> int:
        """A padded prefill computes every row at the longest prompt's length."""
        return count * longest

    def profile(self, entries: list[Entry]) -> PaddedProfile:
        return PaddedProfile(entries)


def weight_model(name: str, block_size: int = 1, kinds: Kinds = UNIFORM) -> TokenWeight | PaddedWeight:
    return TokenWeight(block_size, kinds) if name == "token" else PaddedWeight()
