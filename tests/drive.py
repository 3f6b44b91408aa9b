"""Drive a Batcher as an engine would, with a simulated clock, checking the budget and the prefill
cap after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

from weightq.batcher import Batcher, Request


@dataclass
class Run:
    """What happened when a batcher was driven to completion."""

    admitted: list[tuple[int, float, str]] = field(default_factory=list)  # (step, now, id) in order
    finished: dict[str, int] = field(default_factory=dict)  # id -> step
    max_weight: int = 0
    steps: int = 0


def drive(
    batcher: Batcher,
    requests: list[Request],
    stop_at: dict[str, int] | None = None,
    *,
    dt: float = 0.1,
    max_steps: int = 200_000,
    on_step=None,
) -> Run:
    """Submit each request at its arrival time and step until all finish.

    A request stops after `stop_at[id]` tokens (EOS), else at max_new_tokens. Every plan is checked
    against the prefill cap (several chunks must fit it; one prompt may exceed it alone) and, after
    every step, the batch weight against the budget.
    """
    stop_at = stop_at or {}
    pending = sorted(requests, key=lambda r: r.arrival_s)
    run = Run()
    now = 0.0
    i = 0
    while len(run.finished) < len(requests):
        while i < len(pending) and pending[i].arrival_s <= now:
            batcher.submit(pending[i])
            i += 1
        if not batcher.running and not batcher.waiting:
            now = pending[i].arrival_s
            continue
        plan = batcher.schedule(now)
        assert plan, f"nothing runnable with {len(batcher.waiting)} waiting at step {batcher.step}"
        cap = batcher.config.max_prefill_weight
        if cap and len(plan.prefill) > 1:
            lens = [n for _, n in plan.prefill]
            used = batcher.weight.prefill(len(lens), max(lens), sum(lens))
            assert used <= cap, f"prefill weight {used} > cap {cap} with {len(lens)} chunks"
        for r in plan.admitted:
            run.admitted.append((batcher.step, now, r.id))
        emitted = batcher.complete(plan)
        weight = batcher.batch_weight()
        assert weight <= batcher.budget, f"weight {weight} > budget {batcher.budget} at step {batcher.step}"
        run.max_weight = max(run.max_weight, weight)
        for r in emitted:
            if r.generated >= min(stop_at.get(r.id, r.max_new_tokens), r.max_new_tokens):
                batcher.finish(r.id)
                run.finished[r.id] = batcher.step
        if on_step:
            on_step(batcher)
        now += dt
        run.steps += 1
        assert run.steps <= max_steps, "no progress"
    return run
