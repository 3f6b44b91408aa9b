"""The compiled paged runner (EngineConfig.compile): same tokens as eager, no compiling after warm-up.

The rest of the suite runs eager (conftest sets TORCH_COMPILE_DISABLE=1, which torch reads once at
import, and its config is per thread), so the compiled tests run in a pytest process of their own:
`test_compiled_tests_in_their_own_process` starts it and they are skipped in the main one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

from engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from engine.decode_kernel import compile_paged_decode, paged_decode
from engine.setup import wants_compile
from tests.test_engine import assert_greedy_equal, mixed_requests

COMPILING = os.environ.get("WEIGHTQ_TEST_COMPILE") == "1"
compiling = pytest.mark.skipif(not COMPILING, reason="runs in its own process (see the module docstring)")


def test_compiled_tests_in_their_own_process():
    if COMPILING:
        pytest.skip("this is that process")
    env = {**os.environ, "WEIGHTQ_TEST_COMPILE": "1"}
    env.pop("TORCH_COMPILE_DISABLE", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@pytest.fixture(scope="module")
def compiled(tiny_loaded):
    cfg = EngineConfig(
        compile="on", max_batch_weight=2048, max_total_tokens=672, max_prefill_weight=128, check_invariants=True
    )
    return Engine(cfg, loaded=tiny_loaded)


@compiling
def test_the_compiled_engine_matches_generate_and_compiles_nothing_after_warm_up(compiled, reference_model):
    assert compiled.runner.compiled and compiled.warmup_s > 0
    graphs = counters["stats"]["unique_graphs"]
    reqs = mixed_requests(24, seed=3)  # chunked prompts, one-token steps, one- and many-row decode groups
    results = compiled.generate(reqs)
    assert not [r.error for r in results if r.reason == "error"]
    assert_greedy_equal(reference_model, reqs, results)
    assert counters["stats"]["unique_graphs"] == graphs, "a step shape was not covered by the warm-up"


def test_the_in_place_decode_kernel_equals_gather_and_sdpa():
    torch.manual_seed(0)
    blocks, block, kv_heads, heads, dim = 40, 4, 2, 6, 8
    k_pool, v_pool = torch.randn(blocks, block, kv_heads, dim), torch.randn(blocks, block, kv_heads, dim)
    lens = torch.tensor([1, 5, 16, 9])
    table = torch.randperm(blocks)[:16].view(4, 4)
    q = torch.randn(4, heads, dim)
    want = []
    for b in range(4):
        k = k_pool[table[b]].reshape(-1, kv_heads, dim)[: lens[b]].transpose(0, 1)
        v = v_pool[table[b]].reshape(-1, kv_heads, dim)[: lens[b]].transpose(0, 1)
        att = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], k, v, enable_gqa=True)
        want.append(att[:, 0])
    want = torch.stack(want)
    torch.testing.assert_close(paged_decode(q, k_pool, v_pool, table, lens, dim**-0.5), want)
    if COMPILING:
        kernel = compile_paged_decode()
        torch.testing.assert_close(kernel(q, k_pool, v_pool, table, lens, dim**-0.5), want)


def test_compile_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert wants_compile("on", cpu, "sdpa") and not wants_compile("off", cpu, "sdpa")
    assert not wants_compile("on", cuda, "flash")  # flash-attn's kernel is already fused
    assert not wants_compile("auto", cuda, "sdpa")  # not measured on a GPU: eager
    assert wants_compile("auto", cpu, "sdpa") == COMPILING  # TORCH_COMPILE_DISABLE=1 in the main process
    with pytest.raises(Exception, match="compile: must be auto, on or off"):
        wants_compile("yes", cpu, "sdpa")


def test_eager_engine_under_the_test_settings(tiny_loaded):
    if COMPILING:
        pytest.skip("the main process checks that tests run eager")
    engine = Engine(EngineConfig(max_batch_weight=2048), loaded=tiny_loaded)
    assert not engine.runner.compiled and engine.warmup_s == 0.0
    res = engine.generate([GenerationRequest("a", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=3))])
    assert len(res[0].token_ids) == 3
