"""Real servers for the service tests."""

from __future__ import annotations

from collections.abc import Iterator


def embedded_redis(tmp_path_factory, name: str = "redis") -> Iterator[str]:
    """A Redis server of its own for a module's tests: yields its URL, stops it after."""
    from weightq.cli.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp(name))
    url = server.start()
    yield url
    server.stop()
