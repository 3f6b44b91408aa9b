"""The admission policies the simulator compares, all at the same KV budget.

static:     a fixed max_batch_size sized for the worst case (budget // max_total_tokens), FIFO.
tgi:        upstream TGI's rule: sum of (input + max_new_tokens) within the budget, strict FIFO.
optimistic: admits on current usage; preempts the newest (recompute) before a step whose growth
            would not fit, as vLLM does when the next token's block cannot be allocated.
weighted:   exact projection, bounded jumping, prefill cap (the default batcher).
predictive: reserves an estimated output length; grows reservations, preempting if they cannot grow.
oracle:     exact projection with every true output length known (an upper bound).
Each is a strategy (Policy) of the same Batcher and admission walk, which only decides whether a
candidate fits and whether the newest are preempted before a step.
"""

from __future__ import annotations

from dataclasses import replace

from ..admission import PROJECTED, Policy
from ..batcher import Batcher
from ..config import BatcherConfig

# vLLM's scheduler: a request whose next token's block cannot be allocated preempts the newest running
# one; like vLLM it never runs a step over the budget, and pays for it in recomputed tokens
OPTIMISTIC = Policy("optimistic", "current", preempts_to_fit=True)
NAIVE_SUM = Policy("tgi", "sum")  # upstream TGI's rule


def static_batcher(config: BatcherConfig, *, blocks: bool = False) -> Batcher:
    """The static policy at `config`'s budget: a fixed number of slots, sized for the worst case. In the
    simulator nothing bounds its blocks (it counts overflows); a real engine (`blocks`) needs them
    allocated: slots x max_total_tokens fit."""
    cfg = replace(config, jump_window_s=0.0, mode="worst_case").resolved()
    slots = cfg.max_batch_weight // cfg.max_total_tokens  # type: ignore[operator]
    return Batcher(cfg, Policy("static", "count", slots), pages=blocks)


POLICIES = ("static", "tgi", "optimistic", "weighted", "predictive", "oracle")


def make_batcher(policy: str, config: BatcherConfig) -> Batcher:
    """The oracle is the weighted batcher fed max_new_tokens = true length (see simulator)."""
    if policy == "static":
        return static_batcher(config)
    if policy == "tgi":
        return Batcher(replace(config, jump_window_s=0.0, mode="worst_case"), NAIVE_SUM)
    if policy == "optimistic":
        return Batcher(replace(config, jump_window_s=0.0, mode="worst_case"), OPTIMISTIC)
    if policy in ("weighted", "oracle"):
        return Batcher(replace(config, mode="worst_case"), PROJECTED)
    if policy == "predictive":
        return Batcher(replace(config, mode="predictive"), PROJECTED)
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
