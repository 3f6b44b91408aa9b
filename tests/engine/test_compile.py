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
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.engine.attention import dense_attention
from weightq.engine.attention.decode_kernel import compile_paged_decode, paged_decode
from weightq.engine.builder import wants_compile

from tests.reference import assert_greedy_equal, mixed_requests

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
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@pytest.fixture(scope="module")
def compiled(tiny_loaded):
    cfg = EngineConfig(
        compile="on",
        check_invariants=True,
        batcher=BatcherConfig(max_batch_weight=2048, max_total_tokens=672, max_prefill_weight=128),
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


def _decode_case(heads: int, kv_heads: int, dim: int, lens: list[int], block: int = 4, seed: int = 0):
    """A random pool, a scattered block table, and the attention SDPA gives over each row's context."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-max(lens) // block)
    blocks = len(lens) * nb + 3
    k_pool = torch.randn(blocks, block, kv_heads, dim, generator=g)
    v_pool = torch.randn(blocks, block, kv_heads, dim, generator=g)
    table = torch.randperm(blocks, generator=g)[: len(lens) * nb].view(len(lens), nb)
    q = torch.randn(len(lens), heads, dim, generator=g)
    want = []
    for b, n in enumerate(lens):
        k = k_pool[table[b]].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        v = v_pool[table[b]].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        att = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], k, v, enable_gqa=True)
        want.append(att[:, 0])
    return (q, k_pool, v_pool, table, torch.tensor(lens), dim**-0.5), torch.stack(want)


def test_the_in_place_decode_kernels_equal_gather_and_sdpa():
    args, want = _decode_case(6, 2, 8, [1, 5, 16, 9])
    torch.testing.assert_close(paged_decode(*args), want)
    # the C++ kernel needs no dynamo: it is checked in the main (eager) process too. Head sizes are
    # multiples of 16, the widest vector of floats (AVX-512); the kernel refuses others (see below).
    for heads, kv_heads, dim, lens in ((6, 2, 16, [1, 5, 16, 9]), (8, 4, 32, [3, 200, 64, 17, 1]), (4, 4, 64, [33])):
        args, want = _decode_case(heads, kv_heads, dim, lens, seed=heads + dim)
        kernel = compile_paged_decode(heads, kv_heads, dim, torch.float32, torch.device("cpu"))
        assert kernel.name == "cpp" and kernel.ragged
        torch.testing.assert_close(kernel.fn(*args), want)
    if COMPILING:
        args, want = _decode_case(6, 2, 8, [1, 5, 16, 9])
        kernel = compile_paged_decode(6, 2, 8, torch.bfloat16, torch.device("cpu"))  # not float32: inductor's
        assert kernel.name == "inductor" and not kernel.ragged
        torch.testing.assert_close(kernel.fn(*args), want)


def _variant_case(heads, kv_heads, dim, dv, lens, starts, softcap, sinks, block=4, seed=0):
    """Like _decode_case, with a window's first position per row, soft-capping, sinks and a V size of its own;
    the reference is the eager path's dense_attention over each row's visible keys."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-max(lens) // block)
    blocks = len(lens) * nb + 3
    k_pool = torch.randn(blocks, block, kv_heads, dim, generator=g)
    v_pool = torch.randn(blocks, block, kv_heads, dv, generator=g)
    table = torch.randperm(blocks, generator=g)[: len(lens) * nb].view(len(lens), nb)
    q = torch.randn(len(lens), heads, dim, generator=g) * 3  # large scores: soft-capping matters
    sink = torch.randn(heads, generator=g) if sinks else None
    want = []
    for b, (n, s) in enumerate(zip(lens, starts, strict=True)):
        k = k_pool[table[b]].reshape(-1, kv_heads, dim)[s:n].transpose(0, 1)[None]
        v = v_pool[table[b]].reshape(-1, kv_heads, dv)[s:n].transpose(0, 1)[None]
        att = dense_attention(q[b][None, :, None], k, v, None, False, dim**-0.5, softcap, sink)
        want.append(att[0, :, 0])
    args = (q, k_pool, v_pool, table, torch.tensor(lens), dim**-0.5, torch.tensor(starts), softcap, sink)
    return args, torch.stack(want)


@pytest.mark.parametrize(
    "dim,dv,softcap,sinks",
    [(16, 16, None, False), (16, 16, 5.0, False), (16, 16, None, True), (32, 16, None, False), (16, 32, 2.0, True)],
)
def test_the_decode_kernels_honour_windows_softcap_sinks_and_v_sizes(dim, dv, softcap, sinks):
    lens, starts = [1, 5, 16, 9, 12], [0, 2, 9, 0, 11]
    args, want = _variant_case(6, 2, dim, dv, lens, starts, softcap, sinks, seed=dim + dv)
    torch.testing.assert_close(paged_decode(*args), want)
    kernel = compile_paged_decode(6, 2, dim, torch.float32, torch.device("cpu"), dv)
    assert kernel.name == "cpp"
    torch.testing.assert_close(kernel.fn(*args), want)
    if COMPILING:
        kernel = compile_paged_decode(6, 2, dim, torch.bfloat16, torch.device("cpu"), dv)
        torch.testing.assert_close(kernel.fn(*args), want)


def test_a_head_size_the_vector_width_does_not_divide_falls_back_to_the_inductor_kernel(caplog):
    kernel = compile_paged_decode(2, 1, 3, torch.float32, torch.device("cpu"))
    assert kernel.name == "inductor" and "C++ decode kernel unavailable" in caplog.text
    if COMPILING:
        args, want = _decode_case(2, 1, 3, [2, 7])
        torch.testing.assert_close(kernel.fn(*args), want)


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
    engine = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=2048)), loaded=tiny_loaded)
    assert not engine.runner.compiled and engine.warmup_s == 0.0
    res = engine.generate([GenerationRequest("a", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=3))])
    assert len(res[0].token_ids) == 3


@compiling
def test_adapters_mixed_in_a_compiled_step_equal_peft_merged(tiny_path, tmp_path):
    """The LoRA delta is an opaque op in the compiled graph (engine/lora/layers.py): a step's mix of
    adapters changes no graph, and the outputs equal PEFT's merged models."""
    from tests.engine.test_lora import check_mixed_batch, make_adapters

    check_mixed_batch(tiny_path, make_adapters(tiny_path, tmp_path), "on")
