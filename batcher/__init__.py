"""weightq's batcher: weight-aware admission, pure Python (no torch, Redis or Celery)."""

from .batcher import Batcher
from .blocks import BlockLedger, chain_keys
from .config import BatcherConfig, ConfigError
from .estimator import OutputLengthEstimator
from .plan import BatcherStats, StepPlan
from .projection import Entry, PaddedProfile, TokenProfile
from .request import DEFAULT_PRIORITY, TOP_PRIORITY, Request, RequestRejected
from .weight import PaddedWeight, TokenWeight, weight_model

__all__ = [
    "DEFAULT_PRIORITY",
    "TOP_PRIORITY",
    "Batcher",
    "BatcherConfig",
    "BatcherStats",
    "BlockLedger",
    "ConfigError",
    "Entry",
    "OutputLengthEstimator",
    "PaddedProfile",
    "PaddedWeight",
    "Request",
    "RequestRejected",
    "StepPlan",
    "TokenProfile",
    "TokenWeight",
    "chain_keys",
    "weight_model",
]
