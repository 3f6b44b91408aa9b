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

from ..admission import Projected, naive_fits
from ..batcher import Batcher
from ..config import BatcherConfig
from ..request import Request


class Static:
    """A fixed number of slots, sized for the worst case: it admits by count, not weight."""

    name, preempts_to_fit = "static", False

    def __init__(self, slots: int) -> None:
        self.slots = slots

    def fits(self, batcher: Batcher, req: Request, chunk: int, ahead: int, limit: int) -> tuple[bool, bool]:
        return len(batcher.running) < self.slots, False


class NaiveSum:
    """Upstream TGI's rule: the sum of every final weight within the budget."""

    name, preempts_to_fit = "tgi", False

    def fits(self, batcher: Batcher, req: Request, chunk: int, ahead: int, limit: int) -> tuple[bool, bool]:
        return naive_fits(batcher, req.reserved_total, 0, limit), False


class Optimistic:
    """Admits on current usage; before a step whose growth would not fit, the newest are preempted (vLLM's
    scheduler: a request whose next token's block cannot be allocated preempts the newest running one).
    Like vLLM it never runs a step over the budget, and pays for it in recomputed tokens."""

    name, preempts_to_fit = "optimistic", True

    def fits(self, batcher: Batcher, req: Request, chunk: int, ahead: int, limit: int) -> tuple[bool, bool]:
        # like vLLM, the running requests' next slots are allocated before a waiting prompt's blocks
        used = batcher.weight.batch([r.context_len + 1 for r in batcher.running.values()] + [req.context_len + 1])
        return used <= batcher.budget, False


def static_batcher(config: BatcherConfig, *, blocks: bool = False) -> Batcher:
    """The static policy at `config`'s budget. In the simulator nothing bounds its blocks (it counts
    overflows); a real engine (`blocks`) needs them allocated: slots x max_total_tokens fit."""
    cfg = replace(config, jump_window_s=0.0).resolved()
    return Batcher(cfg, Static(cfg.max_batch_weight // cfg.max_total_tokens), pages=blocks)  # type: ignore[operator]


POLICIES = ("static", "tgi", "optimistic", "weighted", "predictive", "oracle")


def make_batcher(policy: str, config: BatcherConfig) -> Batcher:
    """The oracle is the weighted batcher fed max_new_tokens = true length (see simulator)."""
    if policy == "static":
        return static_batcher(config)
    if policy == "tgi":
        return Batcher(replace(config, jump_window_s=0.0, mode="worst_case"), NaiveSum())
    if policy == "optimistic":
        return Batcher(replace(config, jump_window_s=0.0, mode="worst_case"), Optimistic())
    if policy in ("weighted", "oracle"):
        return Batcher(replace(config, mode="worst_case"), Projected())
    if policy == "predictive":
        return Batcher(replace(config, mode="predictive"), Projected())
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
