"""Per-client limits: concurrency and a token-bucket rate, pencil-and-paper cases."""

from weightq.gateway.limits import ClientLimits, retry_after


def test_concurrency_limit_is_per_client_and_released():
    lim = ClientLimits(max_concurrent=2)
    assert lim.acquire("a", 0) is None and lim.acquire("a", 0) is None
    assert lim.acquire("a", 0) == 1.0  # a third at once: wait
    assert lim.acquire("b", 0) is None  # another client is not affected
    lim.release("a")
    assert lim.acquire("a", 0) is None


def test_rate_limit_refills_at_the_rate():
    lim = ClientLimits(rate_per_s=2.0, burst=2)
    assert lim.acquire("a", 0.0) is None and lim.acquire("a", 0.0) is None
    assert lim.acquire("a", 0.0) == 0.5  # empty: one token comes back in 1/2 s
    assert lim.acquire("a", 0.25) == 0.25
    assert lim.acquire("a", 0.5) is None
    assert retry_after(0.25) == "1" and retry_after(2.5) == "3"
