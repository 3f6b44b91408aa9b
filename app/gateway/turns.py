"""Turns at the gateway's intake: each tenant's requests go from a read body to a submitted job at most
TURNS_PER_TENANT at a time, the rest of that tenant's in order behind them.

The event loop runs every ready request in arrival order: when one tenant sends a thousand requests at
once, a request of another tenant that arrives just after waited for the thousand to be parsed and
submitted first (bench.queueing: 0.4 s of a light tenant's TTFT p99 beside a flood on two workers,
1.3 s on four). With turns, it waits behind two group commits' worth of each other tenant's: the
gateway spends the same CPU on the flood, in an order that keeps the light tenant's share.
A body is read before the turn, so a client that trickles its body never holds one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

# two group commits' worth (submitter.MAX_BATCH): a tenant's next batch is parsed while one is written
TURNS_PER_TENANT = 256


@dataclass(slots=True)
class _Tenant:
    active: int = 0
    waiting: deque[asyncio.Future] = field(default_factory=deque)


class Turns:
    def __init__(self, most: int = TURNS_PER_TENANT) -> None:
        self.most = most
        self._tenants: dict[str, _Tenant] = {}

    def active(self, tenant: str) -> tuple[int, int]:
        """(requests of `tenant` in their turn, waiting for one)."""
        t = self._tenants.get(tenant)
        return (t.active, len(t.waiting)) if t else (0, 0)

    @asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        t = self._tenants.setdefault(tenant, _Tenant())
        if t.active < self.most and not t.waiting:
            t.active += 1
        else:
            mine = asyncio.get_running_loop().create_future()
            t.waiting.append(mine)
            try:
                await mine
            except BaseException:  # its client went away (cancelled) while it waited
                if mine.done() and not mine.cancelled():
                    self._leave(tenant, t)  # the turn was handed over as it was cancelled: pass it on
                elif mine in t.waiting:
                    t.waiting.remove(mine)
                    self._forget(tenant, t)
                raise
        try:
            yield
        finally:
            self._leave(tenant, t)

    def _leave(self, tenant: str, t: _Tenant) -> None:
        """The turn goes to the tenant's next waiting request (it stays active), else it ends."""
        while t.waiting:
            nxt = t.waiting.popleft()
            if not nxt.done():
                nxt.set_result(None)
                return
        t.active -= 1
        self._forget(tenant, t)

    def _forget(self, tenant: str, t: _Tenant) -> None:
        if not t.active and not t.waiting and self._tenants.get(tenant) is t:
            del self._tenants[tenant]
