"""The device check: one run on a lent GPU that says what this project does there, as one JSON object.

    bash bench/device_check.sh [--dry-run] [--out FILE]     (the wrapper picks the python, carried wheels)

A GPU is lent for minutes, by chance, so one prepared run must say everything and finish in under 8
minutes on one H200 (model builds and warm-ups included); --out is rewritten after every phase, so a
run cut off keeps what it measured. Phases, in order:

- cuda_tests: `pytest tests/test_cuda.py` in a subprocess (counts from its JUnit XML).
- greedy: per-request `model.generate()` against our engine on every path the engine offers there:
  each `EngineConfig.attention` choice (read at run time; "flash" only where flash-attn imports) on
  the paged runner, and the padded runner. float32 on a mid-size random Llama: batched and unbatched
  bf16 runs differ by design, so exact equality is checked where it is expected. A divergence at a
  reference near-tie (top1 - top2 < 1e-4, bench.engine's rule) counts as a match and is listed.
- throughput: a TinyLlama-shaped random Llama (1.1B, bf16) built there (nothing can be downloaded),
  saved with the built-in tokenizer and loaded by path; our engine against static padded batches of
  `generate()` (bench.engine.run_static16) and transformers' continuous batching (bench.engine.run_hf_cb:
  no CUDA graphs; also with transformers' defaults, graphs included, when time is left); greedy
  outputs of a few requests against `generate()` with the bf16 tie rule of tests/test_cuda.py.

--dry-run runs the same code on CPU with a tiny shape and a few requests, skipping what needs CUDA
(tests/test_device_check.py runs it). Random Llama weights use initializer_range 0.1 (engine/builtin.py):
at 0.02 greedy output collapses to a few repeated tokens and equality would mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import typing
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.device_models import MID, TINY, TINYLLAMA, build_random_llama, free_memory, load_reference, shape_text, sync
from bench.engine import NEAR_TIE, hf_cb_config, no_eos, requests
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from engine.flash import available as flash_available

ROOT = Path(__file__).resolve().parents[1]
BF16_TIE = 5e-2  # tests/test_cuda.py: bf16 logits are noisy; a divergence below this gap is a tie
FORBIDDEN = ("celery", "kombu", "redis", "fastapi", "uvicorn", "app", "tasks")  # engine/ must not need them


@dataclass(frozen=True, slots=True)
class Sizes:
    eq_shape: dict
    eq_requests: int
    eq_max_prompt: int
    eq_max_new: int
    eq_budget: int  # KV tokens: tight enough that requests queue and prompts are chunked
    eq_prefill: int
    tp_shape: dict
    tp_dtype: str
    tp_requests: int
    tp_prompt: tuple[int, int]
    tp_new: tuple[int, int]
    tp_check: int  # requests of the throughput run compared with generate()
    static_batch: int


ON_GPU = Sizes(MID, 32, 512, 160, 4096, 256, TINYLLAMA, "bfloat16", 128, (16, 512), (16, 256), 8, 16)
DRY = Sizes(TINY, 6, 48, 16, 256, 32, TINY, "float32", 8, (8, 48), (4, 16), 8, 4)


class Report:
    """The JSON object, rewritten to --out after every phase so that a run cut off keeps its results."""

    def __init__(self, out: Path | None) -> None:
        self.t0 = time.monotonic()
        self.out = out
        self.data: dict = {"complete": False, "errors": [], "phases_s": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def error(self, where: str, e: BaseException | str) -> None:
        text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
        self.data["errors"].append(f"{where}: {text}"[:2000])

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        if self.out is not None:
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(self.dumps(indent=2) + "\n")
            tmp.replace(self.out)

    def dumps(self, indent: int | None = None) -> str:
        for _ in range(5):  # a phase abandoned on timeout may still be adding to it
            try:
                return json.dumps(self.data, indent=indent)
            except RuntimeError:
                time.sleep(0.05)
        return json.dumps(self.data, indent=indent)


def say(report: Report, msg: str) -> None:
    print(f"[device_check {report.elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)


def versions() -> dict:
    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    import transformers

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "tokenizers": dist("tokenizers"),
        "triton": dist("triton"),
        "flash_attn": dist("flash-attn") if flash_available() else "not importable with CUDA",
        "carried_wheels": [w for w in os.environ.get("DEVICE_CHECK_WHEELS", "").split(",") if w],
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["device"] = props.name
        out["capability"] = f"{props.major}.{props.minor}"
        out["memory_gib"] = round(props.total_memory / 2**30, 1)
    else:
        out["device"] = f"cpu ({os.cpu_count()} cores)"
    return out


def transformers_pin():
    """The SpecifierSet pyproject.toml pins transformers to (the engine hooks its internals), or None."""
    import tomllib

    from packaging.requirements import Requirement

    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(dep)
        if req.name == "transformers":
            return req.specifier
    return None


def attention_choices() -> list[str]:
    """The attention backends EngineConfig offers (its Literal), "auto" aside: read, not hard-coded."""
    hint = typing.get_type_hints(EngineConfig)["attention"]
    return [a for a in typing.get_args(hint) if a != "auto"]


def compile_modes() -> list[str]:
    """EngineConfig.compile's choices where the engine has that option (torch.compile of the paged
    runner's hot path), else none."""
    hints = typing.get_type_hints(EngineConfig)
    return list(typing.get_args(hints["compile"])) if "compile" in hints else []


# ----- phase: the CUDA tests --------------------------------------------------------------------------
def cuda_tests(timeout_s: float) -> dict:
    if importlib.util.find_spec("pytest") is None:
        return {"result": "pytest not available"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd = [*pytest, f"--junitxml={xml}", "tests/test_cuda.py"]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"result": f"error: timed out after {timeout_s:.0f}s"}
        tail = (proc.stdout + proc.stderr)[-1500:]
        if not xml.exists():
            return {"result": f"error: pytest exited {proc.returncode} without a report", "tail": tail}
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        failed: list[str] = []
        root = ET.parse(xml).getroot()
        for suite in root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failed.append(case.get("name", "?"))
    bad = counts["failures"] + counts["errors"]
    out: dict = {"passed": counts["tests"] - bad - counts["skipped"], "failed": bad, "skipped": counts["skipped"]}
    if failed:
        out["failed_tests"] = failed
        out["tail"] = tail
    if not torch.cuda.is_available():
        out["note"] = "skipped: no CUDA (each test needs a GPU)"
    return out


# ----- greedy equality ---------------------------------------------------------------------------------
def mixed_requests(n: int, max_prompt: int, max_new: int, seed: int) -> list[GenerationRequest]:
    """tests/test_engine.py's mix (1- and 2-token prompts, full-length ones, 1 new token, the most) with
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
            max_batch_weight=sizes.eq_budget,
            max_total_tokens=sizes.eq_max_prompt + sizes.eq_max_new,
            max_prefill_weight=sizes.eq_prefill,
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
        max_batch_weight=budget,
        max_total_tokens=sizes.tp_prompt[1] + sizes.tp_new[1],
        max_prefill_weight=2048,
        allow_download=False,
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


# ----- driver ---------------------------------------------------------------------------------------------
def run_phase(report: Report, name: str, fn: Callable[[], None], timeout_s: float) -> bool:
    """Run one phase on a daemon thread; False when it outlived `timeout_s` (it is then abandoned)."""
    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            fn()
        except BaseException as e:
            box["error"] = e
            traceback.print_exc(file=sys.stderr)

    say(report, f"{name}: start ({timeout_s:.0f}s at most)")
    t0 = time.monotonic()
    thread = threading.Thread(target=target, name=f"device-check-{name}", daemon=True)
    thread.start()
    thread.join(max(timeout_s, 1.0))
    report.data["phases_s"][name] = round(time.monotonic() - t0, 1)
    if thread.is_alive():
        report.error(name, f"timed out after {timeout_s:.0f}s; later phases skipped")
        report.save()
        return False
    if "error" in box:
        report.error(name, box["error"])
    report.save()
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the device check: CUDA tests, greedy equality, throughput (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, a few requests (< 60 s)")
    ap.add_argument("--out", type=Path, help="also write the JSON here, rewritten after every phase")
    ap.add_argument("--budget-s", type=float, default=None, help="time for everything (default 420 on a GPU, 300 dry)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-tests", action="store_true", help="leave out the pytest run of tests/test_cuda.py")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    report = Report(args.out)
    # What importing engine/ and batcher/ loaded (this module imports them first). Checked here, not
    # at the end: torch.compile's inductor imports redis itself when it is installed.
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN))
    report.data["forbidden_imports"] = loaded
    if loaded:
        report.error("layering", f"importing engine and batcher loaded {loaded}")
    cuda = torch.cuda.is_available()
    budget_s = args.budget_s or (300.0 if args.dry_run else 420.0)
    deadline = time.monotonic() + budget_s
    report.data.update(mode="dry-run" if args.dry_run else "device", budget_s=budget_s, **versions())
    report.data["attention_backends"] = attention_choices()
    pin = transformers_pin()
    if pin and not pin.contains(report.data["transformers"], prereleases=True):
        # seen with 5.17: the padded runner diverges and transformers' batching API differs
        report.error(
            "setup", f"transformers {report.data['transformers']} is not the project's {pin}: carry the wheels"
        )
    if not cuda and not args.dry_run:
        report.error("setup", "no CUDA device here: run with --dry-run")
        return finish(report, 2)
    device = torch.device("cuda" if cuda and not args.dry_run else "cpu")
    sizes = DRY if args.dry_run else ON_GPU
    if args.dry_run:
        torch.set_num_threads(1)  # steady on a busy 2-core machine, where 2 threads wait on each other
        report.data["dry_run"] = "CPU, tiny shapes, a few requests: checks that the script works, not the device"

    def left() -> float:
        return deadline - time.monotonic()

    if args.skip_tests:
        report.data["cuda_tests"] = {"result": "skipped: --skip-tests"}
    else:
        report.data["cuda_tests"] = {"result": "running"}

        def tests() -> None:
            report.data["cuda_tests"] = cuda_tests(max(min(300.0, left() - 240), 60.0))

        run_phase(report, "cuda_tests", tests, left())
    work = Path(tempfile.mkdtemp(prefix="weightq-device-check-"))  # models: 2.2 GB on the GPU run
    try:
        reserve = 0.45 * budget_s  # the throughput phase's share (~150 s on an H200)
        greedy = lambda: greedy_phase(report, sizes, device, work, args.seed, deadline - reserve)  # noqa: E731
        alive = run_phase(report, "greedy", greedy, left() - reserve + 60)
        if alive:
            throughput = lambda: throughput_phase(report, sizes, device, work, args.seed, deadline)  # noqa: E731
            alive = run_phase(report, "throughput", throughput, left())
        else:
            report.data["throughput"] = {"result": "skipped: an earlier phase timed out"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # a phase that timed out still runs on its thread: report and leave without waiting for it
    return finish(report, 0) if alive else finish(report, 1, hard=True)


def finish(report: Report, code: int, hard: bool = False) -> int:
    greedy = report.data.setdefault("greedy", {})
    bad_paths = [p for p, v in greedy.items() if not (v.startswith("skipped") or v.startswith("unavailable"))]
    bad_paths = [p for p in bad_paths if not v_identical(greedy[p])]
    if bad_paths:
        report.error("greedy", f"outputs differ from generate() on {bad_paths}")
    tests = report.data.get("cuda_tests", {})
    if tests.get("failed") or str(tests.get("result", "")).startswith("error"):
        report.error("cuda_tests", "failures (see cuda_tests)")
    report.data["complete"] = not hard
    report.save()
    print(report.dumps(), flush=True)
    code = code or (1 if report.data["errors"] else 0)
    if hard:
        sys.stderr.flush()
        os._exit(code)
    return code


def v_identical(summary: str) -> bool:
    """'k/n identical ...' with k == n."""
    head = summary.split(" ", 1)[0]
    k, _, n = head.partition("/")
    return summary.split(" ")[1:2] == ["identical"] and k == n and k.isdigit()


if __name__ == "__main__":
    sys.exit(main())
