"""Turns at the gateway's intake: each tenant's requests go from a read body to a submitted job at most
TURNS_PER_TENANT at a time, the rest of that tenant's in order behind them.

The event loop runs every ready request in arrival order: when one tenant sends a thousand requests at
once, a request of another tenant that arrives just after would wait for the thousand to be parsed and
submitted first, and that wait grows with the flood. With turns, it waits behind two group commits'
worth of each other tenant's: the gateway spends the same CPU on the flood, in an order that keeps the
light tenant's share.
A body is read before the turn, so a client that trickles its body never holds one, and a request
whose client went away while it waited (uvicorn does not cancel its handler) passes its turn on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from .errors import HTTPError

# two group commits' worth (submitter.MAX_BATCH): a tenant's next batch is parsed while one is written
TURNS_PER_TENANT = 64


@dataclass(slots=True)
class _Tenant:
    active: int = 0
    queued: int = 0  # requests waiting (one cancelled stays in `waiting` until a turn passes it by)
    waiting: deque[asyncio.Future] = field(default_factory=deque)


class Turns:
    def __init__(self, most: int = TURNS_PER_TENANT) -> None:
        self.most = most
        self._tenants: dict[str, _Tenant] = {}

    def active(self, tenant: str) -> tuple[int, int]:
        """(requests of `tenant` in their turn, waiting for one)."""
        t = self._tenants.get(tenant)
        return (t.active, t.queued) if t else (0, 0)

    @asynccontextmanager
    async def turn(self, tenant: str, gone: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[None]:
        """`gone`: whether the request's client has left, asked after a wait (HTTP 499: no job for it)."""
        t = self._tenants.setdefault(tenant, _Tenant())
        waited = t.active >= self.most or t.queued > 0
        if not waited:
            t.active += 1
        else:
            mine = asyncio.get_running_loop().create_future()
            t.waiting.append(mine)
            t.queued += 1
            try:
                await mine
            except BaseException:  # cancelled while it waited (a shutdown, a timeout)
                if mine.done() and not mine.cancelled():
                    self._leave(tenant, t)  # the turn was handed over as it was cancelled: pass it on
                else:  # it stays in `waiting`, done, for `_leave` to skip: no O(n) removal per request
                    mine.cancel()
                    t.queued -= 1
                    self._forget(tenant, t)
                raise
        try:
            if waited and gone is not None and await gone():
                raise HTTPError(499, "the client left while the request waited for its turn", None, "client_closed")
            yield
        finally:
            self._leave(tenant, t)

    def _leave(self, tenant: str, t: _Tenant) -> None:
        """The turn goes to the tenant's next waiting request (it stays active), else it ends."""
        while t.waiting:
            nxt = t.waiting.popleft()
            if not nxt.done():
                nxt.set_result(None)
                t.queued -= 1
                return
        t.active -= 1
        self._forget(tenant, t)

    def _forget(self, tenant: str, t: _Tenant) -> None:
        if not t.active and not t.queued and self._tenants.get(tenant) is t:
            del self._tenants[tenant]
