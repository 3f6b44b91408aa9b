"""The waiting queue: requests by class, then submission, with the aging that keeps anything from starving.

The Batcher owns one and alone changes it; admission reads it and returns what it took."""

from __future__ import annotations

from bisect import bisect_right

from .request import TOP_PRIORITY, Request

Key = tuple[int, float, int]  # (-class, submitted, sequence): ascending is the order of admission


class WaitingQueue:
    def __init__(self) -> None:
        self.requests: list[Request] = []  # in key order
        self.keys: dict[str, Key] = {}  # every request the batcher holds, waiting or running
        self._classes: set[int] = set()  # classes ever submitted (one: no aging pass needed)
        self._seq = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.keys

    def rank(self, req: Request) -> int:
        """Its class as admission ranks it now (aging may have raised it): higher first."""
        return -self.keys[req.id][0]

    def key(self, req: Request) -> Key:
        return self.keys[req.id]

    def submit(self, req: Request) -> None:
        since = req.arrival_s if req.submitted_s is None else req.submitted_s
        self.keys[req.id] = (-req.priority, since, self._seq)
        self._classes.add(req.priority)
        self._seq += 1
        self.put(req)

    def put(self, req: Request) -> None:
        """Into its place (a preempted request goes back to where its key puts it)."""
        key = self.keys[req.id]
        w, keys = self.requests, self.keys
        if not w or keys[w[-1].id] <= key:
            w.append(req)
        else:
            w.insert(bisect_right(w, key, key=lambda r: keys[r.id]), req)

    def remove(self, request_id: str) -> Request | None:
        """Drop a waiting request; None if it is not waiting."""
        for i, r in enumerate(self.requests):
            if r.id == request_id:
                return self.requests.pop(i)
        return None

    def forget(self, request_id: str) -> None:
        """The request left the batcher (finished or cancelled)."""
        del self.keys[request_id]

    def take(self, indexes: list[int]) -> None:
        """Admission started the requests at these positions."""
        drop = set(indexes)
        self.requests = [r for i, r in enumerate(self.requests) if i not in drop]

    def age(self, now: float, max_wait_s: float) -> bool:
        """A request that has waited max_wait_s ranks with the top class from now on: nothing starves.
        True when one moved up."""
        if len(self._classes) < 2:
            return False
        cut = now - max_wait_s
        keys, aged = self.keys, False
        for r in self.requests:
            rank, since, seq = keys[r.id]
            if rank > -TOP_PRIORITY and r.arrival_s <= cut:  # its wait here: a queue upstream ordered it by class
                keys[r.id] = (-TOP_PRIORITY, since, seq)
                aged = True
        if aged:
            self.requests.sort(key=lambda r: keys[r.id])
        return aged
