"""Each tenant's requests take turns at the gateway's intake (app/gateway/turns.py)."""

from __future__ import annotations

import asyncio

import pytest
from weightq.gateway.turns import Turns


async def _request(turns: Turns, tenant: str, name: str, log: list[str], release: asyncio.Event) -> None:
    async with turns.turn(tenant):
        log.append(name)
        await release.wait()


def test_a_flooding_tenant_waits_for_its_own_turns_while_another_goes_at_once():
    async def main() -> None:
        turns, log, release = Turns(most=2), [], asyncio.Event()
        flood = [asyncio.create_task(_request(turns, "flood", f"f{i}", log, release)) for i in range(6)]
        await asyncio.sleep(0)
        light = asyncio.create_task(_request(turns, "light", "l0", log, release))
        await asyncio.sleep(0)
        assert log == ["f0", "f1", "l0"] and turns.active("flood") == (2, 4) and turns.active("light") == (1, 0)
        release.set()
        await asyncio.gather(*flood, light)
        assert log == ["f0", "f1", "l0", "f2", "f3", "f4", "f5"]  # each tenant's in its order
        assert turns.active("flood") == (0, 0) and not turns._tenants

    asyncio.run(main())


def test_a_request_cancelled_while_it_waits_gives_up_its_place_and_nothing_leaks():
    async def main() -> None:
        turns, log, release = Turns(most=1), [], asyncio.Event()
        first = asyncio.create_task(_request(turns, "t", "a", log, release))
        second = asyncio.create_task(_request(turns, "t", "b", log, release))
        third = asyncio.create_task(_request(turns, "t", "c", log, release))
        await asyncio.sleep(0)
        second.cancel()  # its client went away while it waited
        await asyncio.sleep(0)
        assert turns.active("t") == (1, 1)
        release.set()
        await asyncio.gather(first, third)
        with pytest.raises(asyncio.CancelledError):
            await second
        assert log == ["a", "c"] and not turns._tenants

    asyncio.run(main())


def test_a_turn_handed_to_a_request_cancelled_at_that_moment_goes_on_to_the_next():
    async def main() -> None:
        turns, log, release = Turns(most=1), [], asyncio.Event()
        first = turns.turn("t")
        await first.__aenter__()
        second = asyncio.create_task(_request(turns, "t", "b", log, release))
        third = asyncio.create_task(_request(turns, "t", "c", log, release))
        await asyncio.sleep(0)
        assert turns.active("t") == (1, 2)
        await first.__aexit__(None, None, None)  # hands its turn to `second`, which has not run yet ...
        second.cancel()  # ... and is cancelled before it does
        release.set()
        await asyncio.wait_for(third, 10)  # never handed on: it would wait for good
        with pytest.raises(asyncio.CancelledError):
            await second
        assert log == ["c"] and not turns._tenants

    asyncio.run(main())
