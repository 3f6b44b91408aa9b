"""The flash-attn backend (CUDA only): one varlen call over the paged pool per layer.

flash-attn's paged kernels want block_size a multiple of 256 and K/V pools shaped
[num_blocks, block_size, kv_heads, head_dim] — the layout of our KVCache. Causal masking is
aligned bottom-right, so a chunk with a prefix attends to the whole prefix.
"""

from __future__ import annotations

import torch

from .attention import StepMeta, write_kv


def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def flash_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    weightq_meta: StepMeta | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    from flash_attn import flash_attn_varlen_func

    meta = weightq_meta
    if meta is None or meta.cu_q is None:
        raise RuntimeError("flash paged attention called without varlen step metadata")
    kc, vc = write_kv(meta, module.layer_idx, key, value)
    out = flash_attn_varlen_func(
        query[0].transpose(0, 1),  # [T, H, D]
        kc,
        vc,
        cu_seqlens_q=meta.cu_q,
        cu_seqlens_k=meta.cu_k,
        max_seqlen_q=meta.max_q,
        max_seqlen_k=meta.max_k,
        softmax_scale=scaling,
        causal=True,
        block_table=meta.block_table,
    )
    return out.unsqueeze(0), None
