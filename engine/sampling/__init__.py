"""Choosing each step's tokens: the sampler (sampler.py: masks, penalties, temperature, top-k/p, seeded
draws, log-probabilities) and structured output (grammar.py; grammar_trial.py compiles a grammar
not seen before in a killable process first)."""

from .sampler import RowLogprobs, sample, seeded_uniform

__all__ = ["RowLogprobs", "sample", "seeded_uniform"]
