"""The engine's loop: the Engine (engine.py) and the parts it is composed of — the caller side
(intake.py: submits, cancels, handles; prepare.py: a request checked and made a Sequence), the
output side of a step (outputs.py), a failed forward's isolation (isolate.py), the counters and
stats (stats.py), and the compile warm-up (warmup.py)."""

from .engine import Engine

__all__ = ["Engine"]
