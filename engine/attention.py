"""Paged attention behind transformers' attention interface.

The model runs as usual; every attention layer calls `paged_attention(module, q, k, v, ...)` with
the `StepMeta` the runner built once for the step (passed through the model's **kwargs as
`weightq_meta`). Each layer writes its new K/V into the block pool at the step's slots, then
attends: decoding sequences (one query each) in one batched SDPA call over their gathered blocks
(compiled runner: a kernel reading the pool in place, engine/decode_kernel.py), prompt chunks one
SDPA call each (few per step). The flash-attn backend (flash.py) replaces both
with one varlen call over the block table.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .decode_kernel import Kernel
from .kv_cache import KVCache

ATTN_NAME = "weightq_paged"


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # position of the chunk in the packed row
    q_len: int
    k_len: int  # tokens of context after this chunk (prefix + chunk)
    blocks: torch.Tensor | None  # the sequence's blocks, when there is a prefix to read back
    mask: torch.Tensor | None  # [q_len, k_len] causal mask offset by the prefix


@dataclass(slots=True)
class DecodeGroup:
    q_idx: torch.Tensor  # [B] positions of the decode tokens in the packed row
    blocks: torch.Tensor  # [B * nb] block ids, each row padded to nb blocks
    nb: int
    mask: torch.Tensor | None  # [B, 1, 1, nb * block_size], None when every row uses all its slots
    lens: torch.Tensor  # [B] context length of each row (the compiled kernel masks with it)


@dataclass(slots=True)
class StepMeta:
    """Everything attention needs for one step, built once and shared by all layers."""

    cache: KVCache
    slots: torch.Tensor  # [T] flat slot of each packed token
    num_tokens: int
    decode: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # flash-attn varlen view of the same step (built only for that backend)
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    block_table: torch.Tensor | None = None
    # the compiled in-place decode kernel (engine/decode_kernel.py), None for the eager gather + SDPA
    decode_kernel: Kernel | None = None


def write_kv(meta: StepMeta, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's K/V ([1, Hkv, T, D]) at their slots; returns the layer's pools."""
    kc, vc = meta.cache.k[layer], meta.cache.v[layer]
    hkv, dim = kc.shape[2], kc.shape[3]
    kc.view(-1, hkv, dim).index_copy_(0, meta.slots, key[0].transpose(0, 1))
    vc.view(-1, hkv, dim).index_copy_(0, meta.slots, value[0].transpose(0, 1))
    return kc, vc


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    weightq_meta: StepMeta | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if weightq_meta is None:  # a compiled forward: the metadata is the runner's step context (see step_context)
        return torch.ops.weightq.paged_attention(query, key, value, module.layer_idx, scale), None
    return attend(weightq_meta, module.layer_idx, query, key, value, scale), None


def attend(
    meta: StepMeta, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Write the step's K/V into the pool, then attend: [1, H, T, D] queries -> [1, T, H, D]."""
    kc, vc = write_kv(meta, layer, key, value)
    heads, dim = query.shape[1], query.shape[3]
    gqa = heads != key.shape[1]
    q = query[0]  # [H, T, D]
    out = query.new_empty(meta.num_tokens, heads, dim)
    for dec in meta.decode:
        if meta.decode_kernel is not None:
            qd = q.index_select(1, dec.q_idx).transpose(0, 1)  # [B, H, D]
            o = meta.decode_kernel(qd, kc, vc, dec.blocks.view(-1, dec.nb), dec.lens, scale)
            out.index_copy_(0, dec.q_idx, o)
            continue
        bsz = dec.q_idx.numel()
        hkv = kc.shape[2]
        kd = kc.index_select(0, dec.blocks).view(bsz, -1, hkv, dim).transpose(1, 2)
        vd = vc.index_select(0, dec.blocks).view(bsz, -1, hkv, dim).transpose(1, 2)
        qd = q.index_select(1, dec.q_idx).transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=dec.mask, scale=scale, enable_gqa=gqa)
        out.index_copy_(0, dec.q_idx, o.squeeze(2))
    for p in meta.prefills:
        s, n = p.q_start, p.q_len
        qp = q[:, s : s + n].unsqueeze(0)
        if p.blocks is None:  # a whole prompt: its K/V are the ones just computed
            kp, vp = key[:, :, s : s + n], value[:, :, s : s + n]
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=n > 1, scale=scale, enable_gqa=gqa)
        else:
            hkv = kc.shape[2]
            kp = kc.index_select(0, p.blocks).view(1, -1, hkv, dim)[:, : p.k_len].transpose(1, 2)
            vp = vc.index_select(0, p.blocks).view(1, -1, hkv, dim)[:, : p.k_len].transpose(1, 2)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=gqa)
        out[s : s + n] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


# A compiled graph cannot carry the step's Python metadata, so under torch.compile attention is one
# opaque op per layer that finds the metadata here: set by the runner around each forward, per thread.
_step = threading.local()


@contextmanager
def step_context(meta: StepMeta) -> Iterator[None]:
    _step.meta = meta
    try:
        yield
    finally:
        _step.meta = None


@torch.library.custom_op("weightq::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    meta = getattr(_step, "meta", None)
    if meta is None:
        raise RuntimeError("weightq paged attention called outside a step (use the engine's runner)")
    return attend(meta, layer, query, key, value, scale)


@_paged_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def register(backend: str = "sdpa") -> str:
    """Register the chosen backend under our attention name; returns the name to load models with."""
    if backend == "flash":
        from .flash import flash_paged_attention

        AttentionInterface.register(ATTN_NAME, flash_paged_attention)
    else:
        AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
