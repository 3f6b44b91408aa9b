"""Online estimate of output lengths, for the predictive mode's reservations."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque


class OutputLengthEstimator:
    """Kaplan–Meier quantiles of output length from finished and still-running requests.

    Finished requests are observed lengths; running ones are censored (their length is known to
    exceed what they have generated so far). Counting only finished requests would bias the
    estimate short, since short requests finish first. `reserve` answers "how many output tokens
    should a request that has produced `generated` tokens reserve?" with the `quantile` of the
    length distribution conditioned on exceeding `generated`. Where the data cannot say (too few
    finished requests, or a quantile beyond every observation) it reserves max_new_tokens.
    """

    # The safety margin adapts: a preemption (a reservation outgrown with no room left) halves the share
    # of requests allowed to outgrow theirs; every request that finishes eases it back 2% toward the base.
    TIGHTEN = 0.5
    RELAX = 1.02
    MIN_MISS = 0.005

    def __init__(self, quantile: float = 0.88, min_samples: int = 32, window: int = 4096) -> None:
        self.quantile = quantile
        self.base_quantile = quantile
        self.min_samples = min_samples
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []
        self._times: list[int] = []  # distinct observed lengths, ascending
        self._neg_surv: list[float] = []  # -S(t) at each of those lengths (ascending, for bisect)
        self.pending = 0  # observations since the last refresh

    def tighten(self) -> None:
        miss = max(self.MIN_MISS, (1.0 - self.quantile) * self.TIGHTEN)
        self.quantile = max(self.quantile, 1.0 - miss)

    def relax(self) -> None:
        if self.quantile > self.base_quantile:
            miss = min(1.0 - self.base_quantile, (1.0 - self.quantile) * self.RELAX)
            self.quantile = 1.0 - miss

    def __len__(self) -> int:
        return len(self._sorted)

    def observe(self, output_len: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect_left(self._sorted, self._recent[0])]
        self._recent.append(output_len)
        insort(self._sorted, output_len)
        self.pending += 1

    def refresh(self, censored: list[int]) -> None:
        """Rebuild the survival curve S(t) = P(length > t); `censored` are running requests' counts."""
        self.pending = 0
        times: list[int] = []
        neg: list[float] = []
        events = self._sorted
        cens = sorted(censored)
        at_risk = len(events) + len(cens)
        surv = 1.0
        i = j = 0
        while i < len(events):
            t = events[i]
            while j < len(cens) and cens[j] < t:  # censored before t: no longer at risk
                j += 1
                at_risk -= 1
            d = 0
            while i < len(events) and events[i] == t:
                d += 1
                i += 1
            surv *= 1.0 - d / at_risk
            at_risk -= d
            times.append(t)
            neg.append(-surv)
        self._times, self._neg_surv = times, neg

    def _survival(self, t: int) -> float:
        k = bisect_right(self._times, t)
        return 1.0 if k == 0 else -self._neg_surv[k - 1]

    def reserve(self, max_new_tokens: int, generated: int = 0) -> int:
        if len(self._sorted) < self.min_samples or not self._times:
            return max_new_tokens
        base = self._survival(generated)
        if base <= 0.0:
            return max_new_tokens
        target = (1.0 - self.quantile) * base + 1e-12  # products of (1 - d/n) round: allow a hair
        k = bisect_left(self._neg_surv, -target)  # first length with S(t) <= target
        if k == len(self._times):
            return max_new_tokens
        return max(generated + 1, min(max_new_tokens, self._times[k]))
