"""The engine in a process of its own (an engine core, as vLLM v1 runs it), behind the Engine interface
the worker uses: submit, cancel, idle, stats, room_for, start, stop.

Why: in one process the engine loop shares a GIL with Celery's consumer, the task threads and the
stream writer, and every Python instruction they run is time the device waits. Here the child runs
only the engine; the parent gets one message per step (the step's tokens as plain tuples, its
finishes, a stats snapshot now and then) and one message per request in. The child is started with
spawn, never fork (CUDA cannot be re-initialised in a forked child), ignores SIGINT/SIGTERM (the
parent decides when it stops) and exits when the parent's end of the pipe closes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from .config import EngineConfig
from .handle import Handle
from .heap import freeze_startup_heap
from .loop import Engine
from .params import Event, FinishEvent, FinishReason, GenerationRequest, TokenEvent

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.1  # a stats snapshot rides on a step message at most this often (and when idle)


class EngineDied(RuntimeError):
    """The engine process exited without being asked to."""


class EngineProcess:
    """An Engine running in a spawned child. `sink(event, emitted)` gets every event in order, with the
    child's emission stamp; a sink with a `tokens(tuples, emitted)` method gets each step's tokens
    there instead, as the child sent them ((request id, index, token id, text, logprobs) tuples).
    If the child dies unasked, `on_death(message)` is called on the reader thread (a worker exits
    there, so its jobs are redelivered); if it returns, every request still inside finishes with an
    error."""

    def __init__(
        self,
        config: EngineConfig,
        sink: Callable[..., None] | None = None,
        *,
        on_death: Callable[[str], None] | None = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.config = config
        self.sink = sink
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
            target=_child_main, args=(config, child_commands, child_events), name="weightq-engine-core", daemon=True
        )
        self._proc.start()
        child_commands.close()  # the child's ends: ours must not keep them open, or its death goes unseen
        child_events.close()
        first = self._recv_start(start_timeout_s)
        self.kv_derivation: str = first["kv_derivation"]
        self.max_input_length: int = first["max_input_length"]
        self._stats = first["stats"]
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
        self._send(("submit", request))
        return handle

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._handles
        if known:
            self._send(("cancel", request_id))
        return known

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

    def stop(self, reason: FinishReason = "cancelled", message: str | None = None, timeout: float = 60.0) -> None:
        """Stop the child's loop; every request still inside finishes with `reason` (those events reach
        the sink before this returns), then the child exits."""
        with self._lock:
            self._stopping = True
        if self._proc.is_alive():
            self._send(("stop", reason, message))
        if self._reader.is_alive():
            self._reader.join(timeout)
        else:  # never started: read the child's last messages here
            self._read_loop()
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
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
        if left and (flush := getattr(self.sink, "flush", None)) is not None:
            flush()

    # ----- parent internals -------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._to_child.send(msg)
        except (OSError, EOFError):
            pass  # the child is gone: the reader thread fails what is inside

    def _recv_start(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self._from_child.poll(0.5):
            if not self._proc.is_alive():
                raise EngineDied(f"the engine process exited ({self._proc.exitcode}) while starting")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise EngineDied(f"the engine process did not start within {timeout} s")
        kind, payload = self._from_child.recv()
        if kind == "failed":
            self._proc.join(10)
            raise payload if isinstance(payload, BaseException) else EngineDied(str(payload))
        return payload

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._from_child.recv()
            except (EOFError, OSError):
                self._died()
                return
            kind = msg[0]
            if kind == "step":
                _, emitted, tokens, finishes, stats = msg
                self._dispatch(emitted, tokens, finishes)
                if stats is not None:
                    self._stats = stats
            elif kind == "stopped":
                self._stats = msg[1]
                return

    def _dispatch(self, emitted: float, tokens: list[tuple], finishes: list[FinishEvent]) -> None:
        sink, handles = self.sink, self._handles
        batched = getattr(sink, "tokens", None)
        if batched is not None and tokens:
            try:
                batched(tokens, emitted)
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
        flush = getattr(sink, "flush", None)
        if flush is not None:
            flush()

    def _to_sink(self, event: Event, emitted: float) -> None:
        try:
            self.sink(event, emitted)  # type: ignore[misc]
        except Exception:
            log.exception("event sink failed for %s", event.request_id)

    def _died(self) -> None:
        self._proc.join(5)
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


class _StepSink:
    """The child engine's sink: a step's events leave as one message, sent from the engine thread at
    the end of the step (a sender thread waited for the GIL behind the forward pass: p99 +300 ms)."""

    def __init__(self, out: Connection) -> None:
        self.out = out
        self.engine: Engine | None = None  # set once built (warm-up steps run before: they send nothing)
        self.tokens: list[tuple] = []
        self.finishes: list[FinishEvent] = []
        self.submits_seen = 0
        self._last_stats = 0.0
        self._lock = threading.Lock()  # the engine thread and the command thread (its final message)

    def __call__(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append((event.request_id, event.index, event.token_id, event.text, event.logprobs))
        else:
            self.finishes.append(event)

    def flush(self) -> None:
        engine = self.engine
        if engine is None:
            self.tokens, self.finishes = [], []
            return
        now = time.monotonic()
        due = now - self._last_stats >= STATS_EVERY_S
        if not (self.tokens or self.finishes or due):
            return
        stats = None
        if due or (self.finishes and not engine.seqs):
            stats, self._last_stats = self.snapshot(), now
        msg = ("step", time.time(), self.tokens, self.finishes, stats)
        self.tokens, self.finishes = [], []
        self.send(msg)

    def snapshot(self) -> dict:
        engine = self.engine
        assert engine is not None
        return engine.stats() | {"room_for": engine.room_for(), "submits_seen": self.submits_seen}

    def send(self, msg: tuple) -> None:
        try:
            with self._lock:
                self.out.send(msg)
        except (OSError, EOFError):
            os._exit(0)  # the parent is gone


def _child_main(config: EngineConfig, commands: Connection, out: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (warm shutdown), not the terminal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/engine-core] %(message)s")
    try:
        sink = _StepSink(out)
        engine = sink.engine = Engine(config, sink=sink)
    except BaseException as e:  # reported to the parent, which raises it
        try:
            out.send(("failed", e))
        except Exception:
            out.send(("failed", repr(e)))
        return
    out.send(
        ("ready", {"kv_derivation": engine.kv_derivation, "max_input_length": engine.max_input_length,
                   "stats": sink.snapshot()})
    )  # fmt: skip
    freeze_startup_heap()  # a full collection here stops the engine's step
    engine.start()
    while True:
        try:
            msg = commands.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent died: nothing to serve
        kind = msg[0]
        if kind == "submit":
            sink.submits_seen += 1
            engine.submit(msg[1])
        elif kind == "cancel":
            engine.cancel(msg[1])
        elif kind == "stop":
            engine.stop(msg[1], msg[2])
            sink.flush()
            sink.send(("stopped", sink.snapshot()))
            return


AnyEngine = Engine | EngineProcess  # what a worker hosts: the engine in its process or in its own


def own_process(mode: str, config: EngineConfig) -> bool:
    """ENGINE_PROCESS: "on", "off", or "auto": on where the device is not the CPU (CUDA, and the
    simulated device that stands for one), and on the CPU where the engine's threads
    (`config.torch_threads`, set: a worker's come from setup.serving_threads) leave a core to the
    rest of the process. There the engine's thread no longer waits for the GIL behind Celery's
    threads and the stream writer (bench.serve, alternating stacks: 3,260 tok/s against 2,611 for the
    same single thread in the worker's process). With every core in the forward's team the extra process and
    its per-step message cost more than the GIL they free (1,174-1,286 vs 1,215-1,540 tok/s)."""
    if mode in ("on", "off"):
        return mode == "on"
    if config.runner == "simulated":
        return True
    from .model import resolve_device  # torch.cuda.is_available() creates no CUDA context here

    if resolve_device(config.device).type != "cpu":
        return True
    return 0 < config.torch_threads < len(os.sched_getaffinity(0))
