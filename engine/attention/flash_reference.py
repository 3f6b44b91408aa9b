"""A pure-torch stand-in for the flash-attn function flash.py calls, with its signature and semantics, so
that the flash path (its varlen metadata, block tables per kind and column, KV written before attention)
runs and is tested on any machine: a GPU's first run then tests only the kernel, not our indexing.

Mirrors `flash_attn.flash_attn_varlen_func` of flash-attn 2.6-2.8 (the `block_table` argument, paged
K/V) as flash.py calls it:
- q: [total_q, H, D], sequence i's queries at rows cu_seqlens_q[i]:cu_seqlens_q[i + 1];
- k, v: the paged pools [num_blocks, block_size, H_kv, D] with block_table [batch, max_blocks]: sequence
  i's key p is k[block_table[i, p // block_size], p % block_size], for p < cu_seqlens_k[i + 1] -
  cu_seqlens_k[i] (without block_table, [total_k, H_kv, D] rows as q's);
- GQA/MQA: query head h reads key head h // (H / H_kv);
- softmax_scale: None is 1 / sqrt(D); softcap > 0: scores become softcap * tanh(scores / softcap), after
  the scale and before the mask;
- causal, aligned bottom-right: query j of a sequence with q_len queries and k_len keys sits at position
  k_len - q_len + j and sees keys up to it; window_size (left, right), -1 for unbounded: keys in
  [pos - left, pos + right];
- a query that sees no key outputs zeros (flash-attn's convention).
It computes in float32 and returns q's dtype. Slow (a loop over sequences), exact: for tests and the
CPU run of the flash path (`attention="flash_reference"`), never for serving.
"""

from __future__ import annotations

import math

import torch


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    if dropout_p or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("the stand-in mirrors what flash.py uses: no dropout, ALiBi or probabilities")
    heads, dim = q.shape[1], q.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=q.dtype, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        q_len, k_len = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if q_len == 0:
            continue
        keys, values = _keys(k, v, block_table, i, ck[i], k_len)
        group = heads // keys.shape[1]
        keys = keys.float().repeat_interleave(group, dim=1)  # [k_len, H, D]
        values = values.float().repeat_interleave(group, dim=1)
        qi = q[cq[i] : cq[i + 1]].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        visible = _visible(q_len, k_len, causal, window_size, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros
        out[cq[i] : cq[i + 1]] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def _keys(k, v, block_table, i: int, start: int, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    if block_table is None:
        return k[start : start + k_len], v[start : start + k_len]
    block = k.shape[1]
    pos = torch.arange(k_len, device=k.device)
    pages = block_table[i, pos // block].long()
    return k[pages, pos % block], v[pages, pos % block]


def _visible(q_len: int, k_len: int, causal: bool, window: tuple[int, int], device) -> torch.Tensor:
    pos = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)  # bottom-right alignment
    key = torch.arange(k_len, device=device)[None, :]
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    ok = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= key >= pos - left
    if right >= 0:
        ok &= key <= pos + right
    return ok
