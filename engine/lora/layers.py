"""Many LoRA adapters in one forward pass: every linear layer of the model gets the delta of each
request's adapter on that request's rows only, the base rows untouched: x @ A_all^T (every adapter's A
stacked), masked to each row's own adapter's slot, @ B_all: two matmuls per layer whatever the mix (a
gathered LoRA matmul, not one batch per adapter; a loop over the adapters present cost 3x at 8).

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
    """The adapters this engine serves, by name, stacked per linear layer: A of every adapter in one
    [slots x rank, in] matrix and B in one [slots x rank, out] (ranks padded to the largest, zeros where
    an adapter leaves the layer), so a step's delta is two matmuls whatever its mix of adapters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: dict[str, int] = {}  # adapter -> its block of rows in every stack
        self.rank = 0  # every slot's width: the largest rank among the adapters
        self.stacks: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per LoraLinear; None: no adapter
        self._index: dict[str, int] = {}  # module name -> its LoraLinear's index
        self.targets: dict[str, torch.nn.Linear] = {}  # module name -> the base layer adapters may target
        skip = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and module is not skip:
                parent, _, child = name.rpartition(".")
                self._index[name] = len(self.stacks)
                self.targets[name] = module
                self.stacks.append(None)
                setattr(model.get_submodule(parent) if parent else model, child, LoraLinear(module, self._index[name]))

    @property
    def nbytes(self) -> int:
        """The stacks' memory: what the budget gives up for the adapters (ranks padded to the largest)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in filter(None, self.stacks))

    def add(self, adapter: LoraAdapter) -> None:
        missing = [m for m in adapter.weights if m not in self._index]
        if missing:
            raise ValueError(f"adapter {adapter.name!r}: {missing[0]} is not a linear layer adapters can target")
        self.adapters[adapter.name] = adapter
        self._restack()

    def remove(self, name: str) -> LoraAdapter | None:
        adapter = self.adapters.pop(name, None)
        if adapter is not None:
            self._restack()
        return adapter

    def _restack(self) -> None:
        names = sorted(self.adapters)
        self.slots = {name: i for i, name in enumerate(names)}
        self.rank = r = max((a.rank for a in self.adapters.values()), default=0)
        for module, i in self._index.items():
            held = [
                (self.slots[n], self.adapters[n].weights[module]) for n in names if module in self.adapters[n].weights
            ]
            if not held:
                self.stacks[i] = None
                continue
            a0 = held[0][1][0]
            base = self.targets[module]
            a_cat = a0.new_zeros(len(names) * r, base.in_features)
            b_cat = a0.new_zeros(len(names) * r, base.out_features)
            for slot, (a, b) in held:
                a_cat[slot * r : slot * r + a.shape[0]] = a
                b_cat[slot * r : slot * r + a.shape[0]] = b.t()
            self.stacks[i] = (a_cat, b_cat)

    def step_view(
        self, segments: list[tuple[str, torch.Tensor]], rows: int, like: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the slots of the adapters present, or None when all are; [rows, present x rank]: 1 where a
        row's adapter's slot is, 0 elsewhere, the base's rows all 0). Only the present adapters' slots
        are multiplied: a step's cost follows its mix, not how many adapters are resident."""
        present = sorted(self.slots[name] for name, _ in segments)
        where = {slot: i for i, slot in enumerate(present)}
        m = like.new_zeros(rows, len(present), self.rank)
        for name, idx in segments:
            m[idx, where[self.slots[name]]] = 1
        chosen = None if len(present) == len(self.slots) else torch.tensor(present, device=like.device)
        return chosen, m.view(rows, -1)


@contextmanager
def lora_context(resident: Resident | None, segments: list[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """The step's rows of each adapter (`segments`), for every LoraLinear of the forward inside."""
    _step.resident, _step.segments, _step.view = resident, segments, None
    try:
        yield
    finally:
        _step.resident, _step.segments, _step.view = None, None, None


def _delta(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    resident: Resident = _step.resident
    stack = resident.stacks[index]
    if stack is None:  # no adapter changes this layer
        return x.new_zeros(*x.shape[:-1], out_features)
    a_cat, b_cat = stack
    flat = x.reshape(-1, x.shape[-1])
    view = getattr(_step, "view", None)
    if view is None or view[1].shape[0] != flat.shape[0]:  # once per step: every layer shares it
        _step.view = view = resident.step_view(_step.segments, flat.shape[0], flat)
    chosen, mask = view
    if chosen is not None:  # only the slots of the adapters in this step
        r = resident.rank
        a_cat = a_cat.view(-1, r, a_cat.shape[1]).index_select(0, chosen).view(-1, a_cat.shape[1])
        b_cat = b_cat.view(-1, r, b_cat.shape[1]).index_select(0, chosen).view(-1, b_cat.shape[1])
    return ((flat @ a_cat.t()) * mask @ b_cat).view(*x.shape[:-1], out_features)


@torch.library.custom_op("weightq::lora_delta", mutates_args=())
def _lora_delta_op(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    if not getattr(_step, "segments", None):
        return x.new_zeros(*x.shape[:-1], out_features)
    return _delta(x, index, out_features)


@_lora_delta_op.register_fake
def _(x, index, out_features) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
