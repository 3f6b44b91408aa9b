"""The paged KV cache: one pool of pages shared by every layer, laid out by attention kind.

A model's layers come in attention kinds: full attention (every position of the context) and
sliding windows of W positions (Mistral, Gemma 2/3, gpt-oss...). A full layer's KV grows with the
context; a window layer never needs more than its last W positions. So the pool is not "one block per
layer per token": it is pages of `block_size` tokens x `group_size` layers, and each kind takes the
pages it needs (vLLM's hybrid KV cache manager is the model):

- a full kind holds one page per block of the context (its `block_table`, linear, prefix-cacheable);
- a window kind holds a *ring* of R units, R = ceil((W - 1) / block_size) + 1 (the window plus one
  block), each unit `pages` pages (its layers split in groups of `group_size`); logical block j lives
  in ring slot j mod R.

`group_size` is the number of full layers (so a full block is one page); a model with no full layer
uses its smallest kind's. Pool i (of `group_size`) holds the i-th layer of every group, so a page id
addresses one block of `group_size` layers. A model of full layers only is one page per block of all
its layers: the classic layout. Capacity in pages x block_size is the batcher's budget in *slots*
(a token of `group_size` layers); `slots_per_token` converts from tokens of the whole model.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What one token of KV costs in every layer: layers x kv_heads x (K + V head sizes) x dtype bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    v_head_dim: int = 0  # 0: the same as head_dim (MLA as transformers runs it differs: K 24, V 16)

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def bytes_per_token(self) -> int:
        per_layer = self.num_kv_heads * (self.head_dim + self.v_dim)
        return self.num_layers * per_layer * torch.finfo(self.dtype).bits // 8


@dataclass(frozen=True, slots=True)
class AttentionKind:
    """Layers that attend alike: full (`window` None) or over the last `window` positions."""

    window: int | None
    layers: tuple[int, ...]
    pages: int  # pages of one unit (one block of all its layers): ceil(len(layers) / group_size)
    ring: int  # units a request keeps: 0 for a full kind (one per block of the context)

    @property
    def full(self) -> bool:
        return self.window is None


def ring_blocks(window: int, block_size: int) -> int:
    """Blocks that hold the last `window` positions wherever the window starts: the window plus one."""
    return -(-(window - 1) // block_size) + 1


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How a model's layers map onto the page pool (see the module docstring)."""

    geometry: KVGeometry
    block_size: int
    group_size: int
    kinds: tuple[AttentionKind, ...]  # the full kind first, when there is one
    place: tuple[tuple[int, int, int], ...]  # per layer: (kind index, unit column, pool index)
    # per layer: a window applied as a mask over a full kind's blocks (rings=False), else None
    masks: tuple[int | None, ...] = ()

    @classmethod
    def build(
        cls,
        geometry: KVGeometry,
        windows: list[int | None],
        block_size: int,
        max_total_tokens: int,
        chunk: int = 0,
        *,
        rings: bool = True,
    ) -> KVLayout:
        """`windows[l]`: layer l's sliding window (None: full). A window that covers the longest context
        a request may reach is full attention in all but name, and is laid out as full. `chunk`: for a
        backend that writes a prompt chunk before attending to it (flash), the longest chunk, which a
        ring must hold besides the window. `rings=False` keeps every layer's whole context (each
        window applied as a mask): the memory of a model of full layers, for comparison."""
        if not rings:
            masks = tuple(w if w is not None and w < max_total_tokens else None for w in windows)
            layers = len(windows)
            place = tuple((0, 0, i) for i in range(layers))
            full = AttentionKind(None, tuple(range(layers)), 1, 0)
            return cls(geometry, block_size, layers, (full,), place, masks)
        norm = [w if w is not None and w + chunk < max_total_tokens else None for w in windows]
        by_window: dict[int | None, list[int]] = {}
        for layer, w in enumerate(norm):
            by_window.setdefault(w, []).append(layer)
        order = sorted(by_window, key=lambda w: (w is not None, w or 0))
        group = len(by_window[None]) if None in by_window else min(len(v) for v in by_window.values())
        kinds = []
        place: list[tuple[int, int, int]] = [(0, 0, 0)] * len(windows)
        for k, w in enumerate(order):
            layers = tuple(by_window[w])
            for j, layer in enumerate(layers):
                place[layer] = (k, j // group, j % group)
            ring = 0 if w is None else ring_blocks(w + chunk, block_size)
            kinds.append(AttentionKind(w, layers, -(-len(layers) // group), ring))
        return cls(geometry, block_size, group, tuple(kinds), tuple(place), (None,) * len(windows))

    @property
    def windows(self) -> tuple[AttentionKind, ...]:
        return tuple(k for k in self.kinds if not k.full)

    @property
    def has_full(self) -> bool:
        return bool(self.kinds) and self.kinds[0].full

    @property
    def page_bytes(self) -> int:
        g = self.geometry
        per_token = g.num_kv_heads * (g.head_dim + g.v_dim) * torch.finfo(g.dtype).bits // 8
        return per_token * self.group_size * self.block_size

    @property
    def slots_per_token(self) -> float:
        """Slots (a token of group_size layers) in one token of every layer."""
        return self.geometry.num_layers / self.group_size

    def weight_kinds(self) -> tuple[tuple[int, int], ...]:
        """The batcher's view (batcher/weight.py): (pages per unit, ring blocks or 0) per kind."""
        return tuple((k.pages, k.ring) for k in self.kinds)

    def describe(self) -> str:
        parts = [
            f"{len(k.layers)} {'full' if k.full else f'window-{k.window}'} layers"
            + ("" if k.full else f" (ring of {k.ring} blocks)")
            for k in self.kinds
        ]
        return f"{', '.join(parts)}; pages of {self.block_size} tokens x {self.group_size} layers"


def derive_capacity(
    layout: KVLayout,
    device: torch.device,
    *,
    max_batch_weight: int | None,
    kv_cache_mb: int,
    gpu_memory_fraction: float,
) -> tuple[int, str]:
    """Number of pages, and a sentence saying how it was derived (logged at start-up).
    `max_batch_weight` is in tokens of the whole model (every layer): the memory it names."""
    per_page = layout.page_bytes
    if max_batch_weight:
        pages = math.ceil(max_batch_weight * layout.slots_per_token / layout.block_size)
        why = f"max_batch_weight={max_batch_weight} tokens of every layer set explicitly"
    elif device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * gpu_memory_fraction)
        pages = budget // per_page
        why = f"{gpu_memory_fraction:.0%} of {free / 2**30:.2f} GiB free on {device} / {per_page} B per page"
    else:
        pages = kv_cache_mb * 2**20 // per_page
        why = f"kv_cache_mb={kv_cache_mb} MiB / {per_page} B per page"
    if pages < 1:
        raise ValueError(f"KV cache would hold no page: {why}")
    return pages, f"{pages} pages ({layout.describe()}; {why})"


class KVCache:
    """K and V pools shaped [pages, block_size, kv_heads, head_dim], `group_size` of each (pool i holds
    the i-th layer of every group: flash-attn's paged layout per pool). Slot s = page * block_size +
    offset addresses one token of one layer in a pool."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        g = layout.geometry
        self.num_blocks = num_pages
        self.block_size = layout.block_size
        self.device = device
        k_shape = (num_pages, layout.block_size, g.num_kv_heads, g.head_dim)
        v_shape = (num_pages, layout.block_size, g.num_kv_heads, g.v_dim)
        # Inference tensors (written only under inference mode): their dispatch keys are the same inside
        # and outside the compiled graph's attention op, so the compiled decode kernel is not recompiled.
        with torch.inference_mode():
            self.k = [torch.zeros(k_shape, dtype=g.dtype, device=device) for _ in range(layout.group_size)]
            self.v = [torch.zeros(v_shape, dtype=g.dtype, device=device) for _ in range(layout.group_size)]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages (every pool): a prefix-cache hit's window blocks into the request's ring."""
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        with torch.inference_mode():
            for pool in (*self.k, *self.v):
                pool.index_copy_(0, d, pool.index_select(0, s))
