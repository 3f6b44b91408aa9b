"""What the engine loop needs of a runner, and the paged memory the paged and simulated runners share.

A runner turns one step's work into logits: the paged runner (paged.py) packs every sequence's tokens
into one row over the paged KV cache, the padded runner (padded.py) keeps a left-padded batch in the
model's own cache, the simulated runner (simulated.py) stands in for a device. The loop, the worker
and the front doors do not know which one runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from weightq.batcher import BlockLedger, Request

from ..lora import Resident
from .kv_cache import KVCache


class HasTokens(Protocol):
    token_ids: list[int]
    block_table: list[int]
    sched: Request  # the batcher's view: its rings, for a model with sliding-window layers


@dataclass(slots=True)
class Work:
    """Feed tokens [start, start + n) of `seq` this step; `emits` when the last one yields logits."""

    seq: HasTokens
    start: int
    n: int
    emits: bool


class Runner(Protocol):
    """What the engine loop needs of a runner (the paged ModelRunner here, the PaddedRunner in
    padded.py; a third, e.g. a simulated device, implements the same)."""

    compiled: bool  # its shapes are compiled: the engine warms them up before serving
    can_isolate: bool  # a failed step can be retried request by request (False: one batch, one fate)
    model_s: float  # seconds spent inside the model's forward so far
    # forward() may return before the device is done (its logits are read after synchronize()): the
    # engine then does the last step's detokenization and events in between, while the device runs.
    asynchronous: bool
    # it can return the logits of prompt positions (prompt log-probabilities): see ModelRunner.prompt_rows
    prompt_logprobs: bool
    lora: Resident | None  # the LoRA adapters it serves (None: adapters are not enabled)

    def synchronize(self) -> None:
        """Wait until the last forward's logits are ready (and count its device time in model_s)."""

    def ensure(self, seq: HasTokens, tokens: int) -> None:
        """Make room for `tokens` tokens of `seq` (the batcher guarantees the memory suffices)."""

    def release(self, seq: HasTokens) -> None:
        """Free what `seq` holds."""

    def forward(self, prefill: list[Work], decode: list[Work]) -> torch.Tensor:
        """One step: the logits of every emitting work item, prefill first, in order."""
        ...

    def memory(self) -> dict:
        """Memory counters for stats()."""
        ...

    def check(self, seqs: list, budget: int) -> None:
        """Assert the runner's own accounting agrees with the batcher's (tests and debugging)."""


class PagedMemory:
    """The memory side of a runner on a KVCache (the paged runner, the simulated device); the padded
    runner has the same methods over its own rows. The batcher hands out the blocks (its ledger):
    a sequence's block table is its batcher request's, filled before the step is planned."""

    cache: KVCache
    ledger: BlockLedger | None = None  # the batcher's, set when the engine is built (memory counters)
    lora: Resident | None = None  # the LoRA adapters it serves (builder.py: EngineConfig.lora_modules)
    asynchronous = False
    prompt_logprobs = False

    def synchronize(self) -> None:
        pass

    def ensure(self, seq: HasTokens, tokens: int) -> None:
        """The batcher gave `seq` its blocks (and rings) when it planned the step."""
        layout = self.cache.layout
        if layout.has_full and tokens > len(seq.block_table) * self.cache.block_size:
            raise RuntimeError(f"no KV block for token {tokens - 1}: the batcher did not allocate it")
        if layout.windows and len(seq.sched.rings) != len(layout.windows):
            raise RuntimeError(f"no KV ring for token {tokens - 1}: the batcher did not allocate it")

    def release(self, seq: HasTokens) -> None:
        """The batcher took the blocks back when the request left it."""

    def memory(self) -> dict:
        c, ledger = self.cache, self.ledger
        out = {"kv_blocks_total": c.num_blocks, "block_size": c.block_size}
        if ledger is not None:
            out |= {"kv_blocks_used": ledger.used, "prefix_cached_blocks": ledger.idle}
        return out

    def check(self, seqs: list, budget: int) -> None:
        """Invariants after a step (tests): the batcher's check_memory covers the blocks."""
