"""Weight models: how many units of KV memory a set of sequences occupies.

token:  paged/flash attention. Each sequence holds its tokens rounded up to the KV block size.
padded: regular attention over a left-padded batch. Every row is as long as the longest context,
        so the batch weighs batch_size x longest context. An encoder-decoder row holds two padded
        parts, its encoder states (`fixed`, padded to the longest) and its decoder cache (padded to the
        longest): batch_size x (longest fixed + longest rest).
The admission code is the same for both; only these functions differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from .projection import Entry, PaddedProfile, TokenProfile, ceil_to


class TokenWeight:
    name = "token"

    def __init__(self, block_size: int = 1) -> None:
        self.block_size = block_size

    def seq(self, tokens: int) -> int:
        return ceil_to(tokens, self.block_size)

    def batch(self, lengths: Sequence[int], fixed: Sequence[int] = ()) -> int:
        b = self.block_size
        return sum(-(-n // b) for n in lengths) * b

    def prefill(self, count: int, longest: int, total: int) -> int:
        """Prefill weight of `count` prompt chunks: the tokens actually computed."""
        return total

    def profile(self, entries: list[Entry]) -> TokenProfile:
        return TokenProfile(entries, self.block_size)


class PaddedWeight:
    name = "padded"
    block_size = 1

    def seq(self, tokens: int) -> int:
        return tokens

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


def weight_model(name: str, block_size: int = 1) -> TokenWeight | PaddedWeight:
    return TokenWeight(block_size) if name == "token" else PaddedWeight()
