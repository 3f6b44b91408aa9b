"""The running requests' share of a step: every decoding request decodes, and prompts still being
prefilled continue in admission order (FIFO) within the prefill cap, before any new admission; and
the weight they hold."""

from __future__ import annotations

from collections.abc import Iterable, Set

from .paging import FinishOf, Paging
from .plan import PrefillLoad, StepPlan
from .request import DECODING, Request
from .weight import PaddedWeight, TokenWeight


def weight_with(running: Iterable[Request], w: TokenWeight | PaddedWeight, shared_weight: int, more: int) -> int:
    """The running requests' weight with `more` tokens each, their cached blocks (`shared_weight`) once."""
    if w.name == "token" and not w.uniform:
        return sum(w.own(r.context_len + more, r.shared_blocks) for r in running) + shared_weight
    running = list(running)
    own = [r.context_len + more - r.shared_blocks * w.block_size for r in running]
    return w.batch(own, [r.fixed_len for r in running]) + shared_weight


def plan_running(
    running: Iterable[Request], cap: int, paging: Paging, finish_of: FinishOf, plan: StepPlan
) -> PrefillLoad:
    """Fill `plan` with the running requests' work and grow their pages for it; returns the prompt load
    planned so far, with the blocks of prompt chunks that joined the prefix cache (for the Batcher to apply)."""
    chunks = longest = tokens = 0
    cached: list[tuple[Request, int, Set[str]]] = []
    ledger, weight = paging.ledger, paging.weight
    span = ledger.block_size if ledger is not None else 0
    uniform = weight.name != "token" or weight.uniform
    full = uniform or weight.full_pages
    decoding, decode = DECODING, plan.decode.append  # hoisted: this loop runs over every request, every step
    for req in running:
        if req.status is decoding:
            if req.generated >= req.max_new_tokens:
                raise RuntimeError(f"request {req.id} reached max_new_tokens but was not finished")
            decode(req)
            # its next token starts a block (a model without full layers has no block table to tell)
            if ledger is not None and (
                req.prefilled >= len(req.block_table) * span if full else req.prefilled % span == 0
            ):
                if uniform:
                    ledger.grow(req.block_table, req.prefilled + 1)
                else:
                    paging.grow(req, req.prefilled + 1)
            continue
        n = req.prefill_left
        if cap:
            n = min(n, cap - tokens)
        if n > 0:
            plan.prefill.append((req, n))
            chunks, longest, tokens = chunks + 1, max(longest, n), tokens + n
            blocks, holders = paging.allocate(req, req.prefilled + n, finish_of)
            if blocks:
                cached.append((req, blocks, holders))
    return PrefillLoad(chunks, longest, tokens, cached)
