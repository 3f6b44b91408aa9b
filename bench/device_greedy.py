"""The device check's greedy phase: per-request `generate()` against our engine on every path the engine
offers on that machine (bench/device_check.py)."""

from __future__ import annotations

import random
import time
import typing
from pathlib import Path

import torch
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.engine.attention.flash import available as flash_available

from .device_models import build_random_llama, free_memory, load_reference, shape_text
from .device_report import Report, Sizes, say
from .engine import NEAR_TIE, no_eos


def attention_choices() -> list[str]:
    """The attention backends EngineConfig offers (its Literal), "auto" aside: read, not hard-coded."""
    hint = typing.get_type_hints(EngineConfig)["attention"]
    return [a for a in typing.get_args(hint) if a != "auto"]


def compile_modes() -> list[str]:
    """EngineConfig.compile's choices where the engine has that option (torch.compile of the paged
    runner's hot path), else none."""
    hints = typing.get_type_hints(EngineConfig)
    return list(typing.get_args(hints["compile"])) if "compile" in hints else []


# ----- greedy equality ---------------------------------------------------------------------------------
def mixed_requests(n: int, max_prompt: int, max_new: int, seed: int) -> list[GenerationRequest]:
    """tests/engine/test_engine.py's mix (1- and 2-token prompts, full-length ones, 1 new token, the most) with
    EOS ignored, so every output has its exact length on both sides."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        mid_p, mid_n = min(40, max_prompt), min(40, max_new)
        plen = rng.choice([1, 2, rng.randint(3, mid_p), rng.randint(mid_p, max_prompt), max_prompt])
        new = rng.choice([1, rng.randint(2, mid_n), rng.randint(mid_n, max_new), max_new])
        ids = [rng.randrange(10, 1100) for _ in range(plen)]
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        out.append(GenerationRequest(f"r{i}", prompt_token_ids=ids, params=params))
    return out


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=no_eos(n))
    return out[0, len(prompt) :].tolist()


def tie_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """The reference's top1 - top2 logit gap where the outputs part."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + prefix], device=model.device)).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def compare(model, reqs, results, want: dict[str, list[int]], tie: float) -> tuple[str, list[str], list[str]]:
    """("k/n identical", near-ties, divergences): a divergence at a reference gap below `tie` matches."""
    ok, ties, diverged = 0, [], []
    for req, res in zip(reqs, results, strict=True):
        if res.error:
            diverged.append(f"{req.id}: {res.reason}: {res.error}")
            continue
        got, exp = list(res.token_ids), want[req.id]
        if got == exp:
            ok += 1
            continue
        k = next((i for i, (a, b) in enumerate(zip(got, exp, strict=False)) if a != b), None)
        if k is None:
            diverged.append(f"{req.id}: {len(got)} tokens, generate() gave {len(exp)}")
            continue
        gap = tie_gap(model, req.prompt_token_ids, exp[:k])
        (ties if gap < tie else diverged).append(f"{req.id}@{k} gap {gap:.1e}")
        ok += gap < tie
    summary = f"{ok}/{len(reqs)} identical" + (f" ({len(ties)} at near-ties)" if ties else "")
    return summary, ties, diverged


def greedy_phase(report: Report, sizes: Sizes, device: torch.device, workdir: Path, seed: int, stop_at: float):
    """Every path against the same references; paths not started by `stop_at` are skipped (time
    left to the throughput phase)."""
    path = workdir / "greedy-model"
    params = build_random_llama(path, sizes.eq_shape, torch.float32, device, seed)
    reqs = mixed_requests(sizes.eq_requests, sizes.eq_max_prompt, sizes.eq_max_new, seed)
    report.data["greedy_setup"] = {
        "model": f"random Llama {params / 1e6:.0f}M ({shape_text(sizes.eq_shape)}), float32, seed {seed}",
        "requests": len(reqs),
        "reference": "per-request model.generate() (transformers SDPA), EOS ignored",
        "near_tie": NEAR_TIE,
        "kv_budget_tokens": sizes.eq_budget,
        "max_prefill_weight": sizes.eq_prefill,
        "why_float32": "bf16 batched and unbatched runs differ by rounding; exact equality is expected in float32",
    }
    paths: dict[str, str] = {}
    notes: dict[str, list[str]] = {}
    report.data["greedy"], report.data["greedy_notes"] = paths, notes
    model = load_reference(path, torch.float32, device)
    want = {r.id: reference_greedy(model, r.prompt_token_ids, r.params.max_new_tokens) for r in reqs}
    distinct = len({t for w in want.values() for t in w})
    report.data["greedy_setup"]["distinct_reference_tokens"] = distinct
    say(report, f"greedy: reference done ({distinct} distinct tokens)")
    compiles = compile_modes()  # compiled variants last: they take longest to start
    paged = [(b, {"attention": b, "runner": "paged"}) for b in attention_choices()]
    cases = [(b, {**kw, "compile": "off"} if "off" in compiles else kw) for b, kw in paged]
    cases.append(("padded", {"runner": "padded"}))
    if "on" in compiles:
        cases += [(f"{b}+compile", {**kw, "compile": "on"}) for b, kw in paged]
    for name, kw in cases:
        if time.monotonic() > stop_at:
            paths[name] = "skipped: time budget"
            continue
        if kw.get("attention") == "flash" and not flash_available():
            paths[name] = "skipped: " + ("flash-attn does not import" if device.type == "cuda" else "no CUDA")
            continue
        if kw.get("compile") == "on" and device.type == "cpu":
            paths[name] = "skipped: dry run (compiling takes ~30 s of a busy CPU; it runs on the device)"
            continue
        cfg = EngineConfig(
            model=str(path),
            device=device.type,
            dtype="float32",
            batcher=BatcherConfig(
                max_batch_weight=sizes.eq_budget,
                max_total_tokens=sizes.eq_max_prompt + sizes.eq_max_new,
                max_prefill_weight=sizes.eq_prefill,
            ),
            check_invariants=True,
            allow_download=False,
            **kw,
        )
        try:
            engine = Engine(cfg)
        except (ImportError, NotImplementedError, ValueError) as e:  # ConfigError is a ValueError
            paths[name] = f"unavailable: {e}"
            continue
        try:
            results = engine.generate(reqs)
        except Exception as e:
            paths[name] = f"error: {type(e).__name__}: {e}"
            report.error(f"greedy {name}", e)
            continue
        finally:
            del engine
            free_memory()
        paths[name], ties, diverged = compare(model, reqs, results, want, NEAR_TIE)
        if ties or diverged:
            notes[name] = [f"near-tie {t}" for t in ties] + [f"DIVERGED {d}" for d in diverged]
        say(report, f"greedy {name}: {paths[name]}")
    del model
    free_memory()
