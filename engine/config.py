"""Engine configuration: one frozen object holding the batcher's (`BatcherConfig`, the one declaration
of every admission option). The worker builds both from its settings groups `served`, `engine` and
`batcher`, each setting into the field of its name (`engine_config`; tests/app/test_settings.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from weightq.batcher.config import BatcherConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """model: builtin:tiny, a local directory, or a hub id in the local cache.
    batcher: admission and the KV budget (batcher/config.py). The engine fills in what it leaves 0:
        max_total_tokens (the model's context limit), block_size (the attention backend's),
        max_batch_weight (max_batch_size x max_total_tokens when max_batch_size is set, else from memory:
        kv_cache_mb MiB on the CPU, or gpu_memory_fraction of free CUDA memory after loading); the runner
        picks its weight model (token: paged and simulated; padded: padded), which resolves mode "auto".
    max_input_length: 0 means the batcher's max_total_tokens minus one.
    attention: "sdpa" (paged.py), "flash" (flash-attn's varlen kernel over the paged pool, CUDA), "auto"
        (flash where it can run), or "flash_reference": the flash path with a pure-torch stand-in of
        flash-attn's kernel (attention/flash_reference.py), which runs anywhere: for tests, never serving.
    runner: "paged" (KV blocks, packed steps) for decoder-only models on transformers' attention
        interface; "padded" (left-padded batch, the model's own cache) for everything else, e.g.
        T5/BART; "auto" picks per model. The padded runner's weight is rows x padded length, and its
        budget, unless set, comes from measuring its memory per weight unit at start-up. "simulated" is
        a measuring tool (engine/runner/simulated.py): real batcher, blocks, sampling and detokenization
        around a modelled device time (sim_step_cost) instead of the model's forward.
    compile: torch.compile the paged runner's hot path (decode attention reading the KV pool in
        place, and the model's forward with dynamic token counts); compiled and warmed up at
        start-up (logged). "auto" turns it on where it was measured to win (CPU, paged runner), unless
        TORCH_COMPILE_DISABLE=1.
    torch_threads: torch's intra-op threads for the engine (process-wide); 0: torch's default (one
        per core) for a model on the CPU, 1 for one on CUDA or the simulated device
        (setup.host_threads). With other busy processes on the same cores, fewer threads than cores
        avoid parallel regions that wait for a descheduled thread: a worker's engine takes
        setup.serving_threads' choice, one core left free (README: "Threads").
    """

    model: str = "builtin:tiny"
    device: str = "auto"
    dtype: str = "auto"
    attention: Literal["auto", "sdpa", "flash", "flash_reference"] = "auto"
    runner: Literal["auto", "paged", "padded", "simulated"] = "auto"
    compile: Literal["auto", "on", "off"] = "auto"
    torch_threads: int = 0
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    # requests its host can hold running at once (a worker: its task threads less those kept for urgent
    # and light jobs); the batcher's cap on running requests with max_batch_size, so that the batcher,
    # which sees classes and tenants' shares, is what binds (0: no such limit)
    max_running: int = 0
    max_input_length: int = 0
    kv_cache_mb: int = 512  # the CPU KV budget (MiB) when max_batch_weight is derived from memory
    gpu_memory_fraction: float = 0.85
    seed: int = 0
    allow_download: bool = True  # False: a hub id must already be in the local cache
    sim_step_cost: str = ""  # runner="simulated": "fixed_s,per_token_s,per_kv_token_s" (default: StepCost())
    # sliding-window layers keep a ring of their window plus one block (False: every block of the context,
    # each window a mask over it; the memory of a model of full layers, for comparison: bench.families)
    window_rings: bool = True
    # structured output: a spec not compiled before is compiled first in a trial process and refused
    # past this many seconds or MiB (`Grammars`; 0 s: no trial, every compile trusted)
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_memory_mb: int = 2048
    check_invariants: bool = False  # tests: verify the KV pool and the budget after every step
    # LoRA adapters served beside the base model, "name=path-or-hub-id,..." (vLLM's --lora-modules): a
    # request names one as its model; their bytes come out of the KV budget (engine/lora/)
    lora_modules: str = ""
    enable_lora: bool = False  # serve adapters loaded at run time (implied by lora_modules)
    max_lora_rank: int = 16  # the largest adapter rank served: every adapter slot is this wide
