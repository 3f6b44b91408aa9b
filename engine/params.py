"""What a caller asks of one generation, and what the engine reports back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from weightq.batcher import RequestRejected

GUIDED_KINDS = ("json_schema", "json_object", "regex")
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
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
    # OpenAI's, over the output so far: logit -= count * frequency_penalty + (count > 0) * presence_penalty
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens are out
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first has none)
    # structured output: (kind, spec) with kind json_schema (spec: the schema as JSON), json_object or
    # regex; decoding is constrained to the grammar, and the request ends when it is complete
    guided: tuple[str, str] | None = None

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits: nothing to adjust or draw."""
        return (
            self.temperature == 0
            and self.repetition_penalty == 1.0
            and not (self.presence_penalty or self.frequency_penalty or self.logit_bias or self.min_tokens)
            and self.guided is None
        )

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
        for name in ("presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(name, f"must be in [-2, 2] (got {getattr(self, name)})")
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise InvalidRequest("logit_bias", f"keys must be token ids (got {tok!r})")
            finite("logit_bias", bias)
            if not -100 <= bias <= 100:
                raise InvalidRequest("logit_bias", f"values must be in [-100, 100] (got {bias})")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequest("min_tokens", f"must be an integer in [0, max_new_tokens] (got {self.min_tokens!r})")
        if self.guided is not None:
            if not (isinstance(self.guided, tuple) and len(self.guided) == 2 and self.guided[0] in GUIDED_KINDS):
                raise InvalidRequest("guided", f"must be one of {', '.join(GUIDED_KINDS)}")
            if self.ignore_eos or self.min_tokens:
                raise InvalidRequest("guided", "cannot be combined with ignore_eos or min_tokens (the grammar ends it)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequest(name, f"must be an integer in [0, {MAX_LOGPROBS}] (got {k!r})")


DEFAULT_PRIORITY = 5  # the class of a request that names none; lower classes leave the priority headroom


@dataclass(slots=True)
class GenerationRequest:
    """One generation: a prompt (text or token ids) and its sampling parameters."""

    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    messages: list[dict[str, str]] | None = None  # a chat, rendered with the tokenizer's chat template
    priority: int = DEFAULT_PRIORITY  # its class, 0-9: higher is admitted first (batcher/admission.py)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token's log-probability under the model (log_softmax of the raw logits) and the most likely
    alternatives', best first. `token` and `top_tokens` are each token's own text, decoded alone."""

    token: str
    logprob: float | None  # None for a prompt's first token: nothing predicts it
    top_ids: tuple[int, ...] = ()
    top_tokens: tuple[str, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    def as_json(self) -> list:
        return [self.token, self.logprob, list(self.top_ids), list(self.top_tokens), list(self.top_logprobs)]

    @classmethod
    def from_json(cls, v: list) -> TokenLogprobs:
        return cls(v[0], v[1], tuple(v[2]), tuple(v[3]), tuple(v[4]))


@dataclass(frozen=True, slots=True)
class TokenEvent:
    request_id: str
    index: int  # 0-based position of the token in the output
    token_id: int
    text: str  # the new text this token completes (may be "" while a character or stop is pending)
    logprobs: TokenLogprobs | None = None  # when the request asks for them


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
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per output token, when the request asks
    # one per prompt token (the first has no logprob: nothing predicts it), when the request asks
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # with prompt_logprobs
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission (not computed)


Event = TokenEvent | FinishEvent
