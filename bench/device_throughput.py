"""The device check's throughput phase: our engine against static `generate()` batches and transformers'
continuous batching on a TinyLlama-shaped random Llama (bench/device_check.py)."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path

import torch
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig

from .device_greedy import compare, compile_modes, reference_greedy
from .device_models import build_random_llama, free_memory, load_reference, shape_text, sync
from .device_report import Report, Sizes, say
from .engine import NEAR_TIE, hf_cb_config, no_eos, requests

BF16_TIE = 5e-2  # tests/engine/test_cuda.py: bf16 logits are noisy; a divergence below this gap is a tie


# ----- throughput ----------------------------------------------------------------------------------------
def workload(n: int, prompt: tuple[int, int], new: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    """bench.engine's workload with other ranges: random prompt ids, greedy, EOS ignored."""
    rng = random.Random(seed)
    return [([rng.randrange(10, 1100) for _ in range(rng.randint(*prompt))], rng.randint(*new)) for _ in range(n)]


def run_weightq(cfg: EngineConfig, work) -> tuple[float, Engine, list]:
    engine = Engine(cfg)
    engine.generate(requests([(p, min(n, 8)) for p, n in work[:4]], "warm"))  # kernels and allocator warm
    engine.counters.update(steps=0, forward_s=0.0, step_s=0.0)
    t0 = time.perf_counter()
    results = engine.generate(requests(work))
    dt = time.perf_counter() - t0
    return sum(r.completion_tokens for r in results) / dt, engine, results


def run_static(model, work, batch: int, stop_at: float) -> tuple[float, int]:
    """bench.engine.run_static16 on the model's device: left-padded batches in arrival order, each run
    to its longest request, useful tokens counted; stops after the batch that passes `stop_at`."""
    dev = model.device
    with torch.no_grad():  # warm-up: the first generate() pays for kernel selection
        model.generate(torch.tensor([[11, 12], [13, 14]], device=dev), generation_config=no_eos(4))
    sync()
    tokens, elapsed, done = 0, 0.0, 0
    for b in range(0, len(work), batch):
        chunk = work[b : b + batch]
        longest = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in chunk], device=dev)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in chunk], device=dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=no_eos(max(n for _, n in chunk)))
        sync()
        elapsed += time.perf_counter() - t0
        tokens += sum(n for _, n in chunk)
        done += 1
        if time.monotonic() > stop_at:
            break
    return tokens / elapsed, done


def run_hf_cb(model, work, budget: int, cuda_graphs: bool | None, stop_at: float) -> float:
    """bench.engine.run_hf_cb, timed from the first request to the last result (the manager's start-up
    and warm-up, e.g. CUDA graph capture, excluded, as our engine's construction is)."""
    cb = hf_cb_config(work, budget, cuda_graphs)
    gen = no_eos(max(n for _, n in work))
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30
    ) as manager:
        t0 = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in work]
        done: dict = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing the workload")
            if result is not None and result.is_finished():
                done[result.request_id] = result
            if time.monotonic() > stop_at:
                raise TimeoutError(f"{len(done)}/{len(ids)} requests done when the time budget ran out")
        dt = time.perf_counter() - t0
    return sum(len(r.generated_tokens) for r in done.values()) / dt


def throughput_phase(report: Report, sizes: Sizes, device: torch.device, workdir: Path, seed: int, deadline: float):
    dtype = getattr(torch, sizes.tp_dtype)
    path = workdir / "throughput-model"
    t0 = time.monotonic()
    params = build_random_llama(path, sizes.tp_shape, dtype, device, seed)
    work = workload(sizes.tp_requests, sizes.tp_prompt, sizes.tp_new, seed)
    budget = len(work) * (sizes.tp_prompt[1] + sizes.tp_new[1])
    tp: dict = {
        "model": f"random Llama {params / 1e9:.2f}B ({shape_text(sizes.tp_shape)}), {sizes.tp_dtype}, seed {seed}",
        "build_s": round(time.monotonic() - t0, 1),
        "workload": {
            "requests": len(work),
            "prompt_tokens": "{}-{}".format(*sizes.tp_prompt),
            "new_tokens": "{}-{}".format(*sizes.tp_new),
            "output_tokens": sum(n for _, n in work),
            "greedy": True,
            "eos": "ignored",
            "kv_budget_tokens": budget,
        },
    }
    report.data["throughput"] = tp
    say(report, f"throughput: model built ({tp['model']})")
    cfg = EngineConfig(
        model=str(path),
        device=device.type,
        dtype=sizes.tp_dtype,
        attention="auto",
        allow_download=False,
        batcher=BatcherConfig(
            max_batch_weight=budget, max_total_tokens=sizes.tp_prompt[1] + sizes.tp_new[1], max_prefill_weight=2048
        ),
    )
    compiles = compile_modes()
    if device.type == "cpu" and "off" in compiles:
        cfg = replace(cfg, compile="off")  # the dry run checks plumbing; compiling would take most of it
    weightq, engine, results = run_weightq(cfg, work)
    c = engine.counters
    tp["weightq_tok_s"] = round(weightq, 1)
    tp["weightq_backend"] = engine.backend
    if compiles:
        tp["weightq_compile"] = cfg.compile
    tp["weightq_steps"] = c["steps"]
    tp["weightq_step_overhead_pct"] = round(100.0 * (c["step_s"] - c["forward_s"]) / max(c["step_s"], 1e-9), 1)
    del engine
    free_memory()
    report.save()
    say(report, f"throughput: weightq {weightq:.0f} tok/s")

    model = load_reference(path, dtype, device)
    left = deadline - time.monotonic()
    static, batches = run_static(model, work, sizes.static_batch, time.monotonic() + max(left - 150, 10))
    n_batches = -(-len(work) // sizes.static_batch)
    tp["hf_generate_tok_s"] = round(static, 1)
    tp["hf_generate"] = f"model.generate() on left-padded batches of {sizes.static_batch}, {batches}/{n_batches} timed"
    tp["ratio_vs_hf_generate"] = round(weightq / static, 2)
    report.save()
    say(report, f"throughput: hf generate {static:.0f} tok/s ({batches}/{n_batches} batches)")

    tie = NEAR_TIE if dtype == torch.float32 else BF16_TIE
    reqs = requests(work)[: sizes.tp_check]
    want = {r.id: reference_greedy(model, r.prompt_token_ids, r.params.max_new_tokens) for r in reqs}
    summary, ties, diverged = compare(model, reqs, results[: len(reqs)], want, tie)
    tp["greedy_check"] = {"result": summary, "tie": tie, "near_ties": ties, "divergences": diverged}
    if dtype != torch.float32:
        tp["greedy_check"]["note"] = "informational: bf16 batching changes rounding, so divergences can be real"
    report.save()
    say(report, f"throughput: greedy check {summary}")

    hf_cb = run_hf_cb(model, work, budget, cuda_graphs=False, stop_at=deadline - 20)
    tp["hf_cb_tok_s"] = round(hf_cb, 1)
    tp["ratio_vs_hf_cb"] = round(weightq / hf_cb, 2)
    tp["hf_cb"] = "transformers' continuous batching, same KV capacity and page size, no CUDA graphs (as bench.engine)"
    report.save()
    say(report, f"throughput: hf continuous batching {hf_cb:.0f} tok/s")

    if device.type == "cuda" and "on" in compiles and cfg.compile != "on":
        if deadline - time.monotonic() < 150:
            tp["weightq_compile_on_tok_s"] = "skipped: time budget"
        else:
            try:
                free_memory()
                compiled, engine, _ = run_weightq(replace(cfg, compile="on"), work)
                del engine
                tp["weightq_compile_on_tok_s"] = round(compiled, 1)
                tp["ratio_compile_on_vs_hf_cb"] = round(compiled / hf_cb, 2)
                say(report, f"throughput: weightq, compile on {compiled:.0f} tok/s")
            except Exception as e:  # an extra: reported, not fatal
                tp["weightq_compile_on_tok_s"] = f"error: {type(e).__name__}: {e}"[:500]
            free_memory()
    if device.type == "cuda":
        if deadline - time.monotonic() < 90:
            tp["hf_cb_default_tok_s"] = "skipped: time budget"
        else:
            try:
                hf_default = run_hf_cb(model, work, budget, cuda_graphs=None, stop_at=deadline - 10)
                tp["hf_cb_default_tok_s"] = round(hf_default, 1)
                tp["ratio_vs_hf_cb_default"] = round(weightq / hf_default, 2)
                tp["hf_cb_default"] = "as hf_cb, CUDA graphs as transformers decides (its default)"
                say(report, f"throughput: hf continuous batching, defaults {hf_default:.0f} tok/s")
            except Exception as e:  # an extra: reported, not fatal
                tp["hf_cb_default_tok_s"] = f"error: {type(e).__name__}: {e}"[:500]
    del model
    free_memory()
