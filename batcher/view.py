"""What the engine, the worker's outlook and admission read of the batcher: its weights and queue, never
changed here (the Batcher's own state, read through one place)."""

from __future__ import annotations

from .blocks import BlockLedger
from .config import BatcherConfig
from .fairness import TenantShares
from .paging import Paging
from .projection import PaddedProfile, TokenProfile
from .projector import Projector
from .queue import WaitingQueue
from .request import WAITING, Request
from .running import weight_with
from .weight import PaddedWeight, TokenWeight


class BatcherView:
    """Read-only queries of the Batcher (its base class: the state is the Batcher's)."""

    config: BatcherConfig
    weight: TokenWeight | PaddedWeight
    budget: int
    committed: int
    queue: WaitingQueue
    running: dict[str, Request]
    projector: Projector
    paging: Paging
    tenants: TenantShares

    def profile(self) -> TokenProfile | PaddedProfile: ...

    @property
    def waiting(self) -> list[Request]:
        """The waiting requests in admission order."""
        return self.queue.requests

    @property
    def ledger(self) -> BlockLedger | None:
        return self.paging.ledger  # the paged runner's pages (None for the padded weight)

    @property
    def shared_blocks_held(self) -> int:
        """Distinct cached blocks the running requests hold (each weighs once)."""
        return self.paging.shared.held_blocks

    def held_weight(self, req: Request) -> int:
        """The weight a running request holds now (what its tenant pays per step)."""
        return self.weight.own(req.context_len, req.shared_blocks)

    def batch_weight(self) -> int:
        """The weight the running requests hold now (their tokens so far, whole prompts included)."""
        return self.weight_with(0)

    def weight_with(self, more: int) -> int:
        """The running requests' weight with `more` tokens each (1: after the next step, if every one
        emits; a prefilling one emits with its last chunk: conservative by at most a block)."""
        return weight_with(self.running.values(), self.weight, self.paging.shared_weight, more)

    def room_for(self) -> int:
        """How many more requests of the typical size (recent admissions' reserved weight) would fit
        by the naive sum after everything already waiting (at its worst case) is admitted: what a
        worker may take from a shared queue without hoarding. Waiting work counts, not blocks:
        requests held back only by the prefill cap start within a few steps. Under a cap on running
        requests (max_batch_size), never more than the cap leaves."""
        w = self.weight
        typical = self.projector.typical or w.seq(self.config.max_total_tokens)
        pending = sum(w.seq(r.max_total) for r in self.waiting)
        room = max(0, (self.budget - self.committed - self.paging.shared_weight - pending) // typical)
        if cap := self.config.max_batch_size:
            room = min(room, max(0, cap - len(self.running) - len(self.waiting)))
        return room

    @property
    def slot_weight(self) -> float:
        """The budget over the cap on running requests (0: no cap): one running request's part of the
        batch where the count binds before the weight (TenantShares.use)."""
        cap = self.config.max_batch_size
        return self.budget / cap if cap else 0.0

    def projected_peak(self) -> int:
        return self.profile().peak() if self.running else 0

    def check_memory(self) -> None:
        """Invariants (tests): Paging.check, and the committed weight is the tenants' reserved weights."""
        running = list(self.running.values())
        self.profile()
        self.paging.check(running, self.batch_weight(), self.projector.finish_of)
        assert self.committed == sum(self.tenants.reserved.values()), "tenants' weights disagree with the committed"
        counts: dict[str, int] = {}
        for r in running:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
        assert {t: n for t, n in self.tenants.running.items() if n} == counts, "tenants' running counts disagree"
        assert all(r.status is not WAITING for r in running), "a running request marked waiting"
