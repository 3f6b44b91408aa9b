"""Batcher configuration: one frozen object, validated once."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from .request import DEFAULT_PRIORITY

WeightModelName = Literal["token", "padded"]
Mode = Literal["auto", "worst_case", "predictive"]


class ConfigError(ValueError):
    """A configuration that cannot serve even one maximal request."""


# The one default of the share kept for higher classes (PRIORITY_HEADROOM's: tests/app/test_settings.py).
PRIORITY_HEADROOM = 0.1


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    """How the batcher spends the KV budget.

    max_batch_weight: tokens of KV memory (token model) or batch_size x padded length (padded model).
        0 means "infer": max_batch_size x max_total_tokens; the engine may instead derive it from
        free memory before calling `resolved()`.
    max_batch_size: a cap on running requests; 0 means the weight alone limits the batch.
    max_total_tokens: the longest input + max_new_tokens a request may ask for; 0: the model's context
        limit, which the engine fills in (a batcher alone must be given it).
    max_prefill_weight: prompt tokens (prefill weight) admitted into one step; 0 turns the cap off.
    chunked_prefill: split prompts longer than the cap across steps (token model only).
    block_size: tokens per KV block (token model); 0: the attention backend's, which the engine fills in
        (16 for SDPA, 256 for flash-attn, whose paged kernels need multiples of 256).
    jump_window_s: a later request may be admitted ahead of a waiting one that does not fit only if
        it arrived within this many seconds after it; 0 turns jumping off (strict FIFO).
    max_wait_s: once the first blocked request has waited this long, nothing jumps past it.
    jump_scan: at most this many waiting requests are examined past the first blocked one per step,
        which bounds the cost of a step when thousands wait.
    mode: "worst_case" reserves max_new_tokens (never preempts); "predictive" reserves each request's
        expected output length and preempts the newest requests when a reservation must grow and cannot;
        "auto": predictive for the token model (measured to win under memory pressure: bench.peer --suite
        pressure), worst_case for the padded one (the padded runner cannot preempt: the engine refuses
        predictive there).
    predictive_margin: predictive mode's safety margin, in standard deviations of the running set's
        total remaining output, held back from admission; the batcher widens it after preemptions
        past its allowance and lets it ease back as requests finish.
    priority_headroom: share of max_batch_weight that requests of a class below `headroom_priority` may
        not take while anything runs: room kept for a higher-class request to start at once.
    prefix_cache: keep the KV blocks of prompts (keyed by their tokens) after their requests finish
        and let later requests with the same prefix reuse them (token model with a full kind; requests
        carry the keys).
    max_preemptions: a request preempted this many times is readmitted with its worst case reserved
        and is not preempted again while others can be.
    kinds: the token model's attention kinds (batcher/weight.py): (pages per block, ring blocks) each,
        a full kind (ring 0) first. The default, one page per block, is a model of full layers only;
        sliding-window layers keep a ring of blocks, so a request's weight stops growing with them.
        Prefix caching needs a full kind (the cached blocks are its blocks).
    windows: the window of each window kind, in tokens (a prefix-cache hit needs its last window).
    fairness: within a priority class, the waiting tenant that has received the least service (KV
        weight x steps) goes first, instead of arrival order (batcher/fairness.py); one tenant: no change.
    tenant_cap: a share of max_batch_weight no one tenant's running requests may exceed while other
        tenants have requests (0: no cap); a tenant's first running request is never held back by it.
    class_preemption: a request of headroom_priority or above that does not fit preempts background
        requests (ranked below it), the newest first, the fewest that make room (preemption.py).
    fair_preemption: a tenant holding less than an equal share of the budget whose request does not
        fit may preempt the newest requests of the tenants holding the most (never more than it needs,
        never leaving them below it, never one at max_preemptions): a light tenant's request starts at
        once beside another's flood.
    """

    max_batch_weight: int = 0
    max_batch_size: int = 0
    max_total_tokens: int = 0
    max_prefill_weight: int = 2048
    chunked_prefill: bool = True
    weight_model: WeightModelName = "token"
    block_size: int = 0
    jump_window_s: float = 1.0
    max_wait_s: float = 30.0
    jump_scan: int = 256
    mode: Mode = "auto"
    predictive_margin: float = 0.75
    predictive_min_samples: int = 32
    predictive_window: int = 4096
    max_preemptions: int = 2
    prefix_cache: bool = True
    priority_headroom: float = PRIORITY_HEADROOM
    headroom_priority: int = DEFAULT_PRIORITY
    kinds: tuple[tuple[int, int], ...] = ((1, 0),)
    windows: tuple[int, ...] = ()
    fairness: bool = True
    tenant_cap: float = 0.0
    fair_preemption: bool = True
    class_preemption: bool = True

    def resolved(self) -> BatcherConfig:
        """Fill in max_batch_weight and mode "auto", turn off what the weight model cannot use (prefix
        caching, chunks of a padded batch) and check that one maximal request fits; raises ConfigError."""
        cfg = self
        for name, least in (("max_total_tokens", 2), ("block_size", 1)):
            if (value := getattr(cfg, name)) < least:
                unset = ", the engine's to fill in: a batcher alone needs it" if value == 0 else ""
                raise ConfigError(f"{name} must be >= {least} (got {value}{unset})")
        if cfg.max_batch_weight < 0 or cfg.max_batch_size < 0 or cfg.max_prefill_weight < 0:
            raise ConfigError("max_batch_weight, max_batch_size and max_prefill_weight must be >= 0")
        if cfg.weight_model not in ("token", "padded"):
            raise ConfigError(f"weight_model must be 'token' or 'padded' (got {cfg.weight_model!r})")
        if cfg.mode not in ("auto", "worst_case", "predictive"):
            raise ConfigError(f"mode must be 'auto', 'worst_case' or 'predictive' (got {cfg.mode!r})")
        if cfg.weight_model == "padded":  # a padded batch prefills whole prompts and keeps no blocks to reuse
            chunked = cfg.chunked_prefill and not cfg.max_prefill_weight
            cfg = replace(cfg, chunked_prefill=chunked, prefix_cache=False)
        if cfg.mode == "auto":
            cfg = replace(cfg, mode="predictive" if cfg.weight_model == "token" else "worst_case")
        if not 0.0 <= cfg.tenant_cap <= 1.0:
            raise ConfigError(f"tenant_cap must be in [0, 1] (got {cfg.tenant_cap})")
        if not 0.0 <= cfg.priority_headroom < 1.0:
            raise ConfigError(f"priority_headroom must be in [0, 1) (got {cfg.priority_headroom})")
        if cfg.max_preemptions < 0:
            raise ConfigError(f"max_preemptions must be >= 0 (got {cfg.max_preemptions})")
        if not 0.0 <= cfg.predictive_margin <= 10.0:
            raise ConfigError(f"predictive_margin must be in [0, 10] standard deviations (got {cfg.predictive_margin})")
        kinds = cfg.kinds
        if (
            not kinds
            or any(p < 1 or r < 0 for p, r in kinds)
            or any(r == 0 for _p, r in kinds[1:])
            or (kinds[0][1] == 0 and kinds[0][0] != 1)
        ):
            raise ConfigError(
                f"kinds must be (pages >= 1, ring >= 0) pairs, a full kind (one page, ring 0) first (got {kinds})"
            )
        if len(cfg.windows) != sum(1 for _p, r in kinds if r) or any(w < 1 for w in cfg.windows):
            raise ConfigError(f"windows must give one window (>= 1 token) per window kind (got {cfg.windows})")
        if cfg.weight_model != "token" and cfg.kinds != ((1, 0),):
            raise ConfigError("kinds (attention kinds) apply to the token weight model only")
        if cfg.prefix_cache and cfg.kinds[0][1] != 0:
            cfg = replace(cfg, prefix_cache=False)  # no full layer: no block outlives a window to be reused
        if cfg.weight_model == "token":
            from .weight import TokenWeight

            one = TokenWeight(cfg.block_size, cfg.kinds).seq(cfg.max_total_tokens)
        else:
            one = cfg.max_total_tokens
        if not cfg.max_batch_weight:
            if cfg.max_batch_size <= 0:
                raise ConfigError(
                    "max_batch_weight is unset and cannot be inferred: set max_batch_weight, or "
                    "max_batch_size (weight = max_batch_size x max_total_tokens)"
                )
            cfg = replace(cfg, max_batch_weight=cfg.max_batch_size * one)
        if cfg.max_batch_weight < one:
            raise ConfigError(
                f"max_batch_weight={cfg.max_batch_weight} is below the weight of one max-length request "
                f"({one} = max_total_tokens {cfg.max_total_tokens}"
                + (
                    f" rounded up to block_size {cfg.block_size}"
                    if one != cfg.max_total_tokens and cfg.kinds == ((1, 0),)
                    else f" in pages of block_size {cfg.block_size} over attention kinds {cfg.kinds}"
                    if one != cfg.max_total_tokens
                    else ""
                )
                + "): raise max_batch_weight or lower max_total_tokens"
            )
        return cfg
