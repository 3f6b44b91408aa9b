"""Loading a transformers model for the engine (loading.py), and the built-in tiny models (builtin.py)."""

from .builtin import BUILTIN_PREFIX, builtin_path
from .loading import LoadedModel, ModelNotFound, choose_runner, load_model, resolve_device, resolve_dtype

__all__ = [
    "BUILTIN_PREFIX",
    "LoadedModel",
    "ModelNotFound",
    "builtin_path",
    "choose_runner",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]
