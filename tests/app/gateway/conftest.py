"""Fixtures of the gateway tests: one Redis, one worker and one gateway (with an API key) per module."""

from __future__ import annotations

from typing import ClassVar

import openai
import pytest
import redis
import text_generation
from weightq.cli.processes import GatewayProcess, WorkerProcess

KEY = "test-key-123"


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("gateway")
    redis.Redis.from_url(redis_url).flushall()
    worker = WorkerProcess(redis_url, "gw@test", home, max_batch_weight=8192, concurrency=32)
    # a key's default limits (10 requests/s, 32 generations: test_hostile.py) would pace these tests
    gateway = GatewayProcess(redis_url, home, api_key=KEY, rate_limit_per_s=0, max_concurrent_per_client=0)
    worker.wait_ready()
    gateway.wait_ready()

    class Stack:
        key = KEY
        url = redis_url
        base = gateway.base
        oai = openai.OpenAI(base_url=gateway.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        tgi = text_generation.Client(gateway.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        headers: ClassVar[dict] = {"Authorization": f"Bearer {KEY}"}

        @staticmethod
        def stats(ok=lambda s: True) -> dict:
            return worker.wait_stats(ok)  # a heartbeat written from now on that satisfies `ok`

        @staticmethod
        def worker_log() -> str:
            return worker.log()

    yield Stack
    gateway.stop()
    worker.stop()
    worker.kill()
