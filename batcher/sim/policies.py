"""The admission policies the simulator compares, all at the same KV budget.

static:     a fixed max_batch_size sized for the worst case (budget // max_total_tokens), FIFO.
tgi:        upstream TGI's rule: sum of (input + max_new_tokens) within the budget, strict FIFO.
optimistic: admits on current usage; preempts the newest (recompute) before a step whose growth
            would not fit, as vLLM does when the next token's block cannot be allocated.
weighted:   exact projection, bounded jumping, prefill cap (the default batcher).
predictive: reserves an estimated output length; grows reservations, preempting if they cannot grow.
oracle:     exact projection with every true output length known (an upper bound).
"""

from __future__ import annotations

from dataclasses import replace

from ..batcher import Batcher
from ..config import BatcherConfig
from ..plan import StepPlan
from ..preemption import preempt
from ..request import Request


class StaticBatcher(Batcher):
    def __init__(self, config: BatcherConfig, *, blocks: bool = False) -> None:
        super().__init__(replace(config, jump_window_s=0.0))
        self.slots = self.budget // self.config.max_total_tokens
        # It admits by count, not weight: in the simulator nothing bounds its blocks (it counts
        # overflows). A real engine (`blocks`) needs them allocated: slots x max_total_tokens fit.
        if not blocks:
            self.ledger = self.paging.ledger = None

    def fits(self, req: Request, chunk: int | None = None, ahead: int = 0) -> bool:
        return len(self.running) < self.slots


class TgiBatcher(Batcher):
    def __init__(self, config: BatcherConfig) -> None:
        super().__init__(replace(config, jump_window_s=0.0, mode="worst_case"))

    def fits(self, req: Request, chunk: int | None = None, ahead: int = 0) -> bool:
        return self.admission.naive_fits(req.reserved_total)


class OptimisticBatcher(Batcher):
    """Admits on current usage; before a step whose growth would not fit, preempts the newest (vLLM's
    scheduler: a request whose next token's block cannot be allocated preempts the newest running one).
    Like vLLM it never runs a step over the budget, and pays for it in recomputed tokens."""

    def __init__(self, config: BatcherConfig) -> None:
        super().__init__(replace(config, jump_window_s=0.0, mode="worst_case"))

    def fits(self, req: Request, chunk: int | None = None, ahead: int = 0) -> bool:
        # like vLLM, the running requests' next slots are allocated before a waiting prompt's blocks
        used = self.weight.batch([r.context_len + 1 for r in self.running.values()] + [req.context_len + 1])
        return used <= self.budget

    def schedule(self, now: float) -> StepPlan:
        preempted: list[Request] = []
        while self.running and self.weight_with(1) > self.budget:
            victim = max(self.running.values(), key=lambda r: self.order[r.id])
            preempt(self, victim)
            preempted.append(victim)
        plan = super().schedule(now)
        plan.preempted = preempted + plan.preempted
        return plan


POLICIES = ("static", "tgi", "optimistic", "weighted", "predictive", "oracle")


def make_batcher(policy: str, config: BatcherConfig) -> Batcher:
    """The oracle is the weighted batcher fed max_new_tokens = true length (see simulator)."""
    if policy == "static":
        return StaticBatcher(config)
    if policy == "tgi":
        return TgiBatcher(config)
    if policy == "optimistic":
        return OptimisticBatcher(config)
    if policy in ("weighted", "oracle"):
        return Batcher(replace(config, mode="worst_case"))
    if policy == "predictive":
        return Batcher(replace(config, mode="predictive"))
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
