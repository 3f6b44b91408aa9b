"""The worker bootstep that hosts the engine inside a Celery worker process.

The engine owns the accelerator, so it lives once per process: only the threads pool can host it
(prefork children cannot re-initialise CUDA; solo runs one task at a time). Task threads block on
the engine while it batches them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from celery import bootsteps
from celery.exceptions import ImproperlyConfigured
from prometheus_client import CollectorRegistry, start_http_server
from weightq.engine import AnyEngine, Engine, EngineProcess, freeze_startup_heap, own_process, serving_threads
from weightq.metrics import EngineMetrics, WorkerCollector
from weightq.redis_conn import connect
from weightq.settings import Settings
from weightq.token_plane import TokenPlane

from .host import WorkerHost
from .lease import client_name, new_instance
from .publisher import StreamPublisher
from .to_engine import engine_config

log = logging.getLogger(__name__)

# The worker's exit status when its engine process dies: EX_SOFTWARE from sysexits.h (an internal
# failure, not a usage or configuration error), the convention celery.platforms' exit codes follow.
ENGINE_DIED_EXIT = 70
# Redis connections beyond one per task thread: the host's loops and the stream writer.
EXTRA_CONNECTIONS = 16

# torch.compile's on-disk caches (inductor's FX graphs and C++ kernels, AOTAutograd's graphs), under WEIGHTQ_HOME
COMPILE_CACHE = "compile-cache"
TORCH_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

POOL_ADVICE = (
    "weightq hosts one engine per worker process and needs the threads pool: run "
    "`weightq worker` or `celery -A weightq worker -P threads -c 128`"
)


def _pool_name(pool) -> str:
    if isinstance(pool, str):
        return pool
    return f"{getattr(pool, '__module__', '')}.{getattr(pool, '__name__', '')}"


def _exit_worker(message: str) -> None:
    """The engine process died: so does the worker, at once, leaving its jobs unacked for another
    worker to run again (as if the worker itself had been killed), never failing them."""
    log.critical("%s: the worker exits so that its jobs are redelivered", message)
    logging.shutdown()
    os._exit(ENGINE_DIED_EXIT)


def pool_sized(settings: Settings, worker) -> Settings:
    """The settings with CONCURRENCY as the pool runs it: `celery worker -c 16` (or `weightq worker -c`)
    beside the default CONCURRENCY=128 would otherwise plan slots the pool does not have, so the
    threads reserved for interactive work (INTERACTIVE_SLOTS) would all hold background jobs."""
    threads = getattr(worker, "max_concurrency", None) or getattr(worker, "concurrency", None)
    if not isinstance(threads, int) or threads < 1 or threads == settings.worker.concurrency:
        return settings
    log.info("the pool runs %d task threads: CONCURRENCY=%d set aside", threads, settings.worker.concurrency)
    return settings.replace(concurrency=threads)


def use_compile_cache(home: Path) -> Path | None:
    """Point torch.compile's caches at `home`/compile-cache unless TORCHINDUCTOR_CACHE_DIR names a place
    of its own; returns the directory in use, or None when it cannot be created (torch's default then).
    torch's default lives in the temp dir, which a container loses with the pod; WEIGHTQ_HOME is what a
    deployment keeps, so a new worker finds the graphs an earlier one compiled and only traces. The
    engine (or its process, spawned after this) reads the variable when it compiles. Entries are keyed
    by torch's version and the graph, so a stale or foreign entry is a miss, never a wrong kernel."""
    # torch internal (its default has no public name): test_torchs_own_default_is_not_an_operators_choice pins it
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(TORCH_CACHE_ENV)
    # importing the engine sets the variable to torch's default: that is not a choice of the operator's
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    target = home / COMPILE_CACHE
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compile cache: %s cannot be created (%s); torch's default cache is used", target, e)
        return None
    os.environ[TORCH_CACHE_ENV] = str(target)
    return target


class EngineStep(bootsteps.StartStopStep):
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker, **kwargs) -> None:
        super().__init__(worker, **kwargs)
        name = _pool_name(getattr(worker, "pool_cls", ""))
        if "thread" not in name.lower():
            raise ImproperlyConfigured(f"pool {name!r} cannot host the engine. {POOL_ADVICE}")
        self.host: WorkerHost | None = None

    def start(self, worker) -> None:
        # every group now (a web process checks only those it reads), CONCURRENCY as the pool runs it
        settings = pool_sized(worker.app.settings.check(), worker)
        instance = new_instance(worker.hostname)
        # A connection for every task thread, plus the host's loops and the stream writer: redis-py 8
        # caps a pool at 100 by default and then raises instead of waiting, and at a warm shutdown every
        # task thread requeues its job at once. Named for the instance: its liveness (reaper.py).
        # The streams and job state may live on a Redis of their own (STREAMS_REDIS_URL): then a second
        # client reaches the broker's keys (the reaper's restores, the lease's re-stamps, recovery).
        broker_url = settings.redis.resolved_url()
        named = {"socket_timeout": 30, "health_check_interval": 10, "client_name": client_name(instance)}
        plane = TokenPlane.connect(
            settings.redis, broker_url, max_connections=settings.worker.concurrency + EXTRA_CONNECTIONS, **named
        )
        split = settings.redis.streams_urls(broker_url)[0] != broker_url
        broker = connect(broker_url, settings.redis, **named) if split else plane.home
        publisher = StreamPublisher(
            plane,
            maxlen=settings.stream.maxlen,
            ttl_s=settings.stream.ttl_s,
            job_ttl_s=settings.stream.result_ttl_s,
            flush_s=settings.stream.flush_ms / 1000,
        )
        publisher.metrics = EngineMetrics()
        config = engine_config(settings.served, settings.engine, settings.batcher)
        # a core left to the serving path; the batcher runs no more than the task threads background work
        # may hold, so that it (seeing classes and tenants) is what binds, and the rest reach it to preempt
        running = settings.worker.concurrency - settings.worker.reserved_slots()
        config = replace(config, torch_threads=serving_threads(config), max_running=running)
        cache = use_compile_cache(settings.redis.home)
        log.info("weightq worker: starting the engine (compile cache: %s)", cache or "torch's default")
        engine: AnyEngine
        if own_process(settings.engine.engine_process, config):
            engine = EngineProcess(config, sink=publisher, on_death=_exit_worker)
        else:
            engine = Engine(config, sink=publisher)
        self.host = host = WorkerHost(settings, engine, publisher, plane, worker.hostname, instance, broker)
        worker.app.weightq_host = host
        host.app = worker.app
        engine.start()
        host.start()
        freeze_startup_heap()
        if settings.metrics.port:
            registry = CollectorRegistry()
            registry.register(WorkerCollector(lambda: {worker.hostname: host.stats()}))
            start_http_server(settings.metrics.port, addr=settings.metrics.host, registry=registry)
            log.info("Prometheus metrics on http://%s:%d/metrics", settings.metrics.host, settings.metrics.port)
        log.info("weightq engine ready on %s: %s", worker.hostname, engine.kv_derivation)

    def stop(self, worker) -> None:
        if self.host is not None:
            self.host.shutdown()
            self.host.publisher.close()

    def info(self, worker) -> dict:
        return {"weightq": self.host.stats()} if self.host is not None else {}


class ConsumerLink(bootsteps.StartStopStep):
    """Hands the consumer (prefetch control, delivered messages) to the host once it exists."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer) -> None:
        host = getattr(consumer.app, "weightq_host", None)
        if host is not None:
            host.consumer = consumer
