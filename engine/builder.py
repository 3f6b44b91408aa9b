"""Building an engine's parts from its config: attention backend, model, KV pool, batcher."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch
from weightq.batcher import Batcher, ConfigError
from weightq.batcher.sim.cost import StepCost

from .attention import register
from .attention.flash import BACKENDS as FLASH_BACKENDS
from .attention.flash import available as flash_available
from .attention.probe import check_backend, probe
from .config import EngineConfig
from .lora import AdapterError, Resident, parse_modules, read_adapter
from .model import LoadedModel, choose_runner, load_model, resolve_device
from .runner.base import Runner
from .runner.kv_cache import KVCache, KVGeometry, KVLayout, derive_capacity
from .runner.padded import PaddedRunner, measure_padded
from .runner.paged import ModelRunner
from .runner.simulated import SIMULATED_GEOMETRY, SimulatedRunner

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


def host_threads(cfg: EngineConfig, device: torch.device) -> int:
    """torch's intra-op threads when TORCH_THREADS is unset: 0 (torch's default, one per core) when
    the model runs on the CPU; 1 when it runs on a device (CUDA, or the simulated one). There the
    host's torch ops are the sampler's small ones, and a team of threads that slept through the
    device's step costs more to wake than the op: argmax over [256, vocab] took 3 ms on two threads
    after a 20 ms wait, 0.6 ms on one (vLLM's GPU workers default to one thread for the same reason)."""
    return 1 if cfg.runner == "simulated" or device.type == "cuda" else 0


def serving_threads(cfg: EngineConfig) -> int:
    """TORCH_THREADS for an engine that serves beside other busy processes (a worker: Celery's
    consumer and task threads, the stream writer, and on one host Redis and the gateway) when the
    setting is 0: on the CPU one fewer than torch's default (at least one), so those processes run
    on the core left over instead of descheduling one of the forward's threads, which stalls every
    parallel region of the step; elsewhere host_threads' choice. vLLM's CPU server keeps a core
    the same way. bench.serve, tiny model on 2 cores, alternating stacks: 1 thread (and the engine
    in a process of its own, see own_process) gave 3,565 tok/s against 2,971 for 2 threads at
    256 requests, 2,422 against 2,102 at 64, and 293 against 233 for a single stream."""
    if cfg.torch_threads:
        return cfg.torch_threads
    device = resolve_device(cfg.device)
    if cfg.runner == "simulated" or device.type != "cpu":
        return host_threads(cfg, device)  # 1: a device's host thread
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0))) - 1)


@dataclass(slots=True)
class EngineParts:
    backend: str
    lm: LoadedModel
    runner: Runner  # ModelRunner (paged) or PaddedRunner
    batcher: Batcher
    kv_derivation: str
    max_input_length: int


def build(cfg: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Load the model, pick its runner and attention backend, size the KV memory (logged) and put
    the batcher on it."""
    device = resolve_device(cfg.device)
    threads = cfg.torch_threads or host_threads(cfg, device)
    if threads:
        torch.set_num_threads(threads)  # process-wide; threads that start later take it too
    backend = cfg.attention
    if backend == "auto":
        backend = "flash" if device.type == "cuda" and flash_available() else "sdpa"
    if backend == "flash" and not flash_available():
        raise ConfigError("attention='flash' needs CUDA and the flash-attn package (pip install weightq[cuda])")
    attn_name = register(backend)
    try:
        lm = loaded or load_model(
            cfg.model,
            device=cfg.device,
            dtype=cfg.dtype,
            attn_implementation=attn_name,
            allow_download=cfg.allow_download,
            runner="paged" if cfg.runner == "simulated" else cfg.runner,
        )
        kind = "simulated" if cfg.runner == "simulated" else choose_runner(lm.model.config, cfg.runner)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    max_total = min(cfg.batcher.max_total_tokens or lm.context_limit, lm.context_limit)
    max_input = min(cfg.max_input_length or max_total - 1, max_total - 1)
    if (cfg.lora_modules or cfg.enable_lora) and kind != "paged":
        raise ConfigError(f"lora_modules: LoRA adapters are served on the paged runner only (this model runs {kind})")
    if kind == "simulated":
        return _build_simulated(cfg, lm, max_total, max_input)
    if kind == "padded":
        if loaded is not None:
            lm.model.set_attn_implementation("sdpa" if lm.model._supports_sdpa else "eager")
        lm.runner = "padded"
        return _build_padded(cfg, lm, max_total, max_input)
    if loaded is not None:
        lm.model.set_attn_implementation(attn_name)
    backend, layout = _paged_layout(cfg, lm, backend, attn_name, max_total)
    pages, why = derive_capacity(
        layout,
        lm.device,
        max_batch_weight=paged_weight(cfg, max_total, layout.block_size),
        kv_cache_mb=cfg.kv_cache_mb,
        gpu_memory_fraction=cfg.gpu_memory_fraction,
    )
    log.info("KV cache: %s", why)
    cache = KVCache(layout, pages, lm.device)
    adapters = parse_lora(cfg.lora_modules)
    # before the model is compiled: its layers change
    lora = Resident(lm.model, cfg.max_lora_rank) if adapters or cfg.enable_lora else None
    compiled = wants_compile(cfg.compile, lm.device, backend)
    runner = ModelRunner(lm.model, cache, backend, lm.device, compiled=compiled, lora=lora)
    # one adapter slot's memory in weight units (tokens of the whole model's KV), out of the budget when taken
    slot_weight = math.ceil(lora.slot_bytes / (layout.page_bytes / layout.block_size)) if lora is not None else 0
    batcher = make_batcher(
        cfg,
        pages * layout.block_size,
        max_total,
        f"KV cache: {why}",
        block_size=layout.block_size,
        layout=layout,
        adapter_slot_weight=slot_weight,
    )
    runner.ledger = batcher.ledger
    if lora is not None:
        load_adapters(cfg, lm, lora, adapters, batcher)
    return EngineParts(backend, lm, runner, batcher, why, max_input)


def parse_lora(spec: str) -> dict[str, str]:
    try:
        return parse_modules(spec)
    except AdapterError as e:
        raise ConfigError(str(e)) from None


def load_adapters(
    cfg: EngineConfig, lm: LoadedModel, lora: Resident, adapters: dict[str, str], batcher: Batcher
) -> None:
    """Read the configured adapters (kept on the host until a request needs a slot); refuse a batcher
    whose budget leaves no adapter slot beside one request of max_total_tokens."""
    dtype = next(lm.model.parameters()).dtype
    for name, path in adapters.items():
        try:
            lora.add(read_adapter(name, path, lora, dtype, cfg.allow_download))
        except (AdapterError, ValueError) as e:
            raise ConfigError(str(e)) from None
        log.info("LoRA adapter %s (rank %d) from %s", name, lora.host[name].rank, path)
    slots = batcher.adapters
    if not slots.max_capacity:
        raise ConfigError(
            f"lora: one adapter slot (rank {lora.rank}: {lora.slot_bytes} B, {slots.slot_weight} tokens of KV) and "
            f"one request of max_total_tokens do not fit in max_batch_weight {batcher.budget}"
        )
    log.info("LoRA: slots of %d tokens of KV each, up to %d", slots.slot_weight, slots.max_capacity)


def _paged_layout(cfg: EngineConfig, lm: LoadedModel, backend: str, attn_name: str, max_total: int):
    """Probe the model's attention calls (refusing what the paged runner cannot honour), pick the
    backend that can serve them and lay their KV out (kv_cache.py). Returns (backend, layout)."""
    try:
        calls = probe(lm.model, attn_name, register_fn(backend))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    why_not = check_backend(calls, backend)
    if why_not:
        if cfg.attention in FLASH_BACKENDS:
            raise ConfigError(
                f"attention={cfg.attention} cannot serve this model: {why_not}; use attention=sdpa (or auto)"
            )
        log.info("flash-attn cannot serve this model (%s): the paged SDPA backend serves it", why_not)
        backend = "sdpa"
        register(backend)
    c = calls[0]
    lm.geometry = KVGeometry(len(calls), c.kv_heads, c.k_dim, lm.dtype, c.v_dim)
    block = cfg.batcher.block_size or (256 if backend == "flash" else 16)
    chunk = (cfg.batcher.max_prefill_weight or max_total) if backend in FLASH_BACKENDS else 0
    layout = KVLayout.build(lm.geometry, [c.window for c in calls], block, max_total, chunk, rings=cfg.window_rings)
    if layout.windows:
        log.info("attention kinds: %s", layout.describe())
        if cfg.batcher.prefix_cache and not layout.has_full:
            log.info("prefix cache off: every layer of this model has a sliding window (no block outlives it)")
    return backend, layout


def register_fn(backend: str):
    """The attention function `register(backend)` puts under our name."""
    if backend == "flash":
        from .attention.flash import flash_paged_attention

        return flash_paged_attention
    if backend == "flash_reference":
        from .attention.flash import flash_reference_attention

        return flash_reference_attention
    from .attention import paged_attention

    return paged_attention


def wants_compile(setting: str, device: torch.device, backend: str) -> bool:
    """compile=auto is on where it was measured to win: the paged runner on CPU with SDPA (it also
    stays off when TORCH_COMPILE_DISABLE=1). flash-attn's kernel is already fused: never compiled."""
    if setting not in ("auto", "on", "off"):
        raise ConfigError(f"compile: must be auto, on or off (got {setting!r})")
    if setting == "off" or backend in FLASH_BACKENDS:
        return False
    if setting == "on":
        return True
    return device.type == "cpu" and not torch._dynamo.config.disable


def _build_simulated(cfg: EngineConfig, lm: LoadedModel, max_total: int, max_input: int) -> EngineParts:
    """The simulated device (engine/runner/simulated.py): the paged runner's batcher and block allocator, the
    model only for its tokenizer, vocabulary and limits. Its KV capacity, unless set, is what the
    model's real KV would fit in kv_cache_mb."""
    block = cfg.batcher.block_size or 16
    weight = paged_weight(cfg, max_total, block)
    cpu = torch.device("cpu")
    # the pool is sized as the model's real KV would be (its geometry), then allocated one float per token
    real = KVLayout.build(lm.geometry, [None] * lm.geometry.num_layers, block, max_total)
    blocks, why = derive_capacity(
        real, cpu, max_batch_weight=weight, kv_cache_mb=cfg.kv_cache_mb, gpu_memory_fraction=1.0
    )
    try:
        cost = StepCost.parse(cfg.sim_step_cost) if cfg.sim_step_cost else StepCost()
    except ValueError as e:
        raise ConfigError(f"sim_step_cost: {e}") from None
    vocab = int(lm.model.get_output_embeddings().weight.shape[0])
    layout = KVLayout.build(SIMULATED_GEOMETRY, [None], block, max_total)
    runner = SimulatedRunner(KVCache(layout, blocks, cpu), vocab, cost, avoid=lm.eos_token_ids)
    lm.runner = "simulated"
    log.warning("RUNNER=simulated: a measuring tool, not a model (%s)", cost)
    batcher = make_batcher(cfg, blocks * block, max_total, f"simulated device; KV: {why}", block_size=block)
    runner.ledger = batcher.ledger
    return EngineParts("simulated", lm, runner, batcher, why, max_input)


def _build_padded(cfg: EngineConfig, lm: LoadedModel, max_total: int, max_input: int) -> EngineParts:
    if cfg.batcher.mode == "predictive":
        raise ConfigError("mode: the padded runner supports worst_case only (predictive mode preempts)")
    tok = lm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else getattr(lm.model.config, "pad_token_id", None)
    runner = PaddedRunner(lm.model, lm.device, pad_id=pad or 0, decoder_start_id=lm.decoder_start_id)
    weight, size = cfg.batcher.max_batch_weight, cfg.batcher.max_batch_size
    if weight:
        why = f"max_batch_weight={weight} set explicitly"
    elif size:
        weight = size * max_total
        why = f"max_batch_size {size} x max_total_tokens {max_total}"
    else:
        per_unit, how = measure_padded(runner, lm)
        if lm.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(lm.device)
            budget = int(free * cfg.gpu_memory_fraction)
            where = f"{cfg.gpu_memory_fraction:.0%} of {free / 2**30:.2f} GiB free on {lm.device}"
        else:
            budget, where = cfg.kv_cache_mb * 2**20, f"kv_cache_mb={cfg.kv_cache_mb} MiB"
        weight = int(budget // per_unit)
        why = f"{where} / {per_unit:.0f} B per weight unit ({how})"
    log.info("padded batch: max_batch_weight %d (%s)", weight, why)
    batcher = make_batcher(cfg, weight, max_total, f"padded batch: {why}")
    runner.budget = batcher.budget
    return EngineParts("padded", lm, runner, batcher, f"{weight} padded weight units ({why})", max_input)


def paged_weight(cfg: EngineConfig, max_total: int, block_size: int) -> int:
    """max_batch_weight of a token weight model: as set, else max_batch_size requests of max_total tokens
    in whole blocks; 0: derive it from memory (`derive_capacity`)."""
    b = cfg.batcher
    return b.max_batch_weight or b.max_batch_size * -(-max_total // block_size) * block_size


def make_batcher(
    cfg: EngineConfig,
    weight: int,
    max_total: int,
    why: str,
    *,
    block_size: int = 0,
    layout: KVLayout | None = None,
    adapter_slot_weight: int = 0,
) -> Batcher:
    """The one place the engine completes its BatcherConfig with what it found: the budget, the context
    and the paged runner's token weight (`block_size` > 0, its attention kinds) or the padded runner's
    (whole prompts; `resolved()` makes mode "auto" worst_case there). A config that cannot serve one
    maximal request raises ConfigError saying where the budget came from (`why`)."""
    paged, b = block_size > 0, cfg.batcher
    config = replace(
        b,
        max_batch_weight=weight,
        max_batch_size=min((n for n in (b.max_batch_size, cfg.max_running) if n), default=0),
        max_total_tokens=max_total,
        chunked_prefill=paged and b.chunked_prefill,
        weight_model="token" if paged else "padded",
        block_size=block_size or 1,
        kinds=layout.weight_kinds() if layout is not None else ((1, 0),),
        windows=tuple(k.window for k in layout.windows) if layout is not None else (),  # type: ignore[misc]
    )
    try:
        return Batcher(config, adapter_slot_weight=adapter_slot_weight)
    except ConfigError as e:
        raise ConfigError(f"{e} ({why})") from e
