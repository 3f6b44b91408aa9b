"""Requests with a deadline (a job's `deadline`) that are still waiting for admission when it
passes end unrun: their caller has given up on them, and a late start would spend KV on an answer
nobody reads. A request admitted in time runs to its end, even if preempted and waiting again, and
so does a resumed one (it has `emitted` tokens: an earlier run began it in time)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from ..sequence import Sequence

PASSED = "deadline: it passed before the request could start (expired)"


class Deadlines:
    """The requests with a deadline that have not been admitted yet (few: most have none)."""

    def __init__(self) -> None:
        self._pending: dict[str, Sequence] = {}

    def track(self, seq: Sequence) -> None:
        if seq.request.deadline is not None and not seq.request.emitted:
            self._pending[seq.id] = seq

    def expired(self, seqs: Mapping[str, Sequence]) -> list[Sequence]:
        """Those whose deadline passed before admission; the admitted (or gone) are dropped."""
        if not self._pending:
            return []
        now, out = time.time(), []
        for rid, seq in list(self._pending.items()):
            if seq.admitted_s or seqs.get(rid) is not seq:
                del self._pending[rid]
            elif now > seq.request.deadline:
                del self._pending[rid]
                out.append(seq)
        return out
