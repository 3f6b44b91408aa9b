"""Each tenant's requests take turns at the gateway's intake (app/gateway/turns.py)."""

from __future__ import annotations

import asyncio

import pytest
from weightq.gateway.errors import HTTPError
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


def test_a_request_whose_client_left_while_it_waited_passes_its_turn_on_unrun():
    async def main() -> None:
        turns, log, release = Turns(most=1), [], asyncio.Event()
        asked: list[str] = []

        async def request(name: str, left: bool) -> None:
            async def gone() -> bool:
                asked.append(name)
                return left

            async with turns.turn("t", gone):
                log.append(name)
                await release.wait()

        first = asyncio.create_task(request("a", False))  # not asked: it never waited
        await asyncio.sleep(0)
        left = asyncio.create_task(request("b", True))
        stayed = asyncio.create_task(request("c", False))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, stayed)
        with pytest.raises(HTTPError) as refused:
            await left
        assert refused.value.status == 499
        assert log == ["a", "c"] and asked == ["b", "c"] and not turns._tenants

    asyncio.run(main())


def test_many_requests_cancelled_at_once_leave_nothing_behind():
    async def main() -> None:
        turns, log, release = Turns(most=2), [], asyncio.Event()
        holders = [asyncio.create_task(_request(turns, "t", f"h{i}", log, release)) for i in range(2)]
        waiting = [asyncio.create_task(_request(turns, "t", f"w{i}", log, release)) for i in range(2000)]
        await asyncio.sleep(0)
        assert turns.active("t") == (2, 2000)
        for task in waiting[:-1]:  # a shutdown, say: all but the last
            task.cancel()
        await asyncio.gather(*waiting[:-1], return_exceptions=True)
        assert turns.active("t") == (2, 1)
        late = asyncio.create_task(_request(turns, "t", "late", log, release))  # behind the live one only
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*holders, waiting[-1], late)
        assert log == ["h0", "h1", "w1999", "late"] and not turns._tenants

    asyncio.run(main())
