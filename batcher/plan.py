"""What one step runs (StepPlan), the prompt work planned so far (PrefillLoad) and the batcher's
counters (BatcherStats)."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field

from .request import Request


@dataclass(slots=True)
class StepPlan:
    """What the engine runs this step; chunks and decodes are in admission order."""

    step: int
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + len(self.decode)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


@dataclass(slots=True)
class PrefillLoad:
    """The prompt chunks planned so far this step, which the prefill cap is checked against."""

    chunks: int = 0
    longest_tokens: int = 0
    tokens: int = 0
    # (request, blocks, holders): blocks of a chunk's prompt that joined the prefix cache, and the holders
    # whose charge changed (Paging.allocate): the Batcher applies them
    cached: list[tuple[Request, int, Set[str]]] = field(default_factory=list)


MEAN_OVER = 50  # finished requests the mean output follows (a moving average past the first ones)


@dataclass(slots=True)
class BatcherStats:
    admitted: int = 0
    admitted_fast: int = 0
    admitted_projected: int = 0
    rejected_projected: int = 0
    preemptions: int = 0
    preempted_tokens: int = 0
    idle_passes: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # context tokens of every admission (readmissions too)
    cached_tokens: int = 0  # of those, found in the prefix cache instead of computed
    mean_output: float = 0.0  # output tokens of recently finished requests (a moving average)
    finished: int = 0

    def finish(self, generated: int) -> None:
        """A request ended with `generated` tokens: the average of the last ~MEAN_OVER (the first ones exactly)."""
        self.finished += 1
        self.mean_output += (generated - self.mean_output) / min(self.finished, MEAN_OVER)
