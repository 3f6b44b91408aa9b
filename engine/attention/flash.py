"""The flash-attn backend (CUDA only): one varlen call over the paged pool per layer.

flash-attn's paged kernels want block_size a multiple of 256 and K/V pools shaped
[num_blocks, block_size, kv_heads, head_dim] — the layout of each KVCache pool. Causal masking is
aligned bottom-right, so a chunk with a prefix attends to the whole prefix. Sliding windows go to
its `window_size` (W - 1 keys before the query), soft-capping to `softcap`. It writes every new K/V
before attending, so a window kind's ring holds a whole chunk besides the window (kv_cache.py:
ring_blocks with the chunk's length); each kind's block table lists its pages in logical order (a
ring's block j is unit j mod R). Attention sinks and K/V of different head sizes have no flash-attn
kernel: probe.check_backend refuses them at load (attention=auto then picks the paged SDPA backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .meta import StepMeta
from .paged import write_kv

if TYPE_CHECKING:
    from ..runner.base import Work


BACKENDS = ("flash", "flash_reference")  # the flash path: flash-attn's kernel, or its stand-in


def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def add_varlen(meta: StepMeta, prefill: list[Work], decode: list[Work], bs: int, device: torch.device) -> None:
    """The varlen view of the step (cu_seqlens, max lengths) and one block table per kind and column."""
    works = prefill + decode
    q_lens = [w.n for w in works]
    k_lens = [w.start + w.n for w in works]
    nb = max(-(-k // bs) for k in k_lens)
    cu_q, cu_k = [0], [0]
    for q, k in zip(q_lens, k_lens, strict=True):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + k)
    meta.cu_q = torch.tensor(cu_q, dtype=torch.int32, device=device)
    meta.cu_k = torch.tensor(cu_k, dtype=torch.int32, device=device)
    meta.max_q, meta.max_k = max(q_lens), max(k_lens)
    layout = meta.cache.layout
    tables: list[list[torch.Tensor]] = []
    for k, kind in enumerate(layout.kinds):
        if kind.full:
            rows = [w.seq.block_table[:nb] + [0] * (nb - min(nb, len(w.seq.block_table))) for w in works]
            tables.append([torch.tensor(rows, dtype=torch.int32, device=device)])
            continue
        r = k - layout.has_full
        cols = []
        for g in range(kind.pages):
            # past a sequence's own blocks (its ring may hold fewer units than R): any page, the kernel
            # reads none of them (looking them up in the ring would index past its end)
            rows = [
                [w.seq.sched.rings[r][(j % kind.ring) * kind.pages + g] if j < -(-kl // bs) else 0 for j in range(nb)]
                for w, kl in zip(works, k_lens, strict=True)
            ]
            cols.append(torch.tensor(rows, dtype=torch.int32, device=device))
        tables.append(cols)
    meta.flash_tables = tables


def flash_paged_attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' attention interface, on flash-attn's kernel (CUDA)."""
    from flash_attn import flash_attn_varlen_func

    return attend_varlen(flash_attn_varlen_func, module, query, key, value, **kwargs)


def flash_reference_attention(module: torch.nn.Module, query, key, value, attention_mask, **kwargs):
    """The same on the pure-torch stand-in of that kernel (flash_reference.py): the flash path on any
    machine (`attention="flash_reference"`), for tests."""
    from .flash_reference import flash_attn_varlen_func

    return attend_varlen(flash_attn_varlen_func, module, query, key, value, **kwargs)


def attend_varlen(
    kernel,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
    weightq_meta: StepMeta | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Write the step's K/V, then one varlen call over the paged pool of the layer's kind."""
    meta = weightq_meta
    if meta is None or meta.cu_q is None:
        raise RuntimeError("flash paged attention called without varlen step metadata")
    kind_index, col, pool = meta.place[module.layer_idx]
    km = meta.kinds[kind_index]
    kc, vc = meta.cache.k[pool], meta.cache.v[pool]
    write_kv(kc, vc, km.slots[col], km.rows, key, value)
    window = (km.window - 1, 0) if km.window is not None else (-1, -1)
    out = kernel(
        query[0].transpose(0, 1),  # [T, H, D]
        kc,
        vc,
        cu_seqlens_q=meta.cu_q,
        cu_seqlens_k=meta.cu_k,
        max_seqlen_q=meta.max_q,
        max_seqlen_k=meta.max_k,
        softmax_scale=scaling,
        causal=True,
        window_size=window,
        softcap=float(softcap or 0.0),
        block_table=meta.flash_tables[kind_index][col],
    )
    return out.unsqueeze(0), None
