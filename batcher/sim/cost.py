"""The simulator's step-cost model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds one engine step takes: fixed + per_token x tokens fed + per_kv_token x KV tokens read.

    fixed_s is the cost of reading the weights once (memory-bound decode), per_token_s the compute
    per token fed (prefill chunks and one token per decoding sequence), per_kv_token_s the attention
    reads. The defaults are roughly a 7B model on one A100-class GPU: a decode step at batch 64 and
    context 500 takes ~21 ms, a 512-token prefill ~39 ms. Override them with `weightq sim --step-cost`.
    """

    fixed_s: float = 0.008
    per_token_s: float = 6e-5
    per_kv_token_s: float = 3e-7

    def __call__(self, tokens: int, kv_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens + self.per_kv_token_s * kv_tokens

    @classmethod
    def parse(cls, text: str) -> StepCost:
        """'fixed,per_token,per_kv_token' in seconds, e.g. '0.008,6e-5,3e-7'."""
        parts = [float(x) for x in text.split(",")]
        if len(parts) != 3 or min(parts) < 0:
            raise ValueError(f"--step-cost wants three non-negative numbers 'fixed,per_token,per_kv', got {text!r}")
        return cls(*parts)
