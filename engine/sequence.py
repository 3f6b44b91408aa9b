"""The engine's state for one request: its tokens, blocks, sampling and text so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightq.batcher import Request

from .params import FinishReason, GenerationRequest, SamplingParams, TokenLogprobs
from .text.detokenizer import IncrementalDetokenizer, StopMatcher


@dataclass(slots=True, eq=False)
class Sequence:
    request: GenerationRequest
    sched: Request  # the batcher's view: lengths and progress
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    submitted_s: float
    text: str = ""
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # per prompt token, when asked
    grammar: Any = None  # structured output: its grammar.Guide, advanced with each token
    extras: Any = None  # its sampling extras as tensors (sampling.RowExtras), made at its first step

    @property
    def block_table(self) -> list[int]:
        """Its KV blocks, as the batcher handed them out."""
        return self.sched.block_table

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]
