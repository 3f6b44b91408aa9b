"""Fairness between tenants inside a priority class: virtual token counters in the batcher's own units.

Arrival order within a class lets one tenant's 10,000-line batch starve another's single request until
the batch drains. Instead (VTC, Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024),
every tenant has a counter of the service it received, charged in the batcher's weight units: each
step, every running request adds the KV weight it holds, so a counter is the KV-token-steps its
tenant has occupied. Within a class, the waiting tenant with the smallest counter goes first; a
tenant that comes back from idle starts at the smallest counter of those still active, so staying
away saves no credit. With one tenant (the usual case) nothing is charged and the order is arrival.

An optional per-tenant cap (`tenant_cap`, a share of the budget) keeps one tenant below that share
of the batch weight, whatever is free.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from heapq import heapify, heappop, heappush

from .request import Request


class TenantShares:
    """Each tenant's counter and how many of its requests the batcher holds (waiting or running)."""

    def __init__(self) -> None:
        self.counter: dict[str, float] = {}  # service received, in weight x steps
        self.requests: dict[str, int] = defaultdict(int)  # requests held per tenant (waiting + running)
        self.reserved: dict[str, int] = defaultdict(int)  # running requests' reserved weight per tenant
        self.running: dict[str, int] = defaultdict(int)  # running requests per tenant

    @property
    def contended(self) -> bool:
        """More than one tenant holds requests: order and charges matter."""
        return len(self.requests) > 1

    def use(self, tenant: str, slot_weight: float, weight: int = 0, count: int = 0) -> float:
        """What `tenant` holds of whichever resource binds, in weight (with `weight` and `count` more):
        its running requests' reserved weight, or their count in slots of `slot_weight` (the budget over
        the cap on running requests, 0 without one) where the count binds first. A tenant's share is
        judged by this. It reads without inserting: the worker's outlook calls it from another thread."""
        return max(self.reserved.get(tenant, 0) + weight, (self.running.get(tenant, 0) + count) * slot_weight)

    def start(self, tenant: str, weight: int) -> None:
        """A request of `tenant` starts running, reserving `weight`."""
        self.reserved[tenant] += weight
        self.running[tenant] += 1

    def stop(self, tenant: str, weight: int) -> None:
        """A running request of `tenant` left the running set (finished, cancelled or preempted)."""
        self.reserved[tenant] -= weight
        self.running[tenant] -= 1

    def shift(self, tenant: str, weight: int) -> None:
        """A running request of `tenant` reserves `weight` more (less, when negative): its reservation
        grew, or some of its blocks became cached blocks, charged apart."""
        self.reserved[tenant] += weight

    def serve(self, tenant: str, weight: float) -> None:
        """`tenant` received `weight` of service at once (a prompt admitted)."""
        self.counter[tenant] += weight

    def arrive(self, tenant: str) -> None:
        """A request of `tenant` is submitted; a tenant back from idle starts at the active minimum."""
        if tenant not in self.requests:
            floor = min((self.counter.get(t, 0.0) for t in self.requests), default=0.0)
            self.counter[tenant] = max(self.counter.get(tenant, 0.0), floor)
        self.requests[tenant] += 1

    def leave(self, tenant: str) -> None:
        """A request of `tenant` finished or was cancelled."""
        self.requests[tenant] -= 1
        if not self.requests[tenant]:
            del self.requests[tenant]

    def charge(self, running: Iterable[Request], weight_of: Callable[[Request], int]) -> None:
        """One step of service: each running request's tenant pays the weight it holds."""
        counter = self.counter
        for r in running:
            counter[r.tenant] += weight_of(r)

    def order(
        self, waiting: list[Request], rank: Callable[[Request], int], cost: Callable[[Request], float]
    ) -> Iterator[tuple[int, Request]]:
        """`waiting` (sorted by class, then arrival) as (index, request) in fair order: class by class,
        the tenant with the smallest counter next, its requests in arrival order; each pick adds the
        request's expected cost to its tenant's counter for the rest of this pass."""
        i, n = 0, len(waiting)
        while i < n:
            cls = rank(waiting[i])
            queues: dict[str, list[int]] = defaultdict(list)
            j = i
            while j < n and rank(waiting[j]) == cls:
                queues[waiting[j].tenant].append(j)
                j += 1
            if len(queues) == 1:
                yield from ((k, waiting[k]) for k in range(i, j))
            else:
                heap = [(self.counter.get(t, 0.0), t, 0) for t in queues]
                heapify(heap)
                while heap:
                    c, t, pos = heappop(heap)
                    k = queues[t][pos]
                    yield k, waiting[k]
                    if pos + 1 < len(queues[t]):
                        heappush(heap, (c + cost(waiting[k]), t, pos + 1))
            i = j


def jain_index(values: list[float]) -> float:
    """Jain's fairness index of non-negative values: 1 when all equal, 1/n when one has everything."""
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))
