"""A worker's heartbeat, as every reader meets it: encoded once by the worker (`encode`), decoded once
by whoever reads `weightq:workers` (`Heartbeat.decode`), so no reader spells a key of the JSON.

The worker publishes its whole stats every second (the engine's, the host's, its metrics' snapshot);
the fields below are what the web side acts on, typed, and `stats` keeps the rest for metrics and
operators (Prometheus' collectors, `weightq up`'s summary, Flower's inspect).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

STALE_S = 15.0  # a heartbeat older than this belongs to a worker that is gone


@dataclass(frozen=True, slots=True)
class Outlook:
    """The batcher's outlook (batcher/outlook.py: `outlook`): when the running requests will finish, in
    steps from now (ascending, each standing for `running / len(finish_steps)` requests), the slots a
    step can hold, the requests waiting per class and the mean output of recent requests."""

    finish_steps: tuple[int, ...]
    running: int
    slots: int
    waiting: Mapping[int, int]
    mean_output: float

    @classmethod
    def decode(cls, raw: Any) -> Outlook | None:
        if not isinstance(raw, Mapping):
            return None
        points = tuple(int(x) for x in raw.get("finish_steps", ()))
        running = int(raw.get("running", len(points)))
        waiting = {int(k): int(v) for k, v in (raw.get("waiting") or {}).items()}
        return cls(points, running, int(raw.get("slots", running)), waiting, float(raw.get("mean_output") or 0.0))


@dataclass(frozen=True, slots=True)
class Heartbeat:
    name: str  # the worker's hostname (its key in weightq:workers)
    ts: float  # when it was written (unix s)
    queue: str  # the queue it serves
    own_queue: str | None  # where clients route its prefixes (AFFINITY), None when off
    served_model: str
    max_input_length: int
    max_total_tokens: int
    max_batch_weight: int
    structured: bool  # can serve `guided` (xgrammar installed)
    lora: bool  # serves LoRA adapters
    adapters: tuple[str, ...]  # the LoRA adapters it holds, by name
    outlook: Outlook | None
    step_s: float  # recent seconds per engine step (0: not known yet)
    stats: Mapping[str, Any] = field(repr=False)  # everything the worker reported

    @classmethod
    def decode(cls, name: str | bytes, raw: str | bytes) -> Heartbeat | None:
        """None for a value that is not a heartbeat's JSON."""
        try:
            s = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(s, dict):
            return None
        step_s = float(s.get("recent_step_s") or 0.0)
        if step_s <= 0 and (steps := float(s.get("steps") or 0)):
            step_s = float(s.get("step_s") or 0.0) / steps
        return cls(
            name=name.decode() if isinstance(name, bytes) else name,
            ts=float(s.get("ts") or 0.0),
            queue=str(s.get("queue") or ""),
            own_queue=s.get("own_queue") or None,
            served_model=str(s.get("served_model") or s.get("model") or ""),
            max_input_length=int(s.get("max_input_length") or 0),
            max_total_tokens=int(s.get("max_total_tokens") or 0),
            max_batch_weight=int(s.get("max_batch_weight") or 0),
            structured=bool(s.get("structured", True)),
            lora=bool(s.get("lora")),
            adapters=tuple(s.get("adapters") or ()),
            outlook=Outlook.decode(s.get("outlook")),
            step_s=step_s,
            stats=s,
        )

    def fresh(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) - self.ts <= STALE_S

    def serves(self, queue: str) -> bool:
        """Whether it takes `queue`'s jobs (a heartbeat that names no queue: the default one)."""
        return (self.queue or queue) == queue


def encode(stats: Mapping[str, Any], now: float | None = None) -> str:
    """The worker's side: its stats, stamped."""
    return json.dumps({**stats, "ts": time.time() if now is None else now})


def live(raw: Mapping, now: float | None = None) -> dict[str, Heartbeat]:
    """The fresh heartbeats of an HGETALL of weightq:workers, by worker name."""
    beats = (Heartbeat.decode(k, v) for k, v in raw.items())
    return {b.name: b for b in beats if b is not None and b.fresh(now)}
