"""A discrete-event simulator of an engine driven by a batcher: compare admission policies."""

from .cost import StepCost
from .policies import POLICIES, make_batcher
from .simulator import simulate, simulate_mixed, simulate_policies, simulate_tenants
from .trace import TraceRequest, load_trace, mixed_priority, sharegpt_like, two_tenants

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
    "simulate_tenants",
    "two_tenants",
]
