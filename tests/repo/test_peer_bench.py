"""bench.peer without its peer: it must say how to make vLLM's venv and fail, and its bookkeeping must add up.

The comparison itself needs vLLM's CPU build (`make peer`) and minutes of CPU: it never runs in the test suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer import (
    MAX_MODEL_LEN,
    first_divergence,
    kv_groups,
    medians,
    parse_cases,
    parse_overrides,
    peer_python,
    tally,
    whole_workload_kv,
)

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.peer", "--json", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize("how", ["option", "env"])
def test_without_the_peer_venv_it_says_make_peer_and_fails(tmp_path, how):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    done = _run("--peer-python", missing) if how == "option" else _run(env={"WEIGHTQ_PEER_PYTHON": missing})
    assert done.returncode != 0
    assert "make peer" in done.stderr
    assert missing in done.stderr
    assert done.stdout == ""  # no half a report on stdout


def test_a_python_without_vllm_is_no_peer():
    done = _run("--peer-python", sys.executable)
    assert done.returncode != 0
    assert "has no vllm" in done.stderr and "make peer" in done.stderr


def test_peer_python_prefers_the_option_then_the_env(monkeypatch):
    monkeypatch.setenv("WEIGHTQ_PEER_PYTHON", "/from/env")
    assert peer_python("/from/option") == Path("/from/option")
    assert peer_python(None) == Path("/from/env")
    monkeypatch.delenv("WEIGHTQ_PEER_PYTHON")
    assert peer_python(None) == REPO / ".venv-peer" / "bin" / "python"


def test_parse_cases():
    assert parse_cases("64,256,1024,256@4096") == [(64, None), (256, None), (1024, None), (256, 4096)]
    assert parse_cases(" 8 , ") == [(8, None)]
    for bad in ("", "0", "64@x", f"64@{MAX_MODEL_LEN - 1}"):
        with pytest.raises(ValueError):
            parse_cases(bad)


def test_kv_groups_share_the_largest_whole_workload_capacity():
    groups = kv_groups(parse_cases("64,256,1024,256@4096"))
    assert groups == [(1024 * (256 + 128), [64, 256, 1024]), (4096, [256])]
    assert whole_workload_kv(1) == MAX_MODEL_LEN  # vLLM needs room for one max_model_len request


def test_parse_overrides_decodes_json_values_and_rejects_unknown_keys():
    got = parse_overrides(["max_prefill_weight=1024", "mode=predictive", "enforce_eager=true", "x=null"])
    assert got == {"max_prefill_weight": 1024, "mode": "predictive", "enforce_eager": True, "x": None}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_overrides(["novalue"])
    with pytest.raises(ValueError, match="unknown key"):
        parse_overrides(["typo=1"], allowed={"mode"})


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early


def test_medians_and_ratio():
    assert medians([100.0, 300.0, 200.0], [50.0, 100.0, 400.0]) == (200.0, 100.0, 2.0)


def test_tally_counts_near_ties_as_matches_and_lists_both():
    got = tally(64, [(3, 17, 2e-5), (9, 4, 0.5)], near_tie=1e-4)
    assert got["identical"] == "63/64"
    assert got["near_ties"] == ["request 3 token 17: gap 2.0e-05"]
    assert got["mismatches"] == ["request 9 token 4: gap 5.0e-01"]
    assert tally(8, [], 1e-4) == {"identical": "8/8", "near_ties": [], "mismatches": []}
