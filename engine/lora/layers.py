"""Many LoRA adapters in one forward pass: every linear layer of the model gets the delta of each
request's adapter on that request's rows only (a segmented LoRA matmul: one gather per adapter present
in the step, not one batch per adapter), the base rows untouched.

Under torch.compile the delta is one opaque op per layer (like paged attention's, attention/paged.py)
that reads the step's rows from the runner's context, so a step's mix of adapters changes no graph.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .adapter import LoraAdapter

# set by the runner around each forward, per thread: (the resident set, [(adapter, rows)])
_step = threading.local()


class LoraLinear(torch.nn.Module):
    """A base linear layer plus the step's adapters' deltas; `index` names it in the resident set."""

    def __init__(self, base: torch.nn.Linear, index: int) -> None:
        super().__init__()
        self.base = base
        self.index = index
        self.out_features = base.out_features

    @property
    def weight(self) -> torch.Tensor:  # what the model's code may read of a linear layer
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if torch.compiler.is_compiling():
            return y + torch.ops.weightq.lora_delta(x, self.index, self.out_features)
        segments = getattr(_step, "segments", None)
        if not segments:
            return y
        return y + _delta(x, self.index, self.out_features)


class Resident:
    """The adapters this engine serves, by name, and each linear layer's share of their weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.adapters: dict[str, LoraAdapter] = {}
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []  # per LoraLinear: adapter -> (A, B)
        self._index: dict[str, int] = {}  # module name -> its LoraLinear's index
        self.targets: dict[str, torch.nn.Linear] = {}  # module name -> the base layer adapters may target
        skip = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and module is not skip:
                parent, _, child = name.rpartition(".")
                self._index[name] = len(self.layers)
                self.targets[name] = module
                self.layers.append({})
                setattr(model.get_submodule(parent) if parent else model, child, LoraLinear(module, self._index[name]))

    def add(self, adapter: LoraAdapter) -> None:
        missing = [m for m in adapter.weights if m not in self._index]
        if missing:
            raise ValueError(f"adapter {adapter.name!r}: {missing[0]} is not a linear layer adapters can target")
        self.remove(adapter.name)
        self.adapters[adapter.name] = adapter
        for module, ab in adapter.weights.items():
            self.layers[self._index[module]][adapter.name] = ab

    def remove(self, name: str) -> LoraAdapter | None:
        adapter = self.adapters.pop(name, None)
        if adapter is not None:
            for layer in self.layers:
                layer.pop(name, None)
        return adapter


@contextmanager
def lora_context(resident: Resident | None, segments: list[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """The step's rows of each adapter (`segments`), for every LoraLinear of the forward inside."""
    _step.resident, _step.segments = resident, segments
    try:
        yield
    finally:
        _step.resident, _step.segments = None, None


def _delta(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    resident: Resident = _step.resident
    weights = resident.layers[index]
    flat = x.reshape(-1, x.shape[-1])
    out = flat.new_zeros(flat.shape[0], out_features)
    for name, rows in _step.segments:
        ab = weights.get(name)
        if ab is None:  # this adapter leaves the layer as it is
            continue
        a, b = ab
        out.index_copy_(0, rows, (flat.index_select(0, rows) @ a.t()) @ b.t())
    return out.view(*x.shape[:-1], out_features)


@torch.library.custom_op("weightq::lora_delta", mutates_args=())
def _lora_delta_op(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    if not getattr(_step, "segments", None):
        return x.new_zeros(*x.shape[:-1], out_features)
    return _delta(x, index, out_features)


@_lora_delta_op.register_fake
def _(x, index, out_features) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
