"""The engine in a process of its own: the parent's EngineProcess (parent.py), the child's loop
(child.py) and the typed messages between them (messages.py)."""

from __future__ import annotations

import os

from ..config import EngineConfig
from ..loop.engine import Engine
from .parent import EngineDied, EngineProcess

__all__ = ["AnyEngine", "EngineDied", "EngineProcess", "own_process"]

AnyEngine = Engine | EngineProcess  # what a worker hosts: the engine in its process or in its own


def own_process(mode: str, config: EngineConfig) -> bool:
    """ENGINE_PROCESS: "on", "off", or "auto": on where the device is not the CPU (CUDA, and the
    simulated device that stands for one), and on the CPU where the engine's threads
    (`config.torch_threads`, set: a worker's come from setup.serving_threads) leave a core to the
    rest of the process. There the engine's thread does not wait for the GIL behind Celery's threads
    and the stream writer, as it would in the worker's process. With every core in the forward's team
    the extra process and its per-step message cost more than the GIL they free."""
    if mode in ("on", "off"):
        return mode == "on"
    if config.runner == "simulated":
        return True
    from ..model import resolve_device  # torch.cuda.is_available() creates no CUDA context here

    if resolve_device(config.device).type != "cpu":
        return True
    return 0 < config.torch_threads < len(os.sched_getaffinity(0))
