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


# workers of the split and sharded planes' tests: the reaper, not kombu's visibility timeout, resumes jobs
PLANE_WORKER = dict(max_batch_weight=16384, concurrency=32, engine_process="off", visibility_timeout_s=600)


class PlaneStack:
    """Celery's broker on one Redis and the token plane on others (STREAMS_REDIS_URL: one server, or
    several shards), a client of both, and the worker processes a test starts (`close` kills them)."""

    def __init__(self, url: str, plane_urls: list[str], home) -> None:
        import redis
        from weightq.client import Client
        from weightq.settings import Settings

        self.url, self.home = url, home
        self.streams_redis_url = ",".join(plane_urls)
        self.broker = redis.Redis.from_url(url, decode_responses=True)
        self.shards = [redis.Redis.from_url(u, decode_responses=True) for u in plane_urls]
        for r in (self.broker, *self.shards):
            r.flushall()
        self.client = Client(url, settings=Settings(redis_url=url, streams_redis_url=self.streams_redis_url))
        self._workers: list = []

    def shard(self, job_id: str):
        """The server that holds the job's keys."""
        from weightq.tasks.contract import shard_of

        return self.shards[shard_of(job_id, len(self.shards))]

    def worker(self, name: str, **settings):
        from weightq.cli.processes import WorkerProcess

        settings = PLANE_WORKER | settings
        w = WorkerProcess(self.url, name, self.home, streams_redis_url=self.streams_redis_url, **settings)
        self._workers.append(w)
        return w

    def close(self) -> None:
        for w in self._workers:
            w.kill()
