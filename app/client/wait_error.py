"""How far the projected waits (backlog.py) fall short of the first tokens they promised, learned from
the jobs this process admitted: the margin backpressure keeps below MAX_QUEUE_WAIT_S.

A fixed share of the bound is either too little or too much: the projection runs late by a share of
the wait steadily, and by more for the jobs admitted just before a heartbeat shows a cohort finishing
later than the one before, while where it is close a fixed share refuses jobs for nothing. So each
admitted job's projected wait is kept, and when its first entry (a token, or its end or error) reaches
this process, the difference between the real wait and the projected one is a sample; backpressure
admits a job while its projected wait plus the recent samples' p99 is within the bound. Until there
are MIN_SAMPLES, or after a quiet while (HORIZON_S), the margin is the prior share of the bound, or the
worst error seen if that is larger (the prior alone can let the first jobs' p99 reach the bound while
the samples come in). Each process (a gateway, a client) learns from the jobs it admitted and reads."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence

PRIOR = 0.1  # the margin, as a share of the bound, with too few samples
MIN_SAMPLES = 50
QUANTILE = 0.99  # the promise is on the accepted jobs' TTFT p99
KEPT = 512  # samples (the latest)
HORIZON_S = 120.0  # samples older than this are dropped: the load that taught them is gone
MAX_OPEN = 20_000  # admitted jobs whose first entry was not seen yet (the oldest are forgotten)


class WaitError:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._admitted: OrderedDict[int, tuple[object, float, float]] = OrderedDict()  # id(job) -> (job, t, wait)
        self._open: OrderedDict[str, tuple[float, float]] = OrderedDict()  # job id -> (admitted at, projected)
        self._samples: deque[tuple[float, float]] = deque(maxlen=KEPT)  # (observed at, real - projected)

    def admitted(self, job: object, projected_s: float) -> None:
        """A job let in with this projected wait (seconds from now); its id comes at submission."""
        with self._lock:
            self._admitted[id(job)] = (job, time.time(), projected_s)
            while len(self._admitted) > MAX_OPEN:
                self._admitted.popitem(last=False)

    def submitted(self, ids: Sequence[str], jobs: Sequence[object]) -> None:
        with self._lock:
            for job_id, job in zip(ids, jobs, strict=True):
                held = self._admitted.pop(id(job), None)
                if held is not None and held[0] is job:
                    self._open[job_id] = held[1:]
            while len(self._open) > MAX_OPEN:
                self._open.popitem(last=False)

    def first_entry(self, job_id: str) -> None:
        """The job's first token (or end, or error) reached this process: its real wait is known."""
        if job_id not in self._open:  # a job this process did not admit (or already counted): no lock
            return
        now = time.time()
        with self._lock:
            held = self._open.pop(job_id, None)
            if held is not None:  # one projected to start at once too: it may wait for slots taken since
                self._samples.append((now, (now - held[0]) - held[1]))

    def margin(self, bound: float) -> float:
        """Seconds kept below the bound: the recent errors' p99 (never below 0); with fewer than
        MIN_SAMPLES, the prior share of the bound or the worst error seen, whichever is larger."""
        cutoff = time.time() - HORIZON_S
        with self._lock:
            while self._samples and self._samples[0][0] < cutoff:
                self._samples.popleft()
            errors = sorted(e for _, e in self._samples)
        if len(errors) < MIN_SAMPLES:  # learning: the worst seen so far, if worse than the prior
            return max([PRIOR * bound, *errors[-1:]])
        return max(0.0, errors[min(len(errors) - 1, math.ceil(QUANTILE * len(errors)) - 1)])

    def samples(self) -> int:
        with self._lock:
            return len(self._samples)
