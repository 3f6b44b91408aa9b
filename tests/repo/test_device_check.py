"""bench/device_check.sh --dry-run: the GPU check's script, run here on CPU so that it is known to work
before a GPU is lent (its CUDA parts report themselves skipped)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_dry_run_prints_a_clean_report(tmp_path):
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        # ~40 s here; the generous budget keeps its time guards out of the way on a loaded machine
        ["bash", "bench/device_check.sh", "--dry-run", "--budget-s", "600", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == json.loads(out.read_text())
    assert report["errors"] == [] and report["complete"] and report["mode"] == "dry-run"
    assert report["forbidden_imports"] == []
    for key in ("device", "torch", "transformers", "attention_backends", "cuda_tests", "elapsed_s"):
        assert key in report, key

    tests = report["cuda_tests"]
    assert tests["failed"] == 0 and tests["passed"] + tests["skipped"] > 0, tests

    greedy = report["greedy"]
    assert "sdpa" in greedy and "padded" in greedy and greedy["flash"] == "skipped: no CUDA"
    ran = {path: v for path, v in greedy.items() if not v.startswith(("skipped", "unavailable"))}
    assert {"sdpa", "padded"} <= ran.keys()
    for path, summary in ran.items():
        m = re.fullmatch(r"(\d+)/(\d+) identical.*", summary)
        assert m and m[1] == m[2] and int(m[2]) == report["greedy_setup"]["requests"], (path, summary)

    tp = report["throughput"]
    for key in ("weightq_tok_s", "hf_generate_tok_s", "hf_cb_tok_s", "ratio_vs_hf_generate", "ratio_vs_hf_cb"):
        assert isinstance(tp[key], int | float) and tp[key] > 0, (key, tp[key])
    assert tp["greedy_check"]["divergences"] == []
