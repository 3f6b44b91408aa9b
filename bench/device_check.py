"""The device check: one run on a lent GPU that says what this project does there, as one JSON object.

    bash bench/device_check.sh [--dry-run] [--out FILE]     (the wrapper picks the python, carried wheels)

A GPU is lent for minutes, by chance, so one prepared run must say everything and finish in under 8
minutes on one H200 (model builds and warm-ups included); --out is rewritten after every phase, so a
run cut off keeps what it measured. Phases, in order:

- flash_reference: the pure-torch stand-in of flash-attn's kernel (engine/attention/flash_reference.py)
  against SDPA, in seconds and on any machine, first: the flash path's indexing is checked before the
  GPU's minutes go to the real kernel (tests/engine/test_cuda.py compares that kernel with the stand-in).
- cuda_tests: `pytest tests/engine/test_cuda.py` in a subprocess (counts from its JUnit XML).
- greedy: per-request `model.generate()` against our engine on every path the engine offers there:
  each `EngineConfig.attention` choice (read at run time; "flash" only where flash-attn imports) on
  the paged runner, and the padded runner. float32 on a mid-size random Llama: batched and unbatched
  bf16 runs differ by design, so exact equality is checked where it is expected. A divergence at a
  reference near-tie (top1 - top2 < 1e-4, bench.engine's rule) counts as a match and is listed.
- throughput: a TinyLlama-shaped random Llama (1.1B, bf16) built there (nothing can be downloaded),
  saved with the built-in tokenizer and loaded by path; our engine against static padded batches of
  `generate()` (bench.engine.run_static16) and transformers' continuous batching (bench.engine.run_hf_cb:
  no CUDA graphs; also with transformers' defaults, graphs included, when time is left); greedy
  outputs of a few requests against `generate()` with the bf16 tie rule of tests/engine/test_cuda.py.

--dry-run runs the same code on CPU with a tiny shape and a few requests, skipping what needs CUDA
(tests/repo/test_device_check.py runs it). Random Llama weights use initializer_range 0.1 (engine/model/builtin.py):
at 0.02 greedy output collapses to a few repeated tokens and equality would mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch
from weightq.engine.attention.flash import available as flash_available

from .device_greedy import attention_choices, greedy_phase
from .device_report import DRY, ON_GPU, Report, say
from .device_throughput import throughput_phase

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("celery", "kombu", "redis", "fastapi", "uvicorn", "app", "tasks")  # engine/ must not need them


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


# ----- phase: the CUDA tests --------------------------------------------------------------------------
def flash_reference_tests(timeout_s: float) -> dict:
    """First, on any machine: the pure-torch stand-in of flash-attn's kernel against SDPA (seconds, no
    model), so that a lent GPU spends its minutes on the real kernel, not on our indexing."""
    return pytest_phase(["tests/engine/test_flash_reference.py", "-k", "stand_in or sees_nothing"], timeout_s)


def cuda_tests(timeout_s: float) -> dict:
    out = pytest_phase(["tests/engine/test_cuda.py"], timeout_s)
    if not torch.cuda.is_available() and "result" not in out:
        out["note"] = "skipped: no CUDA (each test needs a GPU)"
    return out


def pytest_phase(selection: list[str], timeout_s: float) -> dict:
    """pytest on `selection` in a subprocess: counts from its JUnit XML."""
    if importlib.util.find_spec("pytest") is None:
        return {"result": "pytest not available"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd = [*pytest, f"--junitxml={xml}", *selection]
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
    return out


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
    ap.add_argument("--skip-tests", action="store_true", help="leave out the pytest run of tests/engine/test_cuda.py")
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

    report.data["flash_reference"] = {"result": "running"}

    def reference() -> None:
        report.data["flash_reference"] = flash_reference_tests(max(min(120.0, left() - 300), 30.0))

    run_phase(report, "flash_reference", reference, left())
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
    for phase in ("flash_reference", "cuda_tests"):
        tests = report.data.get(phase, {})
        if tests.get("failed") or str(tests.get("result", "")).startswith("error"):
            report.error(phase, f"failures (see {phase})")
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
