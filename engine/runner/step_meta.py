"""Building a step's attention metadata (attention/meta.py) from the runner's work, kind by kind.

A full kind reads a sequence's linear block table (its prefix cache's blocks included): every token
is written at its slot before attention, decode rows are grouped by length (padding to a group's
longest), and a prompt chunk with a prefix reads prefix and chunk back from the pool. A window kind
reads a ring (kv_cache.py): logical block j in unit j mod R, `pages` columns per unit. Its decode rows
read only the blocks of their window, and a prompt chunk's last window is written after attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..attention.meta import DecodeGroup, KindMeta, PrefillChunk
from .kv_cache import AttentionKind

if TYPE_CHECKING:
    from .base import Work

ARANGE_START = 4096  # positions the reusable arange holds at first; it doubles when a step needs more


class MetaBuilder:
    """Per-step metadata for every attention kind of a layout; holds the small reusable tensors."""

    def __init__(self, block_size: int, device: torch.device, ragged: bool, flash: bool) -> None:
        self.bs = block_size
        self.device = device
        self.ragged = ragged  # the decode kernel takes rows of any length in one call
        self.flash = flash  # flash-attn builds its own varlen view (no decode groups)
        self._ar = torch.arange(ARANGE_START)

    def arange(self, n: int) -> torch.Tensor:
        if n > len(self._ar):
            self._ar = torch.arange(max(n, 2 * len(self._ar)))
        return self._ar[:n]

    # ----- a full kind: linear block tables ------------------------------------------------------
    def full(self, prefill: list[Work], decode: list[Work], q_starts: list[int], first: int) -> KindMeta:
        bs, dev = self.bs, self.device
        slot_parts: list[torch.Tensor] = []
        chunks: list[PrefillChunk] = []
        for w, q_start in zip(prefill, q_starts, strict=True):
            p = torch.arange(w.start, w.start + w.n)
            k_len = w.start + w.n
            bt = torch.tensor(w.seq.block_table[: -(-k_len // bs)], dtype=torch.long)
            slot_parts.append(bt[p // bs] * bs + p % bs)
            if w.start == 0:
                chunks.append(PrefillChunk(q_start, w.n, k_len, None, None))
            else:
                mask = self.arange(k_len)[None, :] <= p[:, None]
                chunks.append(PrefillChunk(q_start, w.n, k_len, [bt.to(dev)], mask.to(dev)))
        groups: list[DecodeGroup] = []
        if decode:
            dec_slots: list[int] = []
            lens: list[int] = []
            for w in decode:
                p = w.start
                dec_slots.append(w.seq.block_table[p // bs] * bs + p % bs)
                lens.append(p + 1)
            if not self.flash:
                for rows in [list(range(len(lens)))] if self.ragged else split_by_length(lens, bs):
                    groups.append(self._full_group(decode, rows, lens, first))
            slot_parts.append(torch.tensor(dec_slots, dtype=torch.long))
        slots = torch.cat(slot_parts).to(dev) if slot_parts else torch.empty(0, dtype=torch.long, device=dev)
        return KindMeta(None, [slots], None, groups, chunks)

    def _full_group(self, decode: list[Work], rows: list[int], lens: list[int], first: int) -> DecodeGroup:
        """One batched attention call: the rows' blocks padded to the longest, masked past each length."""
        bs = self.bs
        row_lens = [lens[i] for i in rows]
        nb = -(-max(row_lens) // bs)
        flat: list[int] = []
        for i in rows:
            t = decode[i].seq.block_table
            flat.extend(t[:nb] if len(t) >= nb else t + [0] * (nb - len(t)))
        span = nb * bs
        mask = None
        lens_t = torch.tensor(row_lens)
        if not self.ragged and any(n != span for n in row_lens):
            mask = (self.arange(span)[None, :] < lens_t[:, None]).view(len(rows), 1, 1, span).to(self.device)
        q_idx = torch.tensor([first + i for i in rows], device=self.device)
        return DecodeGroup(q_idx, [torch.tensor(flat, device=self.device)], nb, mask, lens_t.to(self.device))

    # ----- a window kind: rings ------------------------------------------------------------------
    def window(
        self,
        kind: AttentionKind,
        ring_index: int,
        prefill: list[Work],
        decode: list[Work],
        q_starts: list[int],
        first: int,
    ) -> KindMeta:
        bs, dev, w_len, units, m = self.bs, self.device, kind.window, kind.ring, kind.pages
        assert w_len is not None

        def pages(ring: list[int], block: int) -> list[int]:
            u = (block % units) * m
            return ring[u : u + m]

        def slot_cols(ring: list[int], positions: range) -> list[list[int]]:
            return [[pg * bs + p % bs for pg in pages(ring, p // bs)] for p in positions]

        early_rows: list[int] = []
        early: list[list[int]] = []
        late_rows: list[int] = []
        late: list[list[int]] = []
        chunks: list[PrefillChunk] = []
        for w, q_start in zip(prefill, q_starts, strict=True):
            ring, s, n = w.seq.sched.rings[ring_index], w.start, w.n
            rows, slots = (early_rows, early) if self.flash else (late_rows, late)
            for kind_index, j, spare in w.seq.sched.window_snapshots:  # copies kept for the prefix cache
                if kind_index == ring_index:
                    rows.extend(range(q_start + j * bs - s, q_start + (j + 1) * bs - s))
                    slots.extend([pg * bs + off for pg in spare] for off in range(bs))
            if self.flash:  # it writes before it attends: the whole chunk (its ring has room, flash.py)
                early_rows.extend(range(q_start, q_start + n))
                early.extend(slot_cols(ring, range(s, s + n)))
            else:
                keep = range(max(s, s + n - w_len + 1), s + n)  # the last window: what later steps read
                late_rows.extend(q_start + p - s for p in keep)
                late.extend(slot_cols(ring, keep))
            if self.flash:
                continue
            q_pos = torch.arange(s, s + n)
            lo_pos = max(0, s - w_len + 1)
            if s == 0:
                mask = None
                if n > w_len:
                    mask = (q_pos[None, :] <= q_pos[:, None]) & (q_pos[None, :] > q_pos[:, None] - w_len)
                chunks.append(PrefillChunk(q_start, n, 0, None, None if mask is None else mask.to(dev)))
                continue
            lo = lo_pos // bs
            blocks = [pages(ring, j) for j in range(lo, (s - 1) // bs + 1)]
            k_len = s - lo * bs
            k_pos = torch.cat([torch.arange(lo * bs, s), q_pos])
            mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - w_len)
            cols = [torch.tensor([b[g] for b in blocks], device=dev) for g in range(m)]
            chunks.append(PrefillChunk(q_start, n, k_len, cols, mask.to(dev)))
        groups: list[DecodeGroup] = []
        if decode:
            tables: list[list[list[int]]] = []
            starts: list[int] = []
            ends: list[int] = []
            for w in decode:
                ring, p = w.seq.sched.rings[ring_index], w.start
                early_rows.append(first + len(tables))
                early.extend(slot_cols(ring, range(p, p + 1)))
                lo_pos = max(0, p - w_len + 1)
                lo = lo_pos // bs
                tables.append([pages(ring, j) for j in range(lo, p // bs + 1)])
                starts.append(lo_pos - lo * bs)
                ends.append(p + 1 - lo * bs)
            if not self.flash:
                groups.append(self._window_group(tables, starts, ends, first, m))
        return KindMeta(
            w_len,
            self._columns(early, m),
            torch.tensor(early_rows, dtype=torch.long, device=dev),
            groups,
            chunks,
            torch.tensor(late_rows, dtype=torch.long, device=dev) if late_rows else None,
            self._columns(late, m),
        )

    def _window_group(
        self, tables: list[list[list[int]]], starts: list[int], ends: list[int], first: int, m: int
    ) -> DecodeGroup:
        """Every decode row in one call: a window holds few blocks, so padding to the longest costs little."""
        bs, dev = self.bs, self.device
        nb = max(len(t) for t in tables)
        flat = [t + [t[0]] * (nb - len(t)) for t in tables]
        cols = [torch.tensor([unit[g] for t in flat for unit in t], device=dev) for g in range(m)]
        span = nb * bs
        starts_t, ends_t = torch.tensor(starts), torch.tensor(ends)
        mask = None
        if not self.ragged:
            pos = self.arange(span)[None, :]
            mask = ((pos >= starts_t[:, None]) & (pos < ends_t[:, None])).view(len(tables), 1, 1, span).to(dev)
        q_idx = torch.arange(first, first + len(tables), device=dev)
        return DecodeGroup(q_idx, cols, nb, mask, ends_t.to(dev), starts_t.to(dev))

    def _columns(self, slots: list[list[int]], m: int) -> list[torch.Tensor]:
        if not slots:
            return [torch.empty(0, dtype=torch.long, device=self.device) for _ in range(m)]
        t = torch.tensor(slots, dtype=torch.long)
        return [t[:, g].contiguous().to(self.device) for g in range(m)]


def split_by_length(lens: list[int], block: int, max_groups: int = 4) -> list[list[int]]:
    """Group decode rows by length so that padding each row to its group's longest wastes little.

    Rows are sorted by length; the costliest group is split at its best point while that saves at
    least a fifth of its padded work (and it has rows to spare), up to `max_groups` attention calls.
    """
    order = sorted(range(len(lens)), key=lens.__getitem__)
    blocks = [-(-lens[i] // block) for i in order]
    groups = [(0, len(order))]  # half-open ranges into `order`
    while len(groups) < max_groups:
        best = None
        for g, (lo, hi) in enumerate(groups):
            if hi - lo < 8:
                continue
            whole = (hi - lo) * blocks[hi - 1]
            for k in range(lo + 1, hi):
                saving = whole - ((k - lo) * blocks[k - 1] + (hi - k) * blocks[hi - 1])
                if saving >= 0.2 * whole and (best is None or saving > best[0]):
                    best = (saving, g, k)
        if best is None:
            break
        _, g, k = best
        lo, hi = groups[g]
        groups[g : g + 1] = [(lo, k), (k, hi)]
    return [order[lo:hi] for lo, hi in groups]
