"""Shared helpers: drive a Batcher like an engine would, with a simulated clock."""

from __future__ import annotations

import os

# Tests run eager (compiling costs tens of seconds per engine): EngineConfig.compile="auto" honours
# TORCH_COMPILE_DISABLE, read by torch at import (so set here first) and inherited by worker processes.
# tests/test_compile.py runs its compiled tests in a pytest process of their own without it.
if os.environ.get("WEIGHTQ_TEST_COMPILE") != "1":
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

from dataclasses import dataclass, field

from batcher import Batcher, Request


@dataclass
class Run:
    """What happened when a batcher was driven to completion."""

    admitted: list[tuple[int, float, str]] = field(default_factory=list)  # (step, now, id) in order
    finished: dict[str, int] = field(default_factory=dict)  # id -> step
    max_weight: int = 0
    steps: int = 0


def drive(
    batcher: Batcher,
    requests: list[Request],
    stop_at: dict[str, int] | None = None,
    *,
    dt: float = 0.1,
    max_steps: int = 200_000,
    on_step=None,
) -> Run:
    """Submit each request at its arrival time and step until all finish.

    A request stops after `stop_at[id]` tokens (EOS), else at max_new_tokens. Every plan is checked
    against the prefill cap (several chunks must fit it; one prompt may exceed it alone) and, after
    every step, the batch weight against the budget.
    """
    stop_at = stop_at or {}
    pending = sorted(requests, key=lambda r: r.arrival_s)
    run = Run()
    now = 0.0
    i = 0
    while len(run.finished) < len(requests):
        while i < len(pending) and pending[i].arrival_s <= now:
            batcher.submit(pending[i])
            i += 1
        if not batcher.running and not batcher.waiting:
            now = pending[i].arrival_s
            continue
        plan = batcher.schedule(now)
        assert plan, f"nothing runnable with {len(batcher.waiting)} waiting at step {batcher.step}"
        cap = batcher.config.max_prefill_weight
        if cap and len(plan.prefill) > 1:
            lens = [n for _, n in plan.prefill]
            used = batcher.weight.prefill(len(lens), max(lens), sum(lens))
            assert used <= cap, f"prefill weight {used} > cap {cap} with {len(lens)} chunks"
        for r in plan.admitted:
            run.admitted.append((batcher.step, now, r.id))
        emitted = batcher.complete(plan)
        weight = batcher.batch_weight()
        assert weight <= batcher.budget, f"weight {weight} > budget {batcher.budget} at step {batcher.step}"
        run.max_weight = max(run.max_weight, weight)
        for r in emitted:
            if r.generated >= min(stop_at.get(r.id, r.max_new_tokens), r.max_new_tokens):
                batcher.finish(r.id)
                run.finished[r.id] = batcher.step
        if on_step:
            on_step(batcher)
        now += dt
        run.steps += 1
        assert run.steps <= max_steps, "no progress"
    return run


# ----- engine fixtures: the built-in tiny model, loaded once per session ---------------------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_path():
    from engine.builtin import builtin_path

    return builtin_path("tiny")


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny model loaded for the engine (paged attention)."""
    from engine.attention import register
    from engine.models import load_model

    return load_model("builtin:tiny", device="cpu", attn_implementation=register("sdpa"))


@pytest.fixture(scope="session")
def reference_model(tiny_path):
    """A separate copy of the tiny model with transformers' own attention: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="sdpa").eval()


# ----- service fixtures: a real Redis per test module ------------------------------------------------
@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    from app.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture
def service(redis_url, tmp_path, monkeypatch):
    """A clean Redis, a Client for it, and a factory of worker processes (stopped at teardown)."""
    import redis

    from app.client import Client
    from app.settings import Settings
    from tests.service import WorkerProcess

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
