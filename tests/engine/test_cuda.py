"""CUDA-only checks: the SDPA backend on a GPU, and the flash-attn paged backend.

Skipped on machines without CUDA (this project's CI has none); they run where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig
from weightq.engine.attention.flash import available as flash_available

from tests.reference import assert_greedy_equal, mixed_requests

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine")
flash = pytest.mark.skipif(not flash_available(), reason="needs CUDA and the flash-attn package (weightq[cuda])")
BF16_TIE = 5e-2  # bf16 logits are noisy: a divergence below this top1-top2 gap is a tie


@cuda
def test_sdpa_backend_on_cuda_matches_generate(tiny_path):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="sdpa").cuda().eval()
    engine = Engine(
        EngineConfig(
            device="cuda",
            dtype="float32",
            attention="sdpa",
            check_invariants=True,
            batcher=BatcherConfig(max_batch_weight=2048, max_total_tokens=672, max_prefill_weight=128),
        )
    )
    reqs = mixed_requests(24, seed=5)
    assert_greedy_equal(reference, reqs, engine.generate(reqs), tie=1e-3)


@flash
def test_flash_backend_matches_generate_in_bf16(tiny_path):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.bfloat16, attn_implementation="sdpa")
    reference = reference.cuda().eval()
    engine = Engine(
        EngineConfig(
            device="cuda",
            dtype="bfloat16",
            attention="flash",
            check_invariants=True,
            batcher=BatcherConfig(max_batch_weight=4096, max_total_tokens=672, max_prefill_weight=256),
        )
    )
    assert engine.backend == "flash" and engine.runner.cache.block_size == 256
    reqs = mixed_requests(24, seed=6)
    assert_greedy_equal(reference, reqs, engine.generate(reqs), tie=BF16_TIE)


@flash
def test_flash_is_chosen_automatically_on_cuda():
    engine = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=4096)))
    assert engine.backend == "flash"


@cuda
def test_padded_runner_on_cuda_matches_generate_and_measures_its_budget():
    """builtin:tiny-t5 on the padded runner on a GPU: greedy equality with per-request generate(),
    and a budget derived from the free CUDA memory with the warm-up's measured peak."""
    from tests.reference import assert_matches, reference, requests

    engine = Engine(EngineConfig(model="builtin:tiny-t5", device="cuda", dtype="float32", check_invariants=True))
    assert engine.lm.runner == "padded" and "peak" in engine.kv_derivation
    model = engine.lm.model
    reqs = requests(24, seed=2)
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        assert res.reason in ("length", "eos"), res.error
        assert_matches(model, req, list(res.token_ids), reference(model, req), tie=1e-3)


@cuda
def test_the_cuda_runner_overlaps_the_host_work_and_gives_the_same_tokens():
    """On CUDA forward() returns once the kernels are queued: the last step's text and events are made
    while they run (StepOutputs.finish_deferred), and the device time comes from CUDA events."""
    config = EngineConfig(
        device="cuda",
        dtype="float32",
        attention="sdpa",
        check_invariants=True,
        batcher=BatcherConfig(max_batch_weight=2048),
    )
    outputs = []
    for asynchronous in (True, False):
        engine = Engine(config)
        assert engine.runner.asynchronous
        engine.runner.asynchronous = asynchronous
        reqs = mixed_requests(16, seed=7)
        outputs.append([(f.token_ids, f.text, f.reason) for f in engine.generate(reqs)])
        assert engine.stats()["forward_s"] > 0
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "gpt_oss", "deepseek_v3_mla"])
@cuda
def test_window_softcap_sink_and_mla_families_on_cuda(name, tmp_path, tiny_path):
    """The families whose attention has variants, on a GPU: with flash-attn where it serves them (windows,
    soft-capping), else the SDPA backend (sinks, MLA: refused for flash at load), float32, against eager."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.families import build

    path = build(name, tmp_path / name, AutoTokenizer.from_pretrained(tiny_path))
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").cuda().eval()
    engine = Engine(
        EngineConfig(
            model=path,
            device="cuda",
            dtype="float32",
            check_invariants=True,
            batcher=BatcherConfig(max_batch_weight=8192, max_total_tokens=320, max_prefill_weight=256),
        )
    )
    if name in ("gpt_oss", "deepseek_v3_mla"):
        assert engine.backend == "sdpa"
    reqs = mixed_requests(12, seed=3, max_prompt=160, max_new=40)
    assert_greedy_equal(reference, reqs, engine.generate(reqs), tie=1e-3)


@flash
@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (100, 0.0), (-1, 30.0)])
def test_flash_attn_equals_its_stand_in_over_a_paged_pool(window, softcap):
    """The kernel against engine/attention/flash_reference.py on the same paged inputs (block size
    256, scattered pages, GQA, chunks over a prefix, decode rows): a difference here is the kernel's
    or the stand-in's reading of flash-attn, never our indexing (tests/engine/test_flash_reference.py)."""
    from flash_attn import flash_attn_varlen_func as kernel
    from weightq.engine.attention.flash_reference import flash_attn_varlen_func as stand_in

    gen = torch.Generator(device="cuda").manual_seed(7)
    heads, kv_heads, dim, block, pages = 8, 2, 64, 256, 24
    lens = [(1, 1), (1, 300), (40, 40), (64, 700), (200, 260)]
    kc = torch.randn(pages, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(pages, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(pages, device="cuda", generator=gen).tolist()
    nb = max(-(-k // block) for _, k in lens)
    table = []
    for _, k_len in lens:
        mine = [order.pop() for _ in range(-(-k_len // block))]
        table.append(mine + [0] * (nb - len(mine)))
    q = torch.randn(sum(a for a, _ in lens), heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor([a for a, _ in lens]).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor([b for _, b in lens]).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    args = (q, kc, vc, cu_q, cu_k, max(a for a, _ in lens), max(b for _, b in lens))
    kw = dict(causal=True, window_size=(window, 0), softcap=softcap,
              block_table=torch.tensor(table, dtype=torch.int32, device="cuda"))  # fmt: skip
    torch.testing.assert_close(kernel(*args, **kw).float(), stand_in(*args, **kw).float(), atol=2e-2, rtol=2e-2)
