"""Fixtures every suite shares: the built-in tiny model (loaded once a session), a real Redis per
module, and worker processes on it. Helpers live in tests/drive.py and tests/reference.py."""

from __future__ import annotations

import os

# Tests run eager (compiling costs tens of seconds per engine): EngineConfig.compile="auto" honours
# TORCH_COMPILE_DISABLE, read by torch at import (so set here first) and inherited by worker processes.
# tests/engine/test_compile.py runs its compiled tests in a pytest process of their own without it.
if os.environ.get("WEIGHTQ_TEST_COMPILE") != "1":
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


# ----- engine fixtures: the built-in tiny model, loaded once per session ---------------------------
import pytest

from tests.servers import embedded_redis


@pytest.fixture(scope="session")
def tiny_path():
    from weightq.engine.model import builtin_path

    return builtin_path("tiny")


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny model loaded for the engine (paged attention)."""
    from weightq.engine.attention import register
    from weightq.engine.model import load_model

    return load_model("builtin:tiny", device="cpu", attn_implementation=register("sdpa"))


@pytest.fixture(scope="session")
def reference_model(tiny_path):
    """A separate copy of the tiny model with transformers' own attention: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="sdpa").eval()


# ----- service fixtures: a real Redis per test module ------------------------------------------------
@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    yield from embedded_redis(tmp_path_factory)


@pytest.fixture
def service(redis_url, tmp_path, monkeypatch):
    """A clean Redis, a Client for it, and a factory of worker processes (stopped at teardown)."""
    import redis
    from weightq.cli.processes import WorkerProcess
    from weightq.client import Client
    from weightq.settings import Settings

    redis.Redis.from_url(redis_url).flushall()
    monkeypatch.setenv("REDIS_URL", redis_url)
    workers: list[WorkerProcess] = []

    class Service:
        url = redis_url
        client = Client(redis_url, settings=Settings(redis_url=redis_url))

        @staticmethod
        def worker(name: str = "w1@test", **settings) -> WorkerProcess:
            settings.setdefault("max_batch_weight", 8192)
            settings.setdefault("concurrency", 64)
            # The engine in the worker's process: a spawned engine child adds ~3 s to each of the
            # suite's worker starts on 2 cores. The child (the default on a CPU of 2+ cores) has its
            # own tests: tests/engine/test_core_process.py, the restarts and the dead engine in
            # tests/app/worker/test_faults.py, and every stack started without this factory.
            settings.setdefault("engine_process", "off")
            w = WorkerProcess(redis_url, name, tmp_path, **settings)
            workers.append(w)
            return w

    yield Service
    hung = []
    for w in workers:
        try:
            w.stop()
        except AssertionError as e:
            hung.append(e)
        finally:
            w.kill()
    if hung:
        raise hung[0]
