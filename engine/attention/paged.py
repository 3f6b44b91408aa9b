"""Paged attention behind transformers' attention interface (the default backend, any device).

The model runs as usual; every attention layer calls `paged_attention(module, q, k, v, ...)` with
the `StepMeta` the runner built once for the step (passed through the model's **kwargs as
`weightq_meta`). Each layer writes its new K/V into its pool at the step's slots, then attends:
decoding sequences (one query each) in one batched call over their gathered pages (compiled runner:
a kernel reading the pool in place, decode_kernel.py), prompt chunks one call each.

Every variant transformers passes through the interface is honoured (engine/attention/probe.py
refuses the rest at load): per-layer sliding windows (a query at q sees keys in (q - W, q]),
logit soft-capping (`softcap`: tanh(s / c) * c before the softmax, Gemma 2), attention sinks
(`s_aux`: one logit per head that joins the softmax's denominator, gpt-oss), and K and V of
different head sizes (MLA as transformers runs it). Window layers keep a ring of blocks
(kv_cache.py): a decode row is written before it attends (the slot it overwrites is out of its
window), a prompt chunk reads its prefix from the ring and its own keys as computed, and writes its
last window afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .meta import DecodeGroup, KindMeta, PrefillChunk, StepMeta


def write_kv(kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None, key, value) -> None:
    """Store rows of this step's K/V ([1, Hkv, T, D]) at their slots of one pool."""
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    kc.view(-1, kc.shape[2], kc.shape[3]).index_copy_(0, slots, k)
    vc.view(-1, vc.shape[2], vc.shape[3]).index_copy_(0, slots, v)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv]; mask [.., Tq, Tk] True where visible.
    SDPA when it can; soft-capping and sinks need the scores, so those run as plain algebra (the
    softmax in float32, as transformers' eager reference does)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        tq, tk = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        b, h, tq, _ = scores.shape
        sink = sinks.float().view(1, h, 1, 1).expand(b, h, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    weightq_meta: StepMeta | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if weightq_meta is None:  # a compiled forward: the metadata is the runner's step context (see step_context)
        cap = float(softcap) if softcap else 0.0
        return torch.ops.weightq.paged_attention(query, key, value, module.layer_idx, scale, cap, s_aux), None
    return attend(weightq_meta, module.layer_idx, query, key, value, scale, softcap, s_aux), None


def attend(
    meta: StepMeta,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the step's K/V into the layer's pool, then attend: [1, H, T, D] queries -> [1, T, H, Dv]."""
    kind_index, col, pool = meta.place[layer]
    km = meta.kinds[kind_index]
    kc, vc = meta.cache.k[pool], meta.cache.v[pool]
    if km.slots[col].numel():
        write_kv(kc, vc, km.slots[col], km.rows, key, value)
    heads, dv = query.shape[1], value.shape[3]
    q = query[0]  # [H, T, D]
    out = query.new_empty(meta.num_tokens, heads, dv)
    masked = meta.masks[layer] if meta.masks else None
    if masked is not None:  # a window over every block of the context (KVLayout rings=False)
        km = masked_kind(km, masked, kc.shape[1])
    _decode(meta, km, col, q, kc, vc, out, scale, softcap, sinks)
    _prefill(km, col, q, key, value, kc, vc, out, scale, softcap, sinks)
    if km.late_rows is not None:
        write_kv(kc, vc, km.late_slots[col], km.late_rows, key, value)
    return out.unsqueeze(0)


def masked_kind(km: KindMeta, window: int, block: int) -> KindMeta:
    """A full kind's step with a window masked over it: rows see only keys in (q - window, q]."""
    groups = []
    for dec in km.decode:
        starts = (dec.lens - window).clamp(min=0)
        pos = torch.arange(dec.nb * block, device=starts.device)[None, :]
        mask = ((pos >= starts[:, None]) & (pos < dec.lens[:, None])).view(-1, 1, 1, pos.shape[1])
        groups.append(DecodeGroup(dec.q_idx, dec.blocks, dec.nb, mask, dec.lens, starts))
    chunks = []
    for p in km.prefills:
        q = torch.arange(p.k_len - p.q_len, p.k_len, device=km.slots[0].device)[:, None]
        k = torch.arange(p.k_len if p.blocks is not None else p.q_len, device=q.device)[None, :]
        if p.blocks is None:
            k = k + p.k_len - p.q_len
        chunks.append(PrefillChunk(p.q_start, p.q_len, p.k_len, p.blocks, (k <= q) & (k > q - window)))
    return KindMeta(km.window, km.slots, km.rows, groups, chunks, km.late_rows, km.late_slots)


def _decode(meta, km: KindMeta, col, q, kc, vc, out, scale, softcap, sinks) -> None:
    hkv, dk, dv = kc.shape[2], kc.shape[3], vc.shape[3]
    for dec in km.decode:
        blocks = dec.blocks[col]
        if meta.decode_kernel is not None:
            qd = q.index_select(1, dec.q_idx).transpose(0, 1)  # [B, H, D]
            o = meta.decode_kernel(qd, kc, vc, blocks.view(-1, dec.nb), dec.lens, scale, dec.starts, softcap, sinks)
            out.index_copy_(0, dec.q_idx, o)
            continue
        bsz = dec.q_idx.numel()
        kd = kc.index_select(0, blocks).view(bsz, -1, hkv, dk).transpose(1, 2)
        vd = vc.index_select(0, blocks).view(bsz, -1, hkv, dv).transpose(1, 2)
        qd = q.index_select(1, dec.q_idx).transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        o = dense_attention(qd, kd, vd, dec.mask, False, scale, softcap, sinks)
        out.index_copy_(0, dec.q_idx, o.squeeze(2))


def _prefill(km: KindMeta, col, q, key, value, kc, vc, out, scale, softcap, sinks) -> None:
    hkv, dk, dv = kc.shape[2], kc.shape[3], vc.shape[3]
    for p in km.prefills:
        s, n = p.q_start, p.q_len
        qp = q[:, s : s + n].unsqueeze(0)
        kn, vn = key[:, :, s : s + n], value[:, :, s : s + n]  # the chunk's own K/V, as computed
        if p.blocks is None:  # no prefix to read back
            o = dense_attention(qp, kn, vn, p.mask, p.mask is None and n > 1, scale, softcap, sinks)
        else:
            blocks = p.blocks[col]
            kp = kc.index_select(0, blocks).view(1, -1, hkv, dk)[:, : p.k_len].transpose(1, 2)
            vp = vc.index_select(0, blocks).view(1, -1, hkv, dv)[:, : p.k_len].transpose(1, 2)
            if km.window is not None:  # the ring holds the prefix; the chunk's keys come as computed
                kp, vp = torch.cat([kp, kn], dim=2), torch.cat([vp, vn], dim=2)
            o = dense_attention(qp, kp, vp, p.mask, False, scale, softcap, sinks)
        out[s : s + n] = o[0].transpose(0, 1)


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
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    meta = getattr(_step, "meta", None)
    if meta is None:
        raise RuntimeError("weightq paged attention called outside a step (use the engine's runner)")
    return attend(meta, layer, query, key, value, scale, softcap or None, sinks)


@_paged_attention_op.register_fake
def _(query, key, value, layer, scale, softcap, sinks) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[3])
