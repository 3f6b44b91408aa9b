"""What running requests reserve, and the margin held back for the batch (predictive mode)."""

from __future__ import annotations

import math

from .estimator import OutputLengthEstimator
from .request import Request


class Reservations:
    """A request reserves its expected output length (the estimator's conditional mean), or its
    max_new_tokens when nothing can end it early, when it has been preempted `max_preemptions` times,
    or in worst_case mode (no estimator). Admission holds back `margin` standard deviations of the
    running set's total remaining output (`margin()`): the sum is what breaks the budget, and its
    spread grows like the square root of the batch, not like the batch."""

    def __init__(self, estimator: OutputLengthEstimator | None, max_preemptions: int) -> None:
        self.estimator = estimator
        self.max_preemptions = max_preemptions
        self._var: dict[str, float] = {}  # each running request's variance of its remaining length
        self.var_sum = 0.0

    def estimated(self, req: Request) -> bool:
        """Does this request reserve an estimate (rather than its max_new_tokens)?"""
        return not (self.estimator is None or req.runs_to_max or req.preemptions >= self.max_preemptions)

    def reserve(self, req: Request) -> int:
        if not self.estimated(req):
            return req.max_new_tokens
        return self.estimator.reserve(req.max_new_tokens, req.generated)  # type: ignore[union-attr]

    def variance(self, req: Request) -> float:
        if not self.estimated(req) or req.reserved_new >= req.max_new_tokens:
            return 0.0
        return self.estimator.variance(req.max_new_tokens, req.generated)  # type: ignore[union-attr]

    def track(self, req: Request) -> None:
        """A running request's reservation was set: its variance joins the batch's."""
        if self.estimator is None:
            return
        v = self.variance(req)
        self.var_sum += v - self._var.get(req.id, 0.0)
        self._var[req.id] = v

    def forget(self, request_id: str) -> None:
        self.var_sum -= self._var.pop(request_id, 0.0)
        if not self._var:
            self.var_sum = 0.0  # no float drift survives an empty batch

    def margin(self, extra_var: float = 0.0) -> int:
        """Weight held back from admission: `margin` standard deviations of the running set's remaining
        output (plus `extra_var`, a candidate's), so that outgrown reservations seldom force a preemption."""
        est = self.estimator
        if est is None:
            return 0
        return int(est.margin * math.sqrt(max(0.0, self.var_sum + extra_var)))
