"""What a worker's batcher knows of its near future, published with its heartbeat so that the web
side can project how long a new job would wait (app/client/backlog.py) without asking the worker.

Finish steps are each running request's remaining output tokens: its max_new_tokens less what it
generated (or, in predictive mode once lengths are known, its expected remaining length), because a
decode step gives every running request one token. Slots are the requests it could run at once:
those running plus room for more of the typical size (Batcher.room_for). A queued job starts when
a slot frees, so the web side replays these finishes against the queue (backlog.py: project)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batcher import Batcher

MAX_POINTS = 64  # finish steps published: quantiles of the running set beyond this many


def finish_steps(batcher: Batcher) -> list[int]:
    est = batcher.estimator
    out = []
    for r in batcher.running.values():
        total = r.max_new_tokens if est is None or r.runs_to_max else est.reserve(r.max_new_tokens, r.generated)
        out.append(max(1, total - r.generated))
    out.sort()
    if len(out) <= MAX_POINTS:
        return out
    n = len(out)
    return [out[min(n - 1, (i * n) // MAX_POINTS)] for i in range(MAX_POINTS)]


def outlook(batcher: Batcher) -> dict:
    """JSON-ready: finish_steps (ascending), running (how many finish_steps stand for), slots,
    waiting {class: requests}, mean_output (tokens of recent finished requests)."""
    waiting: dict[str, int] = {}
    for r in batcher.waiting:
        waiting[str(r.priority)] = waiting.get(str(r.priority), 0) + 1
    running = len(batcher.running)
    return {
        "finish_steps": finish_steps(batcher),
        "running": running,
        "slots": running + batcher.room_for(),
        "waiting": waiting,
        "mean_output": round(mean_output(batcher), 1),
    }


def mean_output(batcher: Batcher) -> float:
    """Recent finished requests' mean output; before any has finished, what the ones in hand ask
    for (a cold worker's first flood is what the queue behind it holds more of)."""
    if batcher.stats.finished:
        return batcher.stats.mean_output
    asked = [r.max_new_tokens for r in (*batcher.running.values(), *batcher.waiting)]
    return sum(asked) / len(asked) if asked else 0.0


@dataclass(frozen=True, slots=True)
class Urgency:
    """What a worker needs of its batcher to take jobs beyond its room (app/worker/intake.py): urgent
        jobs only while background work runs that they can preempt; jobs of a tenant outside
        `heavy_tenants` (those holding at least an equal share of the budget, or of the running slots under
    a cap, were one more tenant to come),
        whom fair preemption lets in; and only a few of either waiting at a time. Urgent: headroom_priority
        or above."""

    urgent_waiting: int = 0  # requests of an urgent class waiting
    background_running: int = 0  # requests of a background class running
    heavy_tenants: tuple[str, ...] = ()
    light_waiting: int = 0  # urgent requests of the other tenants waiting


def urgency(batcher: Batcher) -> Urgency:
    """Safe to call from another thread: it copies the containers, never iterates them."""
    floor = batcher.config.headroom_priority
    waiting, running = list(batcher.waiting), tuple(batcher.running.values())
    shares, slot = batcher.tenants, batcher.slot_weight
    weights, tenants = dict(shares.reserved), len(shares.requests)
    share = batcher.budget / (tenants + 1)
    # a tenant's hold on whichever binds: its weight, or its running requests' slots under a count cap
    heavy = tuple(t for t, w in weights.items() if w and shares.use(t, slot) >= share)
    urgent = [r for r in waiting if r.priority >= floor]
    return Urgency(
        len(urgent),
        sum(r.priority < floor for r in running),
        heavy,
        sum(r.tenant not in heavy for r in urgent),
    )
