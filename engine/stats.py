"""The engine's counters, its stats() and the invariant checks of tests: a mixin of Engine (loop.py),
which owns the state they read."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightq.batcher import Batcher

    from .config import EngineConfig
    from .model import LoadedModel
    from .runner.base import Runner
    from .sequence import Sequence


class EngineStats:
    config: EngineConfig
    batcher: Batcher
    runner: Runner
    lm: LoadedModel
    seqs: dict[str, Sequence]
    backend: str
    max_input_length: int
    warmup_s: float

    def _init_counters(self) -> None:
        self.counters = {
            "steps": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "finished": 0,
            "forward_s": 0.0,
            "step_s": 0.0,
            "overflow_steps": 0,  # steps whose batch held more KV tokens than the budget (must stay 0)
        }
        self._rate = {"t": time.monotonic(), "prefill": 0, "decode": 0, "prefill_tok_s": 0.0, "decode_tok_s": 0.0}
        self._occupied_s = 0.0  # wall time the engine held requests: device busy = forward_s / occupied_s
        self._occupied_since: float | None = None

    def _occupancy(self, now: float) -> None:
        """Open the occupied span when requests arrive, close it when the last one leaves."""
        if self.seqs and self._occupied_since is None:
            self._occupied_since = now
        elif not self.seqs and self._occupied_since is not None:
            self._occupied_s += now - self._occupied_since
            self._occupied_since = None

    def occupied_s(self) -> float:
        since = self._occupied_since
        return self._occupied_s + (time.perf_counter() - since if since is not None else 0.0)

    def stats(self) -> dict:
        b = self.batcher
        st = b.stats
        return {
            "running": len(b.running),
            "waiting": len(b.waiting),
            "batch_weight": b.batch_weight(),
            "max_batch_weight": b.budget,
            "max_input_length": self.max_input_length,
            "max_total_tokens": b.config.max_total_tokens,
            **self.runner.memory(),
            "prefill_tok_s": round(self._rate["prefill_tok_s"], 1),
            "decode_tok_s": round(self._rate["decode_tok_s"], 1),
            **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.counters.items()},
            "occupied_s": round(self.occupied_s(), 3),
            "model": self.config.model,
            "attention": self.backend,
            "runner": self.lm.runner,
            "compiled": self.runner.compiled,
            "warmup_s": round(self.warmup_s, 1),
            "mode": self.batcher.config.mode,
            "prefix_cache": bool(b.ledger is not None and b.ledger.caching),
            "prefix_hit_rate": round(st.cached_tokens / st.prompt_tokens, 4) if st.prompt_tokens else 0.0,
            "prefix_cached_tokens": st.cached_tokens,
            "prefix_shared_blocks": b.paging.shared.held,
        }

    def _count(self, prefill: int, decode: int, forward_s: float, step_s: float) -> None:
        c = self.counters
        c["steps"] += 1
        c["prefill_tokens"] += prefill
        c["decode_tokens"] += decode
        c["forward_s"] += forward_s
        c["step_s"] += step_s
        r = self._rate
        r["prefill"] += prefill
        r["decode"] += decode
        now = time.monotonic()
        if now - r["t"] >= 1.0:  # rates over the last second or so
            span = now - r["t"]
            r["prefill_tok_s"], r["decode_tok_s"] = r["prefill"] / span, r["decode"] / span
            r["t"], r["prefill"], r["decode"] = now, 0, 0

    def _check_invariants(self) -> None:
        assert self.batcher.batch_weight() <= self.batcher.budget, "batch weight over budget"
        self.batcher.check_memory()
        self.runner.check(list(self.seqs.values()), self.batcher.budget)
        for seq in self.seqs.values():
            assert len(seq.token_ids) == seq.sched.context_len, f"{seq.id}: tokens out of step with the batcher"
