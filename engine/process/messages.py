"""The messages on the engine process's two pipes, typed: commands down (Submit, Cancel, Stop), events
up (Ready or Failed once, then one Step per engine step, Stopped last).

A Step carries the step's tokens as plain tuples (sink.TokenTuple), not TokenEvents: a pickled tuple of
scalars is the cheapest thing to send and to read, and a step holds hundreds of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..params import FinishEvent, FinishReason, GenerationRequest
from ..sink import TokenTuple


@dataclass(frozen=True, slots=True)
class Submit:
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    reason: FinishReason
    message: str | None


@dataclass(frozen=True, slots=True)
class LoadAdapter:
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class UnloadAdapter:
    name: str


Command = Submit | Cancel | Stop | LoadAdapter | UnloadAdapter


@dataclass(frozen=True, slots=True)
class Ready:
    kv_derivation: str
    max_input_length: int
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException | str  # the exception when it pickles, else its repr


@dataclass(frozen=True, slots=True)
class Step:
    emitted: float  # the child's wall clock when the step's events left (readers' latency origin)
    tokens: list[TokenTuple]
    finishes: list[FinishEvent]
    stats: dict[str, Any] | None  # a snapshot now and then (child.STATS_EVERY_S), else None


@dataclass(frozen=True, slots=True)
class Stopped:
    stats: dict[str, Any]


Message = Ready | Failed | Step | Stopped
