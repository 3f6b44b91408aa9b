"""weightq's engine: transformers models over a paged KV cache, continuously batched."""

from .config import EngineConfig
from .core_process import AnyEngine, EngineDied, EngineProcess, own_process
from .handle import Handle
from .heap import freeze_startup_heap
from .loop import Engine
from .models import LoadedModel, ModelNotFound, load_model
from .params import Event, FinishEvent, GenerationRequest, InvalidRequest, SamplingParams, TokenEvent
from .setup import serving_threads

__all__ = [
    "AnyEngine",
    "Engine",
    "EngineConfig",
    "EngineDied",
    "EngineProcess",
    "Event",
    "FinishEvent",
    "GenerationRequest",
    "Handle",
    "InvalidRequest",
    "LoadedModel",
    "ModelNotFound",
    "SamplingParams",
    "TokenEvent",
    "freeze_startup_heap",
    "load_model",
    "own_process",
    "serving_threads",
]
