"""A discrete-event simulator of an engine driven by a batcher: compare admission policies."""

from .cost import StepCost
from .policies import POLICIES, make_batcher
from .simulator import simulate, simulate_mixed, simulate_policies
from .trace import TraceRequest, load_trace, mixed_priority, sharegpt_like

__all__ = [
    "POLICIES",
    "StepCost",
    "TraceRequest",
    "load_trace",
    "make_batcher",
    "mixed_priority",
    "sharegpt_like",
    "simulate",
    "simulate_mixed",
    "simulate_policies",
]
