"""The engine's LoRA adapters at run time: loads and unloads from any thread (the worker's, the engine
process's command loop), and once per step, on the engine thread, the batcher's slot decisions applied
to the stacks before the forward (batcher/adapters.py decides; layers.py: Resident holds)."""

from __future__ import annotations

import torch
from weightq.batcher import Batcher

from .adapter import AdapterError, read_adapter
from .layers import Resident


class AdapterControl:
    def __init__(self, resident: Resident | None, dtype: torch.dtype, allow_download: bool) -> None:
        self.resident = resident
        self.dtype, self.allow_download = dtype, allow_download
        self.errors: dict[str, str] = {}  # adapters that failed to load at run time, and why (stats)

    def load(self, name: str, path: str) -> None:
        """Serve a LoRA adapter from now on, read onto the host here (a request naming it gets a slot
        when admitted). Raises AdapterError naming the adapter and why; stats keep the reason."""
        try:
            if self.resident is None:
                raise AdapterError(f"adapter {name!r}: LoRA is not enabled here (ENABLE_LORA=1 or LORA_MODULES)")
            self.resident.add(read_adapter(name, path, self.resident, self.dtype, self.allow_download))
        except (AdapterError, ValueError) as e:
            self.errors[name] = str(e)
            raise AdapterError(str(e)) from None
        self.errors.pop(name, None)

    def unload(self, name: str) -> bool:
        """New requests may no longer name it; its slot is freed once its running requests end."""
        return self.resident is not None and self.resident.unload(name)

    def apply(self, batcher: Batcher) -> None:
        """(Engine thread, after the batcher planned the step) unloads reach the batcher (their slots
        free from the next step), the adapters admitted requests need are copied into their slots,
        and slots the batcher took back are forgotten."""
        resident = self.resident
        if resident is None:
            return
        for name in resident.take_unloaded():
            batcher.unload_adapter(name)
        for name, slot in batcher.adapter_loads():
            resident.place(name, slot)
        resident.sync(batcher.adapters.slot_of)
