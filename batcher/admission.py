"""Admission's rules that need no batcher: the policy a walk checks candidates by, the prefill cap's
chunk, a slot under the cap on running requests, and what a walk returns. The walk itself is the
Batcher's (`Batcher._admit`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from .config import BatcherConfig
from .request import Request
from .weight import PaddedWeight, TokenWeight

# Refused candidates a walk remembers: a later one that weighs at least as much as one of them at every
# step is refused without a projection (a bound on the walk's cost, not on what it admits).
DOMINANCE_MEMORY = 16


@dataclass(frozen=True, slots=True)
class Policy:
    """How a walk checks a candidate; the simulator compares these at one budget (sim/policies.py).

    projected: exact projection, each cached block counted once (the batcher's own rule).
    count:     at most `slots` running requests (a fixed batch size sized for the worst case).
    sum:       the sum of every final weight within the budget (upstream TGI's rule).
    current:   current usage plus one token each (vLLM's optimism); with `preempts_to_fit`, the newest
               are preempted before a step whose growth does not fit."""

    name: str = "weighted"
    rule: Literal["projected", "count", "sum", "current"] = "projected"
    slots: int = 0
    preempts_to_fit: bool = False


PROJECTED = Policy()


@dataclass(slots=True)
class Outcome:
    """What a walk did: the queue positions it started (none: the queue is idle until something
    changes) and the requests it preempted (back to the queue after the walk)."""

    taken: list[int] = field(default_factory=list)
    evicted: list[Request] = field(default_factory=list)


def with_slot(cap: int, running: int, admits: Callable[[set[str]], bool]) -> Callable[[set[str]], bool]:
    """`admits`, and a running slot free under the cap (0: none) once these requests are preempted."""
    if not cap:
        return admits
    return lambda ids: running - len(ids) < cap and admits(ids)


def prefill_chunk(
    cfg: BatcherConfig, w: TokenWeight | PaddedWeight, prompt: int, chunks: int, longest: int, total: int
) -> int | None:
    """Tokens of `prompt` to prefill this step given the chunks already planned (how many, the longest,
    their tokens: PrefillLoad's fields, passed as they are kept in the walk): the whole
    prompt when it fits the cap, a chunk of what is left (chunked prefill), 0 when nothing is left, or
    None when the prompt must wait to be prefilled alone."""
    cap = cfg.max_prefill_weight
    if not cap or w.prefill(chunks + 1, max(longest, prompt), total + prompt) <= cap:
        return prompt
    if w.name == "token" and total >= cap:
        return 0
    if cfg.chunked_prefill and w.name == "token":
        return cap - total
    return None if chunks else prompt
