"""weightq's engine: transformers models over a paged KV cache, continuously batched.

Its dependencies (torch, transformers, tokenizers, safetensors) are the `worker` extra: a web app or a
gateway installs weightq without them, and importing the engine there says what to install.
"""

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        f"weightq's engine needs {e.name}, which is not installed: pip install 'weightq[worker]'", name=e.name
    ) from None

from weightq.batcher.outlook import Urgency  # what a worker's intake reads (Engine.urgency)

from .builder import serving_threads
from .config import EngineConfig
from .handle import Handle
from .heap import freeze_startup_heap
from .loop.engine import Engine
from .model import LoadedModel, ModelNotFound, load_model
from .params import Event, FinishEvent, GenerationRequest, InvalidRequest, SamplingParams, TokenEvent
from .process import AnyEngine, EngineDied, EngineProcess, own_process
from .sink import Sink, TokenSink

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
    "Sink",
    "TokenEvent",
    "TokenSink",
    "Urgency",
    "freeze_startup_heap",
    "load_model",
    "own_process",
    "serving_threads",
]
