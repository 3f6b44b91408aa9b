"""Attention backends behind transformers' attention interface, over the paged KV pool.

`register(backend)` puts one backend under our attention name (the model is loaded with it): `paged`
(paged.py: SDPA and plain algebra, any device; the compiled runner's decode kernels in
decode_kernel.py) or `flash` (flash.py: flash-attn's varlen kernel, CUDA only). Both read the step's
`StepMeta` (meta.py). `probe.py` checks at load that every attention call of the model is one the
backend honours, and learns each layer's window.
"""

from __future__ import annotations

from transformers import AttentionInterface

from .meta import DecodeGroup, KindMeta, PrefillChunk, StepMeta
from .paged import attend, dense_attention, paged_attention, step_context

ATTN_NAME = "weightq_paged"

__all__ = [
    "ATTN_NAME",
    "DecodeGroup",
    "KindMeta",
    "PrefillChunk",
    "StepMeta",
    "attend",
    "dense_attention",
    "paged_attention",
    "register",
    "step_context",
]


def register(backend: str = "sdpa") -> str:
    """Register the chosen backend under our attention name; returns the name to load models with."""
    if backend == "flash":
        from .flash import flash_paged_attention

        AttentionInterface.register(ATTN_NAME, flash_paged_attention)
    elif backend == "flash_reference":
        from .flash import flash_reference_attention

        AttentionInterface.register(ATTN_NAME, flash_reference_attention)
    else:
        AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
