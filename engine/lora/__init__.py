"""Multi-LoRA serving: PEFT adapters read and checked (adapter.py), applied per request inside one
mixed forward pass (layers.py)."""

from .adapter import AdapterError, LoraAdapter, load_adapter, parse_modules, read_adapter
from .control import AdapterControl
from .layers import LoraLinear, Resident, lora_context

__all__ = [
    "AdapterControl", "AdapterError", "LoraAdapter", "LoraLinear", "Resident", "load_adapter", "lora_context",
    "parse_modules", "read_adapter",
]  # fmt: skip
