"""What attention needs for one step, built once by the runner and read by every layer.

One `KindMeta` per attention kind (engine/runner/kv_cache.py): where each token's K/V is written, which pool
pages each decode row and prompt chunk reads, and the masks. A kind's layers come in groups sharing
its block tables; a group's pages are one column of a unit (`slots[col]`, `blocks[col]`), so the
positions, masks and lengths are built once per kind, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .decode_kernel import Kernel

if TYPE_CHECKING:
    from ..runner.kv_cache import KVCache


@dataclass(slots=True)
class PrefillChunk:
    q_start: int  # position of the chunk in the packed row
    q_len: int
    k_len: int  # keys read from the pool: full kinds prefix + chunk, window kinds the visible prefix
    blocks: list[torch.Tensor] | None  # per column: the pages read, in logical order (None: fresh K/V only)
    mask: torch.Tensor | None  # [q_len, keys] True where a query sees a key (None: plain causal)


@dataclass(slots=True)
class DecodeGroup:
    q_idx: torch.Tensor  # [B] positions of the decode tokens in the packed row
    blocks: list[torch.Tensor]  # per column: [B * nb] page ids, each row padded to nb blocks
    nb: int
    mask: torch.Tensor | None  # [B, 1, 1, nb * block_size], None when every row uses all its slots
    lens: torch.Tensor  # [B] end of each row's context within its nb blocks (exclusive)
    starts: torch.Tensor | None = None  # [B] first position a row sees within its blocks (windows)


@dataclass(slots=True)
class KindMeta:
    """One attention kind's view of the step."""

    window: int | None
    slots: list[torch.Tensor]  # per column: the slot of each row written before attention
    rows: torch.Tensor | None  # the packed rows those are (None: every row, in order)
    decode: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # window kinds: a prompt chunk's last window, written after its attention (it may overwrite ring
    # slots the chunk's own queries still read)
    late_rows: torch.Tensor | None = None
    late_slots: list[torch.Tensor] = field(default_factory=list)


@dataclass(slots=True)
class StepMeta:
    """Everything attention needs for one step, built once and shared by all layers."""

    cache: KVCache
    num_tokens: int
    kinds: list[KindMeta]
    place: tuple[tuple[int, int, int], ...]  # per layer: (kind, column, pool) (KVLayout.place)
    masks: tuple[int | None, ...] = ()  # per layer: a window masked over a full kind (KVLayout.masks)
    # flash-attn varlen view of the same step (built only for that backend)
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    flash_tables: list[list[torch.Tensor]] = field(default_factory=list)  # per kind, per column
    # the compiled in-place decode kernel (decode_kernel.py), None for the eager gather + SDPA
    decode_kernel: Kernel | None = None
