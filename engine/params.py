"""What a caller asks of one generation, and what the engine reports back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from batcher import RequestRejected

FinishReason = Literal["length", "stop", "eos", "cancelled", "error"]


class InvalidRequest(RequestRejected):
    """A request the engine refuses; `field` names the offending field (as the batcher's refusals do)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 are off; a seed makes sampling reproducible
    whatever else shares the batch."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # token ids that end the request when sampled (finish reason "stop"): the id is kept in token_ids, its
    # text is not emitted (as vLLM does); ignore_eos does not apply to them
    stop_token_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        def finite(name: str, value: float) -> None:
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidRequest(name, f"must be a finite number (got {value!r})")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens", f"must be an integer >= 1 (got {self.max_new_tokens!r})")
        finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0 (got {self.temperature})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("top_k", f"must be an integer >= 0 (got {self.top_k!r})")
        finite("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1] (got {self.top_p})")
        finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty", f"must be > 0 (got {self.repetition_penalty})")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidRequest("seed", f"must be an integer in [0, 2**63) (got {self.seed!r})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop", "every stop sequence must be a non-empty string")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids", "every entry must be a non-negative integer")


@dataclass(slots=True)
class GenerationRequest:
    """One generation: a prompt (text or token ids) and its sampling parameters."""

    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    messages: list[dict[str, str]] | None = None  # a chat, rendered with the tokenizer's chat template


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    index: int  # 0-based position of the token in the output
    token_id: int
    text: str  # the new text this token completes (may be "" while a character or stop is pending)


@dataclass(frozen=True, slots=True)
class FinishEvent:
    request_id: str
    reason: FinishReason
    text: str  # the whole output: the concatenation of every TokenEvent's text
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    queue_s: float  # submission to first admission
    ttft_s: float  # submission to first token
    total_s: float
    error: str | None = None


Event = TokenEvent | FinishEvent
