"""The paged KV cache: one preallocated block pool per layer.

Its capacity in tokens (num_blocks x block_size) is the batcher's max_batch_weight. The batcher hands
out its blocks (batcher/blocks.py: one ledger for what it admits by and what the engine writes, the
prefix cache's shared blocks included) and guarantees they never run out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What one token of KV costs: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


def derive_capacity(
    geometry: KVGeometry,
    block_size: int,
    device: torch.device,
    *,
    max_batch_weight: int | None,
    cpu_kv_bytes: int,
    gpu_memory_fraction: float,
) -> tuple[int, str]:
    """Number of KV blocks, and a sentence saying how it was derived (logged at start-up)."""
    per_token = geometry.bytes_per_token
    if max_batch_weight:
        blocks = -(-max_batch_weight // block_size)
        why = f"max_batch_weight={max_batch_weight} tokens set explicitly"
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_fraction)
        blocks = budget // (per_token * block_size)
        why = f"{gpu_memory_fraction:.0%} of {free / 2**30:.2f} GiB free on {device} / {per_token} B per token"
    else:
        blocks = cpu_kv_bytes // (per_token * block_size)
        why = f"cpu_kv_bytes={cpu_kv_bytes / 2**20:.0f} MiB / {per_token} B per token"
    if blocks < 1:
        raise ValueError(f"KV cache would hold no block: {why}")
    return blocks, f"{blocks} blocks x {block_size} tokens = {blocks * block_size} tokens ({why})"


class KVCache:
    """K and V pools shaped [num_blocks, block_size, kv_heads, head_dim] per layer (flash-attn's
    paged layout). Slot s = block * block_size + offset addresses one token."""

    def __init__(self, geometry: KVGeometry, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, geometry.num_kv_heads, geometry.head_dim)
        # Inference tensors (written only under inference mode): their dispatch keys are the same inside
        # and outside the compiled graph's attention op, so the compiled decode kernel is not recompiled.
        with torch.inference_mode():
            self.k = [torch.zeros(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.num_layers)]
            self.v = [torch.zeros(shape, dtype=geometry.dtype, device=device) for _ in range(geometry.num_layers)]

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
