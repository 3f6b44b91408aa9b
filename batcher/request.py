"""A request as the batcher sees it: lengths and progress, no text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

# The priority scale, the job contract's (tasks/limits.py, which this layer cannot import; a test keeps
# them equal): classes 0-9, a higher class admitted first; a request that names none is of the default
# class, and classes below it are background work (BatcherConfig.headroom_priority).
TOP_PRIORITY = 9
DEFAULT_PRIORITY = 5


class Status(Enum):
    """Where a request is: WAITING in the queue (again after a preemption: its KV is gone), PREFILLING
    (admitted, its context not all fed yet) or DECODING (it emitted a token since its last admission)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"


WAITING, PREFILLING, DECODING = Status.WAITING, Status.PREFILLING, Status.DECODING


class RequestRejected(ValueError):
    """A request that can never run under this configuration; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(slots=True, eq=False)
class Request:
    """Lengths and progress of one generation.

    `generated` counts output tokens produced so far; `prefilled` counts context tokens whose KV is
    written. A preempted request keeps `generated` and is prefilled again (input + generated) on
    readmission. `reserved_new` is how many output tokens admission reserves: max_new_tokens in the
    worst-case mode, an estimate in the predictive mode. `fixed_len` is the part of the input held
    in its own padded tensor (an encoder-decoder's encoder states: the whole input); the padded weight
    model pads it separately from the growing part.
    """

    id: str
    input_len: int
    max_new_tokens: int
    arrival_s: float = 0.0  # when the batcher got it: aging and the jump window count from here
    # when it was submitted upstream (a job queued in Redis first), on the same clock: its place in its
    # class's queue; None: arrival_s
    submitted_s: float | None = None
    generated: int = 0
    prefilled: int = 0
    reserved_new: int = 0
    status: Status = WAITING
    admitted_step: int = 0
    preemptions: int = 0
    fixed_len: int = 0
    runs_to_max: bool = False  # nothing can end it early (EOS ignored, no stop conditions): its length is known
    priority: int = DEFAULT_PRIORITY  # its class, 0-9: a higher class is admitted first (admission.py)
    tenant: str = ""  # who it is for: within a class, tenants share by service received (fairness.py)
    adapter: str = ""  # its LoRA adapter ("" the base model's): a slot of the stacks (adapters.py)
    prefix: tuple[bytes, ...] = ()  # the cache key of each full block of its prompt (prefix caching)
    shared_blocks: int = 0  # its leading blocks found in the prefix cache (held, shared with others)
    cached_tokens: int = 0  # context tokens its first admission found in the prefix cache (its usage)
    block_table: list[int] = field(default_factory=list)  # its full kind's pages, one per block
    # per window kind, its ring: `pages` pages per unit, logical block j in unit j mod ring (KVCache)
    rings: list[list[int]] = field(default_factory=list)
    # this step only (prefix cache with window kinds, Paging): (window kind, block j, pages) to copy
    # into its ring's unit for block j before the forward (a cache hit), and spare pages to write block
    # j's KV into after it (kept as the cache's copy of that window block)
    ring_copies: list[tuple[int, int, list[int]]] = field(default_factory=list)
    window_snapshots: list[tuple[int, int, list[int]]] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.status is DECODING

    @property
    def context_len(self) -> int:
        return self.input_len + self.generated

    @property
    def max_total(self) -> int:
        return self.input_len + self.max_new_tokens

    @property
    def reserved_total(self) -> int:
        return self.input_len + self.reserved_new

    @property
    def prefill_left(self) -> int:
        """Tokens still to feed before this request emits again (1 for a decoding request)."""
        return self.context_len - self.prefilled


def check_request(
    req: Request,
    max_total_tokens: int,
    weight_of: Callable[[int], int],
    budget: int,
    check_adapter: Callable[[str], None],
    known: bool,
) -> None:
    """Reject a request that could never run (RequestRejected names the field and the limit): its
    lengths, its adapter (`check_adapter`), its worst-case weight (`weight_of` its tokens) against the
    budget, its id (`known`: already held), its class."""
    if req.input_len < 1:
        raise RequestRejected("input_len", f"must be >= 1 (got {req.input_len})")
    if req.max_new_tokens < 1:
        raise RequestRejected("max_new_tokens", f"must be >= 1 (got {req.max_new_tokens})")
    if req.max_total > max_total_tokens:
        raise RequestRejected(
            "max_new_tokens",
            f"input_len {req.input_len} + max_new_tokens {req.max_new_tokens} = {req.max_total} "
            f"exceeds max_total_tokens {max_total_tokens}",
        )
    if req.adapter:
        check_adapter(req.adapter)
    alone = weight_of(req.max_total)
    if alone > budget:
        raise RequestRejected(
            "max_new_tokens",
            f"worst-case weight {alone} (input_len {req.input_len} + max_new_tokens "
            f"{req.max_new_tokens}) exceeds max_batch_weight {budget}",
        )
    if known:
        raise RequestRejected("id", f"request id {req.id!r} is already queued or running")
    if not 0 <= req.priority <= TOP_PRIORITY:
        raise RequestRejected("priority", f"must be an integer in [0, {TOP_PRIORITY}] (got {req.priority})")
