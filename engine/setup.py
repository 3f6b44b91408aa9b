"""Building an engine's parts from its config: attention backend, model, KV pool, batcher."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from batcher import Batcher, BatcherConfig, ConfigError

from .attention import register
from .config import EngineConfig
from .flash import available as flash_available
from .kv_cache import KVCache, derive_capacity
from .models import LoadedModel, load_model, resolve_device

log = logging.getLogger(__name__)
T = TypeVar("T")


def on_fresh_thread(fn: Callable[[], T]) -> T:
    """Run `fn` on a short-lived thread and return its result (or raise its error).

    Torch's CPU ops run on OpenMP (libgomp), which keeps a team of spinning threads alive for every
    thread that ever ran a parallel op. Once more such threads exist than cores, libgomp stops spinning
    and every small op pays a futex wake-up: on 2 cores the engine thread ran its forward passes 1.5-5x
    slower after the model had been loaded on the (long-lived) main thread. Loading here lets that
    team die with the thread, leaving the engine thread the only OpenMP user.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="weightq-load")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


@dataclass(slots=True)
class EngineParts:
    backend: str
    lm: LoadedModel
    cache: KVCache
    batcher: Batcher
    kv_derivation: str
    max_input_length: int


def build(cfg: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Pick the attention backend, load the model, size the KV pool (logged) and the batcher on it."""
    device = resolve_device(cfg.device)
    backend = cfg.attention
    if backend == "auto":
        backend = "flash" if device.type == "cuda" and flash_available() else "sdpa"
    if backend == "flash" and not flash_available():
        raise ConfigError("attention='flash' needs CUDA and the flash-attn package (pip install weightq[cuda])")
    attn_name = register(backend)
    lm = loaded or load_model(
        cfg.model, device=cfg.device, dtype=cfg.dtype, attn_implementation=attn_name, allow_download=cfg.allow_download
    )
    if loaded is not None:
        lm.model.set_attn_implementation(attn_name)
    block = cfg.block_size or (256 if backend == "flash" else 16)
    max_total = min(cfg.max_total_tokens or lm.context_limit, lm.context_limit)
    max_input = min(cfg.max_input_length or max_total - 1, max_total - 1)
    weight = cfg.max_batch_weight
    if weight is None and cfg.max_batch_size:
        weight = cfg.max_batch_size * -(-max_total // block) * block
    blocks, why = derive_capacity(
        lm.geometry,
        block,
        lm.device,
        max_batch_weight=weight,
        cpu_kv_bytes=cfg.cpu_kv_bytes,
        gpu_memory_fraction=cfg.gpu_memory_fraction,
    )
    log.info("KV cache: %s", why)
    try:
        batcher = Batcher(
            BatcherConfig(
                max_batch_weight=blocks * block,
                max_batch_size=cfg.max_batch_size,
                max_total_tokens=max_total,
                max_prefill_weight=cfg.max_prefill_weight,
                chunked_prefill=True,
                block_size=block,
                jump_window_s=cfg.jump_window_s,
                max_wait_s=cfg.max_wait_s,
                mode=cfg.mode,
                predictive_quantile=cfg.predictive_quantile,
            )
        )
    except ConfigError as e:
        raise ConfigError(f"{e} (KV cache: {why})") from e
    return EngineParts(backend, lm, KVCache(lm.geometry, blocks, block, lm.device), batcher, why, max_input)
