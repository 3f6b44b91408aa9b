"""Limits at the gateway. Per client: generations in progress (a request of n choices holds n) and a
request rate (token bucket); a client is its API key (or its address when the gateway has no keys),
and exceeding either limit is a 429 with Retry-After. With keys both are on by default (DEFAULT_*):
a key shares the workers with others. Serving: the workers' max_total_tokens (ServingLimits), against which the
contract refuses a max_new_tokens that leaves no room for a prompt (JobRequest.check_room), a 400
here. Either way the request never reaches the queue.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

DEFAULT_CONCURRENT_PER_KEY = 32  # a quarter of one worker's default CONCURRENCY (128)
DEFAULT_RATE_PER_KEY = 10.0  # requests per second, in bursts of as many
MAX_BUCKETS = 100_000  # rate buckets kept before the idle clients' (full again anyway) are forgotten
SERVING_REFRESH_S = 2.0  # the workers' limits are read again from their heartbeats this often
MISS_REFRESH_S = 0.2  # ... or this often while a request names an adapter they did not hold


def resolved(value: float | str, keys: bool, default: float) -> float:
    """A per-client limit setting: "auto" is `default` when the gateway has keys, else no limit (0)."""
    return (default if keys else 0) if value == "auto" else float(value)


@dataclass
class Bucket:
    tokens: float
    stamp: float


@dataclass
class ClientLimits:
    max_concurrent: int = 0  # 0: no limit
    rate_per_s: float = 0.0  # 0: no limit
    burst: int = 0  # bucket size (0: max(1, rate))
    inflight: dict[str, int] = field(default_factory=dict)
    buckets: dict[str, Bucket] = field(default_factory=dict)

    def acquire(self, client: str, now: float | None = None) -> float | None:
        """None when the request may go ahead (call release() when it ends); else the seconds to wait."""
        now = time.monotonic() if now is None else now
        if self.max_concurrent and self.inflight.get(client, 0) >= self.max_concurrent:
            return 1.0
        if self.rate_per_s > 0:
            size = self.burst or max(1.0, self.rate_per_s)
            b = self.buckets.get(client)
            if b is None:
                b = self.buckets[client] = Bucket(size, now)
            b.tokens = min(size, b.tokens + (now - b.stamp) * self.rate_per_s)
            b.stamp = now
            if b.tokens < 1:
                return (1 - b.tokens) / self.rate_per_s
            b.tokens -= 1
            if len(self.buckets) > MAX_BUCKETS:  # forget idle clients (their buckets are full again anyway)
                self.buckets = {k: v for k, v in self.buckets.items() if v.tokens < size}
        self.inflight[client] = self.inflight.get(client, 0) + 1
        return None

    def hold(self, client: str, more: int) -> bool:
        """`more` generations for a client already in (a request's other choices); False when that
        passes its limit (then nothing is held)."""
        n = self.inflight.get(client, 0) + more
        if self.max_concurrent and n > self.max_concurrent:
            return False
        self.inflight[client] = n
        return True

    def release(self, client: str, held: int = 1) -> None:
        n = self.inflight.get(client, 0) - held
        if n > 0:
            self.inflight[client] = n
        else:
            self.inflight.pop(client, None)


def retry_after(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


class ServingLimits:
    """The workers' limits, from their heartbeats (refreshed every SERVING_REFRESH_S)."""

    def __init__(self, workers: Callable[[], dict[str, dict]]) -> None:
        self._workers = workers
        self._limit, self._at = 0, float("-inf")
        self._structured: bool | None = None
        self._adapters: set[str] | None = None

    def max_total_tokens(self, max_age_s: float = SERVING_REFRESH_S) -> int:
        """The smallest prompt + output limit among live workers; 0 when none is known."""
        now = time.monotonic()
        if now - self._at > max_age_s:
            workers = list(self._workers().values())
            self._limit = min((w.max_total_tokens for w in workers if w.max_total_tokens > 0), default=0)
            self._structured = any(w.structured for w in workers) if workers else None
            self._adapters = {a for w in workers for a in w.adapters} if workers else None
            self._at = now
        return self._limit

    def structured(self) -> bool | None:
        """Whether a live worker can serve structured output (`guided`); None when none is known."""
        self.max_total_tokens()
        return self._structured

    def adapters(self, wanted: Collection[str] = ()) -> set[str] | None:
        """The LoRA adapters live workers hold (their heartbeats); None when no worker is known. One
        `wanted` that is not among them is looked for afresh (at most every MISS_REFRESH_S): an adapter
        loaded a moment ago, through this gateway or another, is served before the next refresh."""
        self.max_total_tokens()
        if self._adapters is not None and not set(wanted) <= self._adapters:
            self.max_total_tokens(max_age_s=MISS_REFRESH_S)
        return self._adapters
