"""What a caller asks of one generation, and what the engine reports back.

The engine takes a request as valid: the worker builds it (`engine_request`) from a job request the
contract checked (`JobRequest`). It refuses only what needs the model: token ids outside the
vocabulary, a prompt too long in tokens, a grammar that does not compile (InvalidRequest), and what
the batcher cannot fit (RequestRejected).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from weightq.batcher import DEFAULT_PRIORITY, RequestRejected

FinishReason = Literal["length", "stop", "eos", "cancelled", "error"]


# Temperatures below this are greedy, as vLLM's (tasks/limits.py keeps the same floor: a test checks):
# float32 logits divided by 1e-45 overflow and sampled the least likely token.
GREEDY_BELOW = 1e-5


class InvalidRequest(RequestRejected):
    """A request the engine refuses; `field` names the offending field (as the batcher's refusals do)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 are off; a seed makes sampling reproducible
    whatever else shares the batch. Within the contract's limits (tasks/limits.py); the defaults serve
    callers of the engine itself (the worker sets every field)."""

    max_new_tokens: int | None = 64  # None: until the context limit (max_total_tokens less the prompt)
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
            self.temperature < GREEDY_BELOW
            and self.repetition_penalty == 1.0
            and not (self.presence_penalty or self.frequency_penalty or self.logit_bias or self.min_tokens)
            and self.guided is None
        )


@dataclass(slots=True)
class GenerationRequest:
    """One generation: a prompt (text or token ids) and its sampling parameters."""

    id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    messages: list[dict[str, str]] | None = None  # a chat, rendered with the tokenizer's chat template
    priority: int = DEFAULT_PRIORITY  # its class, 0-9: higher is admitted first (batcher/admission.py)
    tenant: str = ""  # who it is for: tenants share a class by service received (batcher/fairness.py)
    # A resumed run: the output tokens an earlier run emitted, and their log-probabilities when it
    # reported them. The engine prefills them with the prompt and continues at the next index.
    emitted: list[int] = field(default_factory=list)
    emitted_logprobs: list[TokenLogprobs] | None = None
    # Salts its prompt's prefix-cache keys: requests find only the cached blocks of prompts with the
    # same salt (the worker gives each tenant its own; "" shares the cache with every unsalted request).
    cache_salt: str = ""
    # unix seconds: still waiting for admission then, it ends unrun with a "deadline: ..." error
    deadline: float | None = None
    # unix seconds it was submitted (a job's queue time): its place among the waiting requests counts from
    # then, not from when the engine received it, which for a batch of messages is thread order
    submitted_s: float | None = None
    # the LoRA adapter it runs with ("" the base model): one of the engine's (EngineConfig.lora_modules)
    adapter: str = ""


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
