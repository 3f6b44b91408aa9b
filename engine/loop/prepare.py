"""A request checked against what this engine can do and made a Sequence, on the caller's thread
(or the grammar thread): everything that can refuse it refuses here, naming the field, before it
reaches the batcher."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightq.batcher import Batcher, Request, chain_keys

from ..model import LoadedModel
from ..params import FinishEvent, FinishReason, GenerationRequest, InvalidRequest
from ..sampling.grammar import Grammars
from ..sequence import Sequence
from ..text.detokenizer import IncrementalDetokenizer, StopMatcher
from ..text.prompt import prompt_ids
from .outputs import replay


@dataclass(frozen=True, slots=True)
class Preparer:
    lm: LoadedModel
    model_name: str
    runner: Any  # its prompt_logprobs flag: whether it can score prompts
    batcher: Batcher
    grammars: Grammars
    logits_width: int
    max_input_length: int
    finish_event: Callable[[Sequence, FinishReason], FinishEvent]

    def __call__(self, request: GenerationRequest, now: float) -> Sequence | FinishEvent:
        """The request's Sequence; or, for a resumed request whose earlier run's tokens already end
        it, its finish event."""
        params, tokenizer = request.params, self.lm.tokenizer
        ids = prompt_ids(tokenizer, self.model_name, request)
        if not ids:
            raise InvalidRequest("prompt", "must not be empty")
        vocab = len(tokenizer)
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest("stop_token_ids", f"every id must be an integer in [0, {vocab})")
        if params.prompt_logprobs is not None and not self.runner.prompt_logprobs:
            raise InvalidRequest("prompt_logprobs", f"not available on the {self.lm.runner} runner")
        if any(t >= self.logits_width for t, _ in params.logit_bias):
            raise InvalidRequest("logit_bias", f"every key must be a token id in [0, {self.logits_width})")
        if len(ids) > self.max_input_length:
            raise InvalidRequest("prompt", f"{len(ids)} tokens exceeds max_input_length {self.max_input_length}")
        lora = self.runner.lora
        if request.adapter and (lora is None or request.adapter not in lora.accepting):
            served = ", ".join(lora.adapters) if lora is not None and lora.adapters else "none"
            raise InvalidRequest("model", f"adapter {request.adapter[:64]!r} is not loaded here (adapters: {served})")
        batcher = self.batcher
        # An encoder-decoder's input is its encoder's: padded on its own, the batcher's fixed part.
        fixed = len(ids) if self.lm.seq2seq else 0
        # None: until the context limit, as OpenAI's chat API runs (predictive admission reserves
        # the expected length, not all of it)
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = batcher.config.max_total_tokens - len(ids)
        sched = Request(
            request.id,
            len(ids),
            max_new,
            arrival_s=now,
            submitted_s=None if request.submitted_s is None else now - max(0.0, time.time() - request.submitted_s),
            fixed_len=fixed,
            priority=request.priority,
            tenant=request.tenant,
            adapter=request.adapter,
        )
        sched.runs_to_max = params.ignore_eos and not params.stop and not params.stop_token_ids
        ledger = batcher.ledger
        if ledger is not None and ledger.caching and params.prompt_logprobs is None:
            # prompt log-probabilities need every prompt position's logits: computed, never cached
            # an adapter's KV differs from the base's: its blocks are its own
            salt = request.cache_salt + ("\0" + request.adapter if request.adapter else "")
            sched.prefix = chain_keys(ids, ledger.block_size, salt.encode())
        batcher.check(sched)
        seq = Sequence(request, sched, ids, len(ids), IncrementalDetokenizer(tokenizer), StopMatcher(params.stop), now)
        if params.guided is not None:
            seq.grammar = self.grammars.guide(params.guided)  # compiled here, on the caller's thread
        if request.emitted:
            if any(not 0 <= t < self.logits_width for t in request.emitted):
                raise InvalidRequest("emitted", f"every id must be a token id in [0, {self.logits_width})")
            ended = replay(seq, request.emitted, request.emitted_logprobs, self.lm.eos_token_ids)
            if ended is not None:
                return self.finish_event(seq, ended)
        return seq
