"""Many LoRA adapters in one forward pass: every linear layer of the model gets the delta of each
request's adapter on that request's rows only, the base rows untouched. The step's rows of each adapter
present are gathered into one batch row (padded to the longest), then two batched matmuls with the
present slots' A and B (a gathered LoRA matmul, not one batch per adapter). A loop over the adapters
costs a matmul pair per adapter present, growing with their number; multiplying every row by every
slot's A, masked, costs the whole stack's FLOPs.

Under torch.compile the delta is one opaque op per layer (like paged attention's, attention/paged.py)
that reads the step's rows from the runner's context, so a step's mix of adapters changes no graph.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
        if torch.compiler.is_compiling():  # the add is fused with what follows; an op adding in place is slower
            return y + torch.ops.weightq.lora_delta(x, self.index, self.out_features)
        if not getattr(_step, "segments", None):
            return y
        return y + _delta(x, self.index, self.out_features)


class Resident:
    """The adapters this engine serves and the stacks that hold the resident ones: per linear layer,
    A of every slot in one [capacity x rank, in] matrix and B in one [capacity x rank, out] (zeros where
    an adapter leaves the layer or has a smaller rank), so a step's delta is two matmuls whatever its
    mix. Which adapter holds which slot is the batcher's decision (batcher/adapters.py: AdapterSlots);
    `place` applies it on the engine thread before the step runs."""

    def __init__(self, model: torch.nn.Module, rank: int) -> None:
        self.rank = rank  # every slot's width: the largest rank served (MAX_LORA_RANK)
        self.host: dict[str, LoraAdapter] = {}  # loaded adapters' weights, resident or not
        self.accepting: set[str] = set()  # adapters new requests may name (unloaded ones leave at once)
        self.slots: dict[str, int] = {}  # resident adapter -> its slot
        self.capacity = 0
        self.stacks: list[tuple[torch.Tensor, torch.Tensor]] = []  # per LoraLinear
        self.targets: dict[str, torch.nn.Linear] = {}  # module name -> the base layer adapters may target
        self._index: dict[str, int] = {}  # module name -> its LoraLinear's index
        self._unloaded: list[str] = []  # names the engine thread has yet to forget (other threads add)
        skip = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and module is not skip:
                parent, _, child = name.rpartition(".")
                self._index[name] = len(self.stacks)
                self.targets[name] = module
                w = module.weight
                self.stacks.append(
                    (w.new_zeros(0, rank, module.in_features), w.new_zeros(0, rank, module.out_features))
                )
                setattr(model.get_submodule(parent) if parent else model, child, LoraLinear(module, self._index[name]))

    @property
    def adapters(self) -> list[str]:
        return sorted(self.accepting)

    @property
    def slot_bytes(self) -> int:
        """One slot's memory: every layer adapters may target, at the largest rank."""
        size = next(iter(self.targets.values())).weight.element_size() if self.targets else 4
        return sum(self.rank * (t.in_features + t.out_features) * size for t in self.targets.values())

    def add(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` from now on (its weights stay on the host until a request needs a slot)."""
        missing = [m for m in adapter.weights if m not in self._index]
        if missing:
            raise ValueError(f"adapter {adapter.name!r}: {missing[0]} is not a linear layer adapters can target")
        if adapter.rank > self.rank:
            raise ValueError(f"adapter {adapter.name!r}: rank {adapter.rank} exceeds max_lora_rank {self.rank}")
        if adapter.name in self.host:
            raise ValueError(f"adapter {adapter.name!r} is already loaded")
        self.host[adapter.name] = adapter
        self.accepting.add(adapter.name)

    def unload(self, name: str) -> bool:
        """New requests may no longer name it; its slot is freed once its running requests end."""
        if name not in self.accepting:
            return False
        self.accepting.discard(name)
        self._unloaded.append(name)
        return True

    def take_unloaded(self) -> list[str]:
        """(Engine thread) adapters unloaded since the last call: the batcher frees their slots."""
        out, self._unloaded = self._unloaded, []
        return out

    def sync(self, slot_of: dict[str, int]) -> None:
        """(Engine thread) forget the slots the batcher took back; an unloaded adapter's weights go too."""
        for name in [n for n in self.slots if n not in slot_of]:
            del self.slots[name]
        for name in [n for n in self.host if n not in self.accepting and n not in self.slots]:
            del self.host[name]

    def place(self, name: str, slot: int) -> None:
        """(Engine thread) copy `name`'s weights into `slot`, growing the stacks when it is new."""
        if slot >= self.capacity:
            self._grow(slot + 1)
        adapter = self.host[name]
        for owner in [n for n, s in self.slots.items() if s == slot]:
            del self.slots[owner]
            if owner not in self.accepting:
                self.host.pop(owner, None)
        self.slots[name] = slot
        for module, i in self._index.items():
            a_stack, b_stack = self.stacks[i]
            a_stack[slot] = 0
            b_stack[slot] = 0
            if module in adapter.weights:
                a, b = adapter.weights[module]
                a_stack[slot, : a.shape[0]] = a.to(a_stack.device)
                b_stack[slot, : a.shape[0]] = b.t().to(b_stack.device)

    def _grow(self, capacity: int) -> None:
        for i, (a_stack, b_stack) in enumerate(self.stacks):
            a_new = a_stack.new_zeros(capacity, self.rank, a_stack.shape[2])
            b_new = b_stack.new_zeros(capacity, self.rank, b_stack.shape[2])
            a_new[: a_stack.shape[0]], b_new[: b_stack.shape[0]] = a_stack, b_stack
            self.stacks[i] = (a_new, b_new)
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        """The stacks' memory (capacity x slot_bytes): what the budget has given up for adapters."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.stacks)

    def step_view(self, segments: list[tuple[str, list[int]]], num_rows: int, device: torch.device) -> StepView:
        """How this step's adapter rows go through the stacks: each slot's rows gathered into a row of
        [slots, longest, in] (padded with row 0), so every layer's delta is two batched matmuls, each
        row multiplied only by its own adapter; the padding lands on a spare row past the step's. Every
        slot, or only the present ones' (copied out of the stacks) when the padding would cost more.
        (Every row times every slot's A, masked to its own, is slower even for decode steps: the
        stack's FLOPs.)"""
        mine = {self.slots[name]: rows for name, rows in segments}
        longest = max(len(rows) for rows in mine.values())
        every = (self.capacity - len(mine)) * longest <= len(mine) * self.rank
        order = list(range(self.capacity)) if every else sorted(mine)
        gather: list[int] = []
        rows: list[int] = []
        for slot in order:
            got = mine.get(slot, [])
            gather += got + [0] * (longest - len(got))
            rows += got + [num_rows] * (longest - len(got))
        as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return StepView(None if every else as_t(order), as_t(gather), as_t(rows), len(order), longest)


@dataclass(frozen=True, slots=True)
class StepView:
    slots: torch.Tensor | None  # the slots multiplied (None: every slot, in order)
    gather: torch.Tensor  # [slots x longest] rows of the step, each slot's padded to the longest
    rows: torch.Tensor  # where each lands: its row, or the spare row past the step's for the padding
    present: int
    longest: int


@contextmanager
def lora_context(resident: Resident | None, segments: list[tuple[str, list[int]]]) -> Iterator[None]:
    """The step's rows of each adapter (`segments`), for every LoraLinear of the forward inside."""
    _step.resident, _step.segments, _step.view = resident, segments, None
    try:
        yield
    finally:
        _step.resident, _step.segments, _step.view = None, None, None


def _delta(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    """Each adapter row's delta, (x[row] @ A^T) @ B of its adapter; zeros at the base's rows."""
    resident: Resident = _step.resident
    a_stack, b_stack = resident.stacks[index]  # [capacity, rank, in], [capacity, rank, out]
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    view = getattr(_step, "view", None)
    if view is None:  # once per step: every layer shares it
        _step.view = view = resident.step_view(_step.segments, n, flat.device)
    if view.slots is not None:
        a_stack, b_stack = a_stack.index_select(0, view.slots), b_stack.index_select(0, view.slots)
    xg = flat.index_select(0, view.gather).view(view.present, view.longest, flat.shape[1])
    delta = torch.bmm(torch.bmm(xg, a_stack.transpose(1, 2)), b_stack).view(-1, out_features)
    out = flat.new_zeros(n + 1, out_features).index_copy_(0, view.rows, delta)
    return out[:n].view(*x.shape[:-1], out_features)


@torch.library.custom_op("weightq::lora_delta", mutates_args=())
def _lora_delta_op(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    if not getattr(_step, "segments", None):
        return x.new_zeros(*x.shape[:-1], out_features)
    return _delta(x, index, out_features)


@_lora_delta_op.register_fake
def _(x, index, out_features) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
