"""A worker keeps torch.compile's caches under WEIGHTQ_HOME (`use_compile_cache`): a later worker on the
same home finds its graphs instead of compiling them, and a damaged cache never stops a start."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from weightq.worker.boot import COMPILE_CACHE, TORCH_CACHE_ENV, use_compile_cache

# "compiled and warmed up in 3.1 s (compile cache: 1 graphs found, 0 compiled)", engine/loop/warmup.py
WARMED = re.compile(r"compile cache: (\d+) graphs found, (\d+) compiled")


def test_the_cache_goes_under_weightq_home(tmp_path, monkeypatch):
    monkeypatch.delenv(TORCH_CACHE_ENV, raising=False)
    used = use_compile_cache(tmp_path / "home")
    assert used == tmp_path / "home" / COMPILE_CACHE and used.is_dir()
    assert os.environ[TORCH_CACHE_ENV] == str(used)


def test_torchs_own_default_is_not_an_operators_choice(tmp_path, monkeypatch):
    monkeypatch.setenv(TORCH_CACHE_ENV, default_cache_dir())  # what importing the engine sets
    assert use_compile_cache(tmp_path) == tmp_path / COMPILE_CACHE
    assert os.environ[TORCH_CACHE_ENV] == str(tmp_path / COMPILE_CACHE)


def test_an_operators_cache_dir_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(TORCH_CACHE_ENV, str(tmp_path / "mine"))
    assert use_compile_cache(tmp_path / "home") == tmp_path / "mine"
    assert os.environ[TORCH_CACHE_ENV] == str(tmp_path / "mine")
    assert not (tmp_path / "home").exists()


def test_a_home_where_no_cache_can_be_made_leaves_torchs_default(tmp_path, monkeypatch, caplog):
    (tmp_path / "home").write_text("a file, not a directory")
    monkeypatch.setenv(TORCH_CACHE_ENV, default_cache_dir())
    assert use_compile_cache(tmp_path / "home") is None
    assert os.environ[TORCH_CACHE_ENV] == default_cache_dir()
    assert "cannot be created" in caplog.text


def warm_up_counts(log: str) -> tuple[int, int]:
    m = WARMED.search(log)
    assert m, log[-3000:]
    return int(m.group(1)), int(m.group(2))


def damage(cache: Path) -> int:
    """Every file of the cache overwritten with bytes no reader understands; how many there were."""
    files = [p for p in cache.rglob("*") if p.is_file()]
    for p in files:
        p.write_bytes(b"\x00garbage")
    return len(files)


@pytest.mark.service
def test_a_second_worker_reuses_the_compiled_graphs_and_a_damaged_cache_still_serves(service, tmp_path, monkeypatch):
    # the worker decides where the cache goes, as in a deployment (the engine's import set torch's default here)
    monkeypatch.delenv(TORCH_CACHE_ENV, raising=False)
    compiled = {"compile": "on", "torch_compile_disable": "0", "engine_process": "on"}
    outputs = []
    for i, expect in enumerate(("cold", "warm", "damaged")):
        if expect == "damaged":
            assert damage(tmp_path / COMPILE_CACHE) > 0
        w = service.worker(f"c{i}@test", **compiled).wait_ready(timeout=900)
        assert w.stats()["compiled"]
        job = service.client.submit("the cache holds", max_new_tokens=12, ignore_eos=True)
        outputs.append(job.result(timeout=300)["token_ids"])
        found, new = warm_up_counts(w.log())
        if expect == "cold":
            assert found == 0 and new > 0
            assert any(p.is_file() for p in (tmp_path / COMPILE_CACHE).rglob("*"))
        elif expect == "warm":
            assert found > 0 and new == 0, w.log()[-3000:]
        assert w.stop() == 0
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
