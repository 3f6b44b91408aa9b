"""The engine in a process of its own (an engine core, as vLLM v1 runs it), behind the Engine interface
the worker uses: submit, cancel, idle, stats, room_for, start, stop.

Why: in one process the engine loop shares a GIL with Celery's consumer, the task threads and the
stream writer, and every Python instruction they run is time the device waits. Here the child
(child.py) runs only the engine; the parent gets one message per step (messages.Step: the step's
tokens as plain tuples, its finishes, a stats snapshot now and then) and sends one per request. The
child is started with spawn, never fork (CUDA cannot be re-initialised in a forked child), ignores
SIGINT/SIGTERM (the parent decides when it stops) and exits when the parent's end of the pipe closes.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable

from weightq.batcher.outlook import Urgency

from ..config import EngineConfig
from ..handle import Handle
from ..params import Event, FinishEvent, FinishReason, GenerationRequest, TokenEvent
from ..sink import Sink, TokenSink, TokenTuple, as_sink
from .child import child_main
from .messages import Cancel, Command, Failed, LoadAdapter, Ready, Step, Stop, Stopped, Submit, UnloadAdapter

log = logging.getLogger(__name__)

REAP_S = 5.0  # how long to wait for a child that was killed, or died, to be reaped
START_POLL_S = 0.5  # while the child starts, how often the parent checks that it is still alive
FAILED_EXIT_S = 10.0  # a child that failed to start exits on its own: how long to wait for it


class EngineDied(RuntimeError):
    """The engine process exited without being asked to."""


class EngineProcess:
    """An Engine running in a spawned child. The sink gets every event in order, with the child's
    emission stamp, and a flush after each step's; a TokenSink gets each step's tokens through
    `tokens()` instead, as the child sent them.
    If the child dies unasked, `on_death(message)` is called on the reader thread (a worker exits
    there, so its jobs are redelivered); if it returns, every request still inside finishes with an
    error."""

    def __init__(
        self,
        config: EngineConfig,
        sink: Sink | Callable[[Event], None] | None = None,
        *,
        on_death: Callable[[str], None] | None = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.config = config
        self.sink = as_sink(sink)
        self._token_sink = self.sink if isinstance(self.sink, TokenSink) else None
        self.on_death = on_death
        self._handles: dict[str, Handle] = {}
        self._streamed: set[str] = set()  # ids whose handles take every token (submitted with stream=True)
        self._lock = threading.Lock()
        self._sent = 0  # requests sent to the child (room_for subtracts those its snapshot has not seen)
        self._stats: dict = {}
        self._stopping = False
        ctx = multiprocessing.get_context("spawn")
        child_commands, self._to_child = ctx.Pipe(duplex=False)  # Pipe(duplex=False): (receiving, sending)
        self._from_child, child_events = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=child_main, args=(config, child_commands, child_events), name="weightq-engine-core", daemon=True
        )
        self._proc.start()
        child_commands.close()  # the child's ends: ours must not keep them open, or its death goes unseen
        child_events.close()
        first = self._recv_start(start_timeout_s)
        self.kv_derivation: str = first.kv_derivation
        self.max_input_length: int = first.max_input_length
        self._stats = first.stats
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, name="weightq-engine-events", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # ----- the Engine interface ----------------------------------------------------------------------
    def start(self) -> None:
        if not self._reader.is_alive():
            self._reader.start()

    def submit(self, request: GenerationRequest, *, stream: bool = False) -> Handle:
        handle = Handle(request.id, stream)
        with self._lock:
            if request.id in self._handles:
                message = f"id: request id {request.id!r} is already in flight"
                handle._put(FinishEvent(request.id, "error", "", (), 0, 0, 0.0, 0.0, 0.0, message))
                return handle
            if self._stopping or not self._proc.is_alive():
                handle._put(FinishEvent(request.id, "error", "", (), 0, 0, 0.0, 0.0, 0.0, "engine: stopped"))
                return handle
            self._handles[request.id] = handle
            if stream:
                self._streamed.add(request.id)
            self._sent += 1
        self._send(Submit(request))
        return handle

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._handles
        if known:
            self._send(Cancel(request_id))
        return known

    def load_adapter(self, name: str, path: str) -> None:
        """Sent to the child, which reads it; a failure shows in stats()["adapter_errors"]."""
        self._send(LoadAdapter(name, path))

    def unload_adapter(self, name: str) -> bool:
        self._send(UnloadAdapter(name))
        return name in self._stats.get("adapters", ())

    def idle(self) -> bool:
        with self._lock:
            return not self._handles

    def stats(self) -> dict:
        return dict(self._stats) | {"engine_pid": self._proc.pid}

    def room_for(self) -> int:
        """The child's last room_for(), less the requests sent since that snapshot (they take room)."""
        stats = self._stats
        with self._lock:
            unseen = self._sent - stats.get("submits_seen", 0)
        return max(0, stats.get("room_for", 0) - unseen)

    def urgency(self) -> Urgency:
        """The child's at its last snapshot; the requests sent since count as urgent ones of other
        tenants waiting (not yet known to be admitted)."""
        stats = self._stats
        with self._lock:
            unseen = max(0, self._sent - stats.get("submits_seen", 0))
        u = stats.get("urgency") or {}
        return Urgency(
            u.get("urgent_waiting", 0) + unseen,
            u.get("background_running", 0),
            tuple(u.get("heavy_tenants", ())),
            u.get("light_waiting", 0) + unseen,
        )

    def stop(self, reason: FinishReason = "cancelled", message: str | None = None, timeout: float = 60.0) -> None:
        """Stop the child's loop; every request still inside finishes with `reason` (those events reach
        the sink before this returns), then the child exits."""
        with self._lock:
            self._stopping = True
        if self._proc.is_alive():
            self._send(Stop(reason, message))
        if self._reader.is_alive():
            self._reader.join(timeout)
        else:  # never started: read the child's last messages here
            self._read_loop()
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(REAP_S)
        # A submit that raced the stop reached a child no longer reading: it ends as the others did.
        with self._lock:
            left = list(self._handles.values())
            self._handles.clear()
            self._streamed.clear()
        for handle in left:
            event = FinishEvent(handle.request_id, reason, "", (), 0, 0, 0.0, 0.0, 0.0, message)
            if self.sink is not None:
                self._to_sink(event, time.time())
            handle._put(event)
        if left and self.sink is not None:
            self.sink.flush()

    # ----- parent internals -------------------------------------------------------------------------
    def _send(self, msg: Command) -> None:
        try:
            with self._send_lock:
                self._to_child.send(msg)
        except (OSError, EOFError):
            pass  # the child is gone: the reader thread fails what is inside

    def _recv_start(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while not self._from_child.poll(START_POLL_S):
            if not self._proc.is_alive():
                raise EngineDied(f"the engine process exited ({self._proc.exitcode}) while starting")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise EngineDied(f"the engine process did not start within {timeout} s")
        msg = self._from_child.recv()
        if isinstance(msg, Failed):
            self._proc.join(FAILED_EXIT_S)
            raise msg.error if isinstance(msg.error, BaseException) else EngineDied(msg.error)
        assert isinstance(msg, Ready), msg
        return msg

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._from_child.recv()
            except (EOFError, OSError):
                self._died()
                return
            if isinstance(msg, Step):
                self._dispatch(msg.emitted, msg.tokens, msg.finishes)
                if msg.stats is not None:
                    self._stats = msg.stats
            elif isinstance(msg, Stopped):
                self._stats = msg.stats
                return

    def _dispatch(self, emitted: float, tokens: list[TokenTuple], finishes: list[FinishEvent]) -> None:
        sink, handles = self.sink, self._handles
        batched = self._token_sink
        if batched is not None and tokens:
            try:
                batched.tokens(tokens, emitted)
            except Exception:
                log.exception("event sink failed for a step's %d tokens", len(tokens))
        one_by_one = sink is not None and batched is None
        if one_by_one or self._streamed:
            for rid, index, token_id, text, logprobs in tokens:
                event = TokenEvent(rid, index, token_id, text, logprobs)
                if one_by_one:
                    self._to_sink(event, emitted)
                if rid in self._streamed and (handle := handles.get(rid)) is not None:
                    handle._put(event)
        for event in finishes:
            if sink is not None:
                self._to_sink(event, emitted)
            with self._lock:
                handle = handles.pop(event.request_id, None)
                self._streamed.discard(event.request_id)
            if handle is not None:
                handle._put(event)
        if sink is not None:
            sink.flush()

    def _to_sink(self, event: Event, emitted: float) -> None:
        try:
            self.sink(event, emitted)  # type: ignore[misc]  # set: callers check
        except Exception:
            log.exception("event sink failed for %s", event.request_id)

    def _died(self) -> None:
        self._proc.join(REAP_S)
        with self._lock:
            expected = self._stopping
            inside = list(self._handles.values())
            self._handles.clear()
            self._streamed.clear()
            self._stopping = True
        if expected:
            return
        message = f"engine: the engine process died (exit code {self._proc.exitcode})"
        log.critical("%s with %d requests inside", message, len(inside))
        if self.on_death is not None:
            self.on_death(message)  # a worker exits here: its jobs are redelivered, not failed
        for handle in inside:
            event = FinishEvent(handle.request_id, "error", "", (), 0, 0, 0.0, 0.0, 0.0, message)
            if self.sink is not None:
                self._to_sink(event, time.time())
            handle._put(event)
