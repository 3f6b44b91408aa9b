"""A request as the batcher sees it: lengths and progress, no text."""

from __future__ import annotations

from dataclasses import dataclass, field

# The priority scale, the job contract's (tasks/limits.py, which this layer cannot import; a test keeps
# them equal): classes 0-9, a higher class admitted first; a request that names none is of the default
# class, and classes below it are background work (BatcherConfig.headroom_priority).
TOP_PRIORITY = 9
DEFAULT_PRIORITY = 5


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
    decoding: bool = False  # emitted a token since its last (re)admission
    admitted_step: int = -1
    preemptions: int = 0
    fixed_len: int = 0
    runs_to_max: bool = False  # nothing can end it early (EOS ignored, no stop conditions): its length is known
    priority: int = DEFAULT_PRIORITY  # its class, 0-9: a higher class is admitted first (admission.py)
    tenant: str = ""  # who it is for: within a class, tenants share by service received (fairness.py)
    adapter: str = ""  # its LoRA adapter ("" the base model's): a slot of the stacks (adapters.py)
    prefix: tuple[bytes, ...] = ()
    shared: int = 0
    cached: int = 0
    block_table: list[int] = field(default_factory=list)  # its full kind's pages, one per block
    # per window kind, its ring: `pages` pages per unit, logical block j in unit j mod ring (kv_cache.py)
    rings: list[list[int]] = field(default_factory=list)
    # this step only (prefix cache with window kinds, Paging): (window kind, block j, pages) to copy
    # into its ring's unit for block j before the forward (a cache hit), and to write block j's KV into
    fill: list[tuple[int, int, list[int]]] = field(default_factory=list)
    snaps: list[tuple[int, int, list[int]]] = field(default_factory=list)

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
