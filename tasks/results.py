"""The two sides of a job's outputs that the contract names without importing the engine: what a
result is built from (the engine's FinishEvent has these fields), and a token entry's log-probabilities
as a reader gets them back."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol


class TokenLogprobs(NamedTuple):
    """A token entry's "lp" field, read back: the token's log-probability under the model (None for a
    prompt's first token) and its most likely alternatives, best first, each as its own text."""

    token: str
    logprob: float | None
    top_ids: tuple[int, ...]
    top_tokens: tuple[str, ...]
    top_logprobs: tuple[float, ...]

    @classmethod
    def from_json(cls, raw: str) -> TokenLogprobs:
        token, logprob, ids, tokens, values = json.loads(raw)
        return cls(token, logprob, tuple(ids), tuple(tokens), tuple(values))


class Finished(Protocol):
    """What a result is made of: the engine's FinishEvent has these (the contract imports no engine)."""

    request_id: str
    reason: str
    text: str
    token_ids: Sequence[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_s: float
    ttft_s: float
    total_s: float
    logprobs: Sequence[Any] | None  # each with as_json(): the "lp" list
    prompt_logprobs: Sequence[Any] | None
    prompt_token_ids: Sequence[int] | None
