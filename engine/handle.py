"""A submitted request's handle: its events as they come, or its final result."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from .params import Event, FinishEvent


class Handle:
    """A submitted request: iterate its events (if streamed) or wait for its result."""

    def __init__(self, request_id: str, stream: bool) -> None:
        self.request_id = request_id
        self._events: queue.SimpleQueue[Event] | None = queue.SimpleQueue() if stream else None
        self._done = threading.Event()
        self.final: FinishEvent | None = None

    def _put(self, event: Event) -> None:
        if self._events is not None:
            self._events.put(event)
        if isinstance(event, FinishEvent):
            self.final = event
            self._done.set()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        if self._events is None:
            raise RuntimeError("submitted with stream=False: only result() is available")
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if isinstance(event, FinishEvent):
                return

    def result(self, timeout: float | None = None) -> FinishEvent:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        assert self.final is not None
        return self.final
