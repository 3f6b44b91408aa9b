"""Which LoRA adapters hold a slot of the engine's adapter stacks, and what the slots cost the budget.

A slot holds one adapter at the engine's largest rank on every layer (engine/lora/layers.py), so every
slot weighs the same: `slot_weight` tokens of KV. Slots are allocated on demand, each taking its
weight out of the batcher's budget for good: a request whose adapter holds no slot is admitted only if
the projection fits with one more slot's weight gone, unless a slot is free or an adapter no running
request uses can give its up (the least recently used). So the memory adapters take is counted at the
step it is taken, and the projection stays exact.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .request import RequestRejected

NEVER = 1 << 62  # a weight no budget holds


@dataclass(slots=True)
class AdapterSlots:
    slot_weight: int = 0  # 0: adapters are not served (every request is the base model's)
    # the most slots: the budget they leave still holds one request of max_total_tokens (none wait forever)
    max_capacity: int = 0
    capacity: int = 0  # slots allocated: capacity x slot_weight is out of the budget
    slot_of: dict[str, int] = field(default_factory=dict)  # resident adapter -> its slot
    users: Counter[str] = field(default_factory=Counter)  # running requests per adapter
    last_used: dict[str, int] = field(default_factory=dict)  # resident adapter -> the step it last started
    gone: set[str] = field(default_factory=set)  # unloaded while in use: its slot is freed at its last release
    loads: list[tuple[str, int]] = field(default_factory=list)  # (adapter, slot) placed since the engine looked

    @classmethod
    def sized(cls, slot_weight: int, room: int) -> AdapterSlots:
        """Slots of `slot_weight` each (0: adapters are not served), as many as fit in `room` (the budget
        less one request of max_total_tokens, so that none waits forever)."""
        return cls(slot_weight, room // slot_weight if slot_weight else 0)

    def check(self, adapter: str) -> None:
        """Refuse a request whose adapter could never hold a slot."""
        if not self.max_capacity:
            raise RequestRejected(
                "model",
                f"adapter {adapter!r}: no LoRA adapter slot fits (one takes {self.slot_weight} tokens of "
                "max_batch_weight, which must still hold one request of max_total_tokens)",
            )

    def extra_weight(self, adapter: str) -> int:
        """What admitting a request of `adapter` takes out of the budget: one more slot, unless the
        adapter is resident, a slot is free, or an unused adapter can give its slot up; NEVER while
        every slot there may be is held by adapters in use (it waits for one to be released)."""
        if not adapter or adapter in self.slot_of:
            return 0
        if len(self.slot_of) < self.capacity or self._evictable() is not None:
            return 0
        return self.slot_weight if self.capacity < self.max_capacity else NEVER

    def acquire(self, adapter: str, step: int) -> int:
        """A request of `adapter` starts: its slot (placing the adapter there if it held none; the
        engine copies its weights in before the step runs: `loads`). Returns the weight taken out of
        the budget (a new slot's, or 0)."""
        if not adapter:
            return 0
        self.users[adapter] += 1
        self.last_used[adapter] = step
        if adapter in self.slot_of:
            return 0
        grown = 0
        taken = set(self.slot_of.values())
        free = next((s for s in range(self.capacity) if s not in taken), None)
        if free is None and (victim := self._evictable()) is not None:
            free = self.slot_of.pop(victim)
            self.last_used.pop(victim, None)
        if free is None:
            free, grown = self.capacity, self.slot_weight
            self.capacity += 1
        self.slot_of[adapter] = free
        self.loads.append((adapter, free))
        return grown

    def release(self, adapter: str) -> None:
        """A request of `adapter` left the running set; an adapter unloaded meanwhile gives its slot up."""
        if not adapter:
            return
        self.users[adapter] -= 1
        if self.users[adapter] <= 0:
            del self.users[adapter]
            if adapter in self.gone:
                self.forget(adapter)

    def forget(self, adapter: str) -> None:
        """`adapter` is unloaded: its slot is free now, or once no running request uses it."""
        if self.users.get(adapter):
            self.gone.add(adapter)
            return
        self.gone.discard(adapter)
        self.slot_of.pop(adapter, None)
        self.last_used.pop(adapter, None)

    def drain(self) -> list[tuple[str, int]]:
        """The (adapter, slot) placements the engine has not applied yet."""
        out, self.loads = self.loads, []
        return out

    def _evictable(self) -> str | None:
        idle = [a for a in self.slot_of if not self.users.get(a)]
        return min(idle, key=lambda a: self.last_used.get(a, -1)) if idle else None
