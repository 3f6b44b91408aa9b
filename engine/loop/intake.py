"""The engine's caller side: submit() and cancel() from any thread only queue work here, and the
engine thread takes it at the start of each step. A request whose grammar was not compiled before is
prepared on a grammar thread, so a slow compile never holds up a submit, a cancel (the engine
process's command thread, a task thread) or the loop."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from weightq.batcher import RequestRejected

from ..handle import Handle
from ..params import Event, FinishEvent, FinishReason, GenerationRequest, InvalidRequest
from ..sampling.grammar import Grammars
from ..sequence import Sequence

log = logging.getLogger(__name__)

Prepare = Callable[[GenerationRequest, float], "Sequence | FinishEvent"]


def error_event(rid: str, message: str, prompt_tokens: int, since: float) -> FinishEvent:
    return FinishEvent(rid, "error", "", (), prompt_tokens, 0, 0.0, 0.0, time.monotonic() - since, message)


class Intake:
    """Handles of the requests inside, the inbox of prepared requests (or their refusals), the
    cancels, and the requests still being prepared; one condition guards them and wakes the loop."""

    def __init__(self, prepare: Prepare, grammars: Grammars) -> None:
        self.prepare = prepare
        self.grammars = grammars
        self.handles: dict[str, Handle] = {}
        self.inbox: deque[Sequence | FinishEvent] = deque()
        self.cancels: deque[str] = deque()
        self.cv = threading.Condition()
        self.pending: set[str] = set()  # submitted, not yet in the inbox (being prepared)
        self._cancelled_pending: set[str] = set()  # ... and cancelled, or finished by stop()
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="weightq-grammar")

    def submit(self, request: GenerationRequest, stream: bool) -> Handle:
        """Problems with the request never raise here: they finish its handle with an error."""
        handle = Handle(request.id, stream)
        now = time.monotonic()
        guided = request.params.guided
        with self.cv:
            if request.id in self.handles:
                handle._put(error_event(request.id, f"id: request id {request.id!r} is already in flight", 0, now))
                return handle
            self.handles[request.id] = handle
            self.pending.add(request.id)
        if guided is not None and not self.grammars.ready(guided):
            self._grammar_thread.submit(self._enqueue, request, now)
        else:
            self._enqueue(request, now)
        return handle

    def _enqueue(self, request: GenerationRequest, now: float) -> None:
        try:
            item: Sequence | FinishEvent = self.prepare(request, now)
        except (InvalidRequest, RequestRejected) as e:
            item = error_event(request.id, str(e), 0, now)
        except Exception as e:  # a bug preparing it (on the grammar thread: nobody else would hear of it)
            log.exception("preparing request %s failed", request.id)
            item = error_event(request.id, f"the engine could not prepare this request: {e!r:.300}", 0, now)
        with self.cv:
            self.pending.discard(request.id)
            if request.id in self._cancelled_pending:  # cancelled (or stopped) while it was prepared
                self._cancelled_pending.discard(request.id)
                if self.handles.get(request.id) is None:
                    return  # stop() finished it
                item = FinishEvent(request.id, "cancelled", "", (), 0, 0, 0.0, 0.0, time.monotonic() - now)
            self.inbox.append(item)
            self.cv.notify()

    def cancel(self, request_id: str) -> bool:
        with self.cv:
            known = request_id in self.handles
            if request_id in self.pending:
                self._cancelled_pending.add(request_id)
            elif known:
                self.cancels.append(request_id)
                self.cv.notify()
        return known

    def take(self) -> tuple[list[Sequence | FinishEvent], list[str]]:
        """Everything queued since the last step: prepared requests (or refusals), then cancels."""
        with self.cv:
            items, cancels = list(self.inbox), list(self.cancels)
            self.inbox.clear()
            self.cancels.clear()
        return items, cancels

    def queued(self) -> bool:
        return bool(self.inbox or self.cancels)

    def wake(self) -> None:
        with self.cv:
            self.cv.notify()

    def wait(self, stopping: threading.Event, timeout: float) -> None:
        """The loop had nothing to run: sleep until work arrives (or `timeout`)."""
        with self.cv:
            if not self.queued() and not stopping.is_set():
                self.cv.wait(timeout)

    def wait_prepared(self, timeout: float) -> None:
        """generate(): a grammar compiling on the grammar thread; wait for it to reach the inbox."""
        with self.cv:
            self.cv.wait_for(lambda: self.inbox or not self.pending, timeout)

    def end_pending(self) -> list[str]:
        """stop(): requests still being prepared end now (their preparation's result is dropped)."""
        with self.cv:
            pending = [rid for rid in self.pending if rid not in self._cancelled_pending]
            self._cancelled_pending.update(pending)
        return pending

    def handle_of(self, event: Event) -> Handle | None:
        """The handle an event goes to; a finish releases it."""
        if isinstance(event, FinishEvent):
            with self.cv:
                return self.handles.pop(event.request_id, None)
        return self.handles.get(event.request_id)


def stopped_event(rid: str, reason: FinishReason, message: str | None) -> FinishEvent:
    return FinishEvent(rid, reason, "", (), 0, 0, 0.0, 0.0, 0.0, message)
