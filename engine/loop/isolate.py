"""A failed packed forward, taken apart: each sequence's work runs alone, the ones that still fail
end with an error, and the others' logits come back in the packed order, so one bad request never
takes the batch down."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from weightq.batcher import Batcher

from ..params import FinishReason
from ..runner.base import Work
from ..sequence import Sequence

log = logging.getLogger(__name__)

Finish = Callable[[Sequence, FinishReason, str], None]


def isolate(
    runner: Any, batcher: Batcher, finish: Finish, prefill: list[Work], decode: list[Work], error: Exception
) -> torch.Tensor:
    """Rerunning rewrites the same KV slots with the same values. Prefix cache: the blocks a failed
    request was to write this step leave the cache (their KV was never written), and a request
    admitted onto them in the same step fails with it."""
    if not runner.can_isolate:  # the padded runner: one batch, one fate
        log.warning("forward over %d sequences failed (%r)", len(prefill) + len(decode), error)
        for work in prefill + decode:
            finish(work.seq, "error", f"the model failed on this step: {error!r}")
        return torch.empty(0, 0)
    log.warning("forward over %d sequences failed (%r); isolating", len(prefill) + len(decode), error)
    rows: list[torch.Tensor] = []
    unwritten: set[int] = set()  # blocks whose KV a failed request was to write this step
    ledger, span = batcher.ledger, batcher.weight.block_size
    for work, alone in [(w, ([w], [])) for w in prefill] + [(w, ([], [w])) for w in decode]:
        if alone[0] and work.start and work.seq.sched.rings:
            # its chunk's last window may be in part of the ring already, over the prefix it reads:
            # prefilled again from the start (or the prefix cache), not rerun
            batcher.requeue(work.seq.id)
            runner.release(work.seq)
            continue
        reads = work.seq.block_table[: -(-work.start // span)]
        if unwritten.intersection(reads):
            finish(work.seq, "error", f"the model failed on a cached prompt prefix this request shares: {error!r}")
            continue
        try:
            out = runner.forward(*alone)
        except Exception as e:
            log.warning("request %s fails the forward pass: %r", work.seq.id, e)
            if ledger is not None:
                written = work.seq.block_table[work.start // span : -(-(work.start + work.n) // span)]
                unwritten.update(written)
                ledger.forget(written)
            finish(work.seq, "error", f"the model failed on this request: {e!r}")
            continue
        if work.emits:
            rows.append(out)
    if not rows:
        return torch.empty(0, 0)
    return torch.cat(rows)
