"""This worker's LoRA adapters follow the pool's: LORA_ADAPTERS (name -> path, "" once unloaded), which
the gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter write, is read every second; adapters
named there are loaded, those marked unloaded go, and a load that failed is reported in LORA_ERRORS.
A worker started later loads what was loaded before it: the pool serves one set of adapters.

Before loading, a worker checks the source again against its own LORA_ROOT and LORA_HUB_IDS
(`ServedSettings.adapter_source`), on its own disk: anything that can write Redis can write
LORA_ADAPTERS, so the gateway's check alone would not hold. A refusal is reported like a failed load,
without the path."""

from __future__ import annotations

import logging
import threading

import redis
from weightq.engine import AnyEngine
from weightq.engine.lora import AdapterError
from weightq.settings import AdapterSourceError, ServedSettings
from weightq.tasks.contract import LORA_ADAPTERS, LORA_ERRORS

log = logging.getLogger(__name__)

SYNC_S = 1.0


class AdapterSync:
    def __init__(self, client: redis.Redis, engine: AnyEngine, hostname: str, served: ServedSettings) -> None:
        self.client, self.engine, self.hostname, self.served = client, engine, hostname, served
        self._tried: dict[str, str] = {}  # name -> the path last loaded (or tried) here: not tried again
        self._reported: dict[str, str] = {}  # name -> the error last reported (or seen before the last try)

    def sync(self) -> None:
        raw = self.client.hgetall(LORA_ADAPTERS)
        wanted = {k.decode(): v.decode() for k, v in raw.items()}
        stats = self.engine.stats()
        have = set(stats.get("adapters", ()))
        errors: dict[str, str] = stats.get("adapter_errors") or {}
        for name in [n for n in self._tried if not wanted.get(n)]:  # unloaded, or given up: may come again
            self._tried.pop(name)
            self._reported.pop(name, None)
        for name, path in wanted.items():
            if not path:  # unloaded for the pool
                if name in have:
                    self.engine.unload_adapter(name)
                    log.info("LoRA adapter %s unloaded", name)
            elif name not in have and self._tried.get(name) != path:
                self._tried[name] = path
                if name in errors:  # an earlier try's reason: only a new one answers this try
                    self._reported[name] = errors[name]
                self._load(name, path)
        for name, why in errors.items():
            if wanted.get(name) and self._reported.get(name) != why:
                self._report(name, why)

    def _load(self, name: str, path: str) -> None:
        try:
            source = self.served.adapter_source(path)
        except AdapterSourceError as e:
            self._report(name, f"adapter {name!r}: lora_path {e}")
            return
        try:
            self.engine.load_adapter(name, source)  # an engine process reports failures in its stats
            log.info("LoRA adapter %s loading", name)
        except AdapterError as e:  # the engine in this process: the reason is known now
            self._report(name, str(e))

    def _report(self, name: str, why: str) -> None:
        log.warning("%s", why)
        self._reported[name] = why
        self.client.hset(LORA_ERRORS, name, f"{self.hostname}: {why}")


def adapters_loop(sync: AdapterSync, stop: threading.Event) -> None:
    while not stop.wait(SYNC_S):
        try:
            sync.sync()
        except redis.RedisError as e:  # Redis away: the next look tries again
            log.warning("LoRA adapters: %s", e)
