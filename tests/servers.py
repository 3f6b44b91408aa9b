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


def queued_messages(r, queue: str = "weightq") -> list[bytes]:
    """Every message waiting for `queue`: in the lists Celery consumes and staged (FAIR_QUEUE)."""
    from weightq.tasks.contract import staged_sets
    from weightq.transport import priority_queues

    lists = [m for q in priority_queues(queue) for m in r.lrange(q, 0, -1)]
    staged = [m for key in staged_sets(queue) for m in r.zrange(key, 0, -1)]  # "<tenant> <message>"
    return lists + [m.split(b" " if isinstance(m, bytes) else " ", 1)[1] for m in staged]


def take_queued(r, queue: str = "weightq") -> bytes | None:
    """Take one waiting message of `queue` out of Redis (a message a crash lost), wherever it waits."""
    from weightq.tasks.contract import staged_sets
    from weightq.transport import priority_queues

    for q in priority_queues(queue):
        if (m := r.rpop(q)) is not None:
            return m
    for key in staged_sets(queue):
        if popped := r.zpopmin(key):
            return popped[0][0]
    return None
