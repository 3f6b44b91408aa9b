"""The flash path on the CPU (issue 42): flash_reference.py, a pure-torch stand-in with flash-attn's
varlen signature and semantics, checked against SDPA on random inputs; then the engine run through
flash.py (its varlen metadata, block tables per kind and column, K/V written before attention) with
that stand-in, on the family matrix, compared with generate(): full attention, sliding windows,
soft-capping, GQA and MQA, prefix-cache hits across a window, and preemption mid-prompt and mid-decode.
A GPU's first run then tests the kernel alone (tests/engine/test_cuda.py)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from weightq.engine import GenerationRequest, SamplingParams
from weightq.engine.attention.flash_reference import flash_attn_varlen_func

from tests.engine.test_model_families import (  # noqa: F401
    engine_for,
    family_dirs,
    prefix_waves,
    reference_of,
    tokenizer,
)  # fmt: skip
from tests.reference import assert_greedy_equal, mixed_requests


def sdpa_one(q, k, v, q_len, k_len, window, softcap, scale):
    """One sequence by plain algebra on [T, H, D] (the reference: SDPA-style masks, bottom-right causal)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(q_len)[:, None] + k_len - q_len
    key = torch.arange(k_len)[None, :]
    ok = key <= pos
    if window >= 0:
        ok &= key >= pos - window
    scores = scores.masked_fill(~ok, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1).nan_to_num(0.0), v)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (7, 0.0), (-1, 5.0), (11, 3.0)])
def test_the_stand_in_equals_sdpa_over_a_paged_pool(kv_heads, window, softcap):
    gen = torch.Generator().manual_seed(kv_heads * 100 + window + int(softcap))
    heads, dim, block, pages = 4, 16, 8, 40
    lens = [(1, 1), (5, 5), (3, 20), (1, 33), (17, 17), (9, 40)]  # (queries, keys): decode, prompt, chunk
    kc = torch.randn(pages, block, kv_heads, dim, generator=gen)
    vc = torch.randn(pages, block, kv_heads, dim, generator=gen)
    perm = torch.randperm(pages, generator=gen).tolist()  # each sequence's pages, scattered over the pool
    nb = max(-(-k // block) for _, k in lens)
    table, rows = [], []
    for _, k_len in lens:
        mine = [perm.pop() for _ in range(-(-k_len // block))]
        table.append(mine + [0] * (nb - len(mine)))
    q = torch.randn(sum(ql for ql, _ in lens), heads, dim, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor([ql for ql, _ in lens]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor([kl for _, kl in lens]).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attn_varlen_func(
        q, kc, vc, cu_q, cu_k, max(ql for ql, _ in lens), max(kl for _, kl in lens), softmax_scale=0.3,
        causal=True, window_size=(window, 0), softcap=softcap, block_table=torch.tensor(table, dtype=torch.int32),
    )  # fmt: skip
    for i, (q_len, k_len) in enumerate(lens):
        pos = torch.arange(k_len)
        pages_i = torch.tensor(table[i])[pos // block]
        k, v = kc[pages_i, pos % block], vc[pages_i, pos % block]
        rows.append(sdpa_one(q[cu_q[i] : cu_q[i + 1]], k, v, q_len, k_len, window, softcap, 0.3))
    torch.testing.assert_close(out, torch.cat(rows), atol=1e-5, rtol=1e-5)


def test_without_a_window_it_is_torch_sdpa_and_a_row_that_sees_nothing_is_zero():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(out, want.transpose(0, 1), atol=1e-5, rtol=1e-5)
    # 4 queries over 2 keys, aligned bottom-right: the first two queries see no key
    cu_k = torch.tensor([0, 2], dtype=torch.int32)
    blind = flash_attn_varlen_func(
        q[:4], k[:2], v[:2], torch.tensor([0, 4], dtype=torch.int32), cu_k, 4, 2, causal=True
    )
    assert blind[:2].abs().sum() == 0 and blind[2:].abs().sum() > 0


# full and GQA, windows (all layers, and mixed with full ones), soft-capping, MQA, a refused-by-flash model
FLASH_FAMILIES = ["llama3", "mistral", "qwen2", "gemma2", "gemma3", "gpt_bigcode_mqa", "phi3"]


@pytest.mark.parametrize("name", FLASH_FAMILIES)
def test_the_flash_path_equals_generate(name, family_dirs):  # noqa: F811
    path = family_dirs(name)
    engine = engine_for(path, attention="flash_reference", block_size=16)
    assert engine.backend == "flash_reference"
    reqs = mixed_requests(8, seed=3, max_prompt=160, max_new=40)
    results = engine.generate(reqs)
    assert all(r.error is None for r in results), [r.error for r in results]
    assert_greedy_equal(reference_of(path), reqs, results)
    assert engine.batcher.ledger.used == 0


def test_the_flash_path_keeps_prefix_hits_across_a_window_and_preemption_exact(family_dirs):  # noqa: F811
    path = family_dirs("gemma3")
    reference = reference_of(path)
    engine = engine_for(path, attention="flash_reference", block_size=16, max_batch_weight=2048)
    prefix_waves(engine, reference)
    rng = random.Random(9)
    reqs = [
        GenerationRequest(f"p{i}", prompt_token_ids=[rng.randrange(10, 1100) for _ in range(n)],
                          params=SamplingParams(max_new_tokens=30))
        for i, n in enumerate([150, 120, 30])
    ]  # fmt: skip
    handles = [engine.submit(r) for r in reqs]
    requeued = set()
    while any(h.final is None for h in handles):
        engine.step()
        running = engine.batcher.running
        if "p0" not in requeued and (r := running.get("p0")) is not None and 0 < r.prefilled < 150:
            engine.batcher.requeue("p0")
            requeued.add("p0")
        if "p2" not in requeued and (r := running.get("p2")) is not None and r.generated > 10:
            engine.batcher.requeue("p2")
            requeued.add("p2")
    assert requeued == {"p0", "p2"}
    assert_greedy_equal(reference, reqs, [h.final for h in handles])
