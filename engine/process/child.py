"""The engine process's side: build the Engine, report Ready (or Failed), run it, turn each step's
events into one Step message, and obey the parent's commands until Stop or until the parent is gone."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

from ..config import EngineConfig
from ..heap import freeze_startup_heap
from ..loop.engine import Engine
from ..lora import AdapterError
from ..params import Event, FinishEvent, TokenEvent
from ..sink import TokenTuple
from .messages import Cancel, Failed, LoadAdapter, Message, Ready, Step, Stop, Stopped, Submit, UnloadAdapter

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.1  # a stats snapshot rides on a step message at most this often (and when idle)


class StepSender:
    """The child engine's sink: a step's events leave as one message, sent from the engine thread at
    the end of the step (a sender thread would wait for the GIL behind the forward pass, delaying tokens)."""

    def __init__(self, out: Connection) -> None:
        self.out = out
        self.engine: Engine | None = None  # set once built (warm-up steps run before: they send nothing)
        self.tokens: list[TokenTuple] = []
        self.finishes: list[FinishEvent] = []
        self.submits_seen = 0
        self._last_stats = 0.0
        self._lock = threading.Lock()  # the engine thread and the command thread (its final message)

    def __call__(self, event: Event, emitted: float | None = None) -> None:
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
        msg = Step(time.time(), self.tokens, self.finishes, stats)
        self.tokens, self.finishes = [], []
        self.send(msg)

    def snapshot(self) -> dict:
        engine = self.engine
        assert engine is not None
        return engine.stats() | {"room_for": engine.room_for(), "submits_seen": self.submits_seen}

    def send(self, msg: Message) -> None:
        try:
            with self._lock:
                self.out.send(msg)
        except (OSError, EOFError):
            os._exit(0)  # the parent is gone


def child_main(config: EngineConfig, commands: Connection, out: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (warm shutdown), not the terminal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/engine-core] %(message)s")
    try:
        sender = StepSender(out)
        engine = sender.engine = Engine(config, sink=sender)
    except BaseException as e:  # reported to the parent, which raises it
        try:
            out.send(Failed(e))
        except Exception:
            out.send(Failed(repr(e)))
        return
    out.send(Ready(engine.kv_derivation, engine.max_input_length, sender.snapshot()))
    freeze_startup_heap()  # a full collection here stops the engine's step
    engine.start()
    while True:
        try:
            cmd = commands.recv()
        except (EOFError, OSError):
            os._exit(0)  # the parent died: nothing to serve
        match cmd:
            case Submit(request):
                sender.submits_seen += 1
                engine.submit(request)
            case Cancel(request_id):
                engine.cancel(request_id)
            case LoadAdapter(name, path):
                try:
                    engine.load_adapter(name, path)
                except AdapterError as e:  # in the stats' adapter_errors: the parent reads them there
                    log.warning("%s", e)
            case UnloadAdapter(name):
                engine.unload_adapter(name)
            case Stop(reason, message):
                engine.stop(reason, message)
                sender.flush()
                sender.send(Stopped(sender.snapshot()))
                return
