"""This worker's LoRA adapters follow the pool's: LORA_ADAPTERS (name -> path, "" once unloaded), which
the gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter write, is read every second; adapters
named there are loaded, those marked unloaded go, and a load that failed is reported in LORA_ERRORS.
A worker started later loads what was loaded before it: the pool serves one set of adapters."""

from __future__ import annotations

import logging
import threading

import redis
from weightq.engine import AnyEngine
from weightq.engine.lora import AdapterError
from weightq.tasks.contract import LORA_ADAPTERS, LORA_ERRORS

log = logging.getLogger(__name__)

SYNC_S = 1.0


class AdapterSync:
    def __init__(self, client: redis.Redis, engine: AnyEngine, hostname: str) -> None:
        self.client, self.engine, self.hostname = client, engine, hostname
        self._tried: dict[str, str] = {}  # name -> the path last loaded (or tried) here: not tried again
        self._reported: dict[str, str] = {}  # name -> the error last reported

    def sync(self) -> None:
        raw = self.client.hgetall(LORA_ADAPTERS)
        wanted = {k.decode(): v.decode() for k, v in raw.items()}
        stats = self.engine.stats()
        have = set(stats.get("adapters", ()))
        for name, path in wanted.items():
            if not path:  # unloaded for the pool
                if name in have:
                    self.engine.unload_adapter(name)
                    log.info("LoRA adapter %s unloaded", name)
                self._tried.pop(name, None)
            elif name not in have and self._tried.get(name) != path:
                self._tried[name] = path
                try:
                    self.engine.load_adapter(name, path)  # an engine process reports failures in its stats
                    log.info("LoRA adapter %s loading from %s", name, path)
                except AdapterError as e:
                    log.warning("%s", e)
        for name, why in (stats.get("adapter_errors") or {}).items():
            if wanted.get(name) and self._reported.get(name) != why:
                self._reported[name] = why
                self.client.hset(LORA_ERRORS, name, f"{self.hostname}: {why}")


def adapters_loop(sync: AdapterSync, stop: threading.Event) -> None:
    while not stop.wait(SYNC_S):
        try:
            sync.sync()
        except redis.RedisError as e:  # Redis away: the next look tries again
            log.warning("LoRA adapters: %s", e)
