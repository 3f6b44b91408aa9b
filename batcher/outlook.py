"""What a worker's batcher knows of its near future (`Batcher.outlook`), published with its heartbeat so
that the web side can project how long a new job would wait (app/client/backlog.py) without asking the
worker; and what its intake needs to take jobs beyond its room (`Batcher.urgency`).

Finish steps are each running request's remaining output tokens: its max_new_tokens less what it
generated (or, in predictive mode once lengths are known, its expected remaining length), because a
decode step gives every running request one token. Slots are the requests it could run at once:
those running plus room for more of the typical size (Batcher.room_for). A queued job starts when
a slot frees, so the web side replays these finishes against the queue (backlog.py: project)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_POINTS = 64  # finish steps published: quantiles of the running set beyond this many


def spread(points: list[int], most: int) -> list[int]:
    """`points` (ascending) as at most `most` evenly spaced quantiles of them."""
    n = len(points)
    if n <= most:
        return points
    return [points[min(n - 1, (i * n) // most)] for i in range(most)]


@dataclass(frozen=True, slots=True)
class Urgency:
    """What a worker needs of its batcher to take jobs beyond its room (app/worker/intake.py): urgent
    jobs only while background work runs that they can preempt; jobs of a tenant outside
    `heavy_tenants` (those holding at least an equal share of the budget, or of the running slots under
    a cap, were one more tenant to come), whom fair preemption lets in; and only a few of either
    waiting at a time. Urgent: headroom_priority or above."""

    urgent_waiting: int = 0  # requests of an urgent class waiting
    background_running: int = 0  # requests of a background class running
    heavy_tenants: tuple[str, ...] = ()
    light_waiting: int = 0  # urgent requests of the other tenants waiting
