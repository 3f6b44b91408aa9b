"""Where an engine's events go: the `Sink` protocol the loop and the engine process call, instead of
probing the caller's object for optional methods.

`Engine(sink=...)` takes a Sink, or any callable of one event (a test's `events.append`), which
`as_sink` wraps once. A `TokenSink` also takes a step's tokens as the tuples an engine process sends
(the worker's stream writer: no event object per token on the thread that reads the pipe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .params import Event

TokenTuple = tuple[str, int, int, str, Any]  # (request id, index, token id, text, logprobs)


@runtime_checkable
class Sink(Protocol):
    def __call__(self, event: Event, emitted: float | None = None) -> None:
        """One event, on the engine thread (or the process's reader thread, with the child's stamp)."""

    def flush(self) -> None:
        """The end of a step: what the step's events buffered may leave now, as one batch."""


@runtime_checkable
class TokenSink(Sink, Protocol):
    def tokens(self, tokens: list[TokenTuple], emitted: float) -> None:
        """A step's tokens from an engine process, as it sent them."""


@dataclass(frozen=True, slots=True)
class CallbackSink:
    """A plain callable of one event, as a Sink with nothing to flush."""

    fn: Callable[[Event], None]

    def __call__(self, event: Event, emitted: float | None = None) -> None:
        self.fn(event)

    def flush(self) -> None:
        pass


def as_sink(sink: Sink | Callable[[Event], None] | None) -> Sink | None:
    if sink is None or isinstance(sink, Sink):
        return sink
    return CallbackSink(sink)
