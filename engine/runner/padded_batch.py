"""The padded runner's running batch: which request owns each row, each row's next decoder position,
and the preallocated tensors (padded_state.Columns) behind the transformers Cache the model writes to.

Kept apart from the runner so the runner holds the step (prefill, decode, the encoder) and this
holds the memory the batcher's padded weight model accounts for: rows x (encoder + decoder width).
"""

from __future__ import annotations

import torch

from .padded_state import Columns, WindowLayer


class PaddedBatch:
    """Rows join (merge), leave (release, applied by compact before the next forward) and decode one
    column together; every Cache layer is a window onto the batch's columns (refresh after a change)."""

    def __init__(self) -> None:
        self.ids: list[str] = []  # row i of every tensor belongs to ids[i]
        self.pos: list[int] = []  # position of each row's next decoder token
        self.dec: Columns | None = None  # decoder mask, then K and V of every self-attention layer
        self.enc: Columns | None = None  # encoder mask, encoder states, then K and V of every cross layer
        self.cache = None  # the transformers Cache over the windows
        self._layers: list[WindowLayer] = []
        self._drop: set[str] = set()

    def release(self, request_id: str) -> None:
        """Drop the request's row before the next forward (all rows at once when none stays)."""
        if request_id not in self.ids:
            return
        self._drop.add(request_id)
        if len(self._drop) == len(self.ids):
            self.reset()

    def reset(self) -> None:
        self.ids, self.pos, self._drop = [], [], set()
        self.dec = self.enc = self.cache = None
        self._layers = []

    @property
    def rows(self) -> list[str] | None:
        return [r for r in self.ids if r not in self._drop] or None

    @property
    def num_rows(self) -> int:
        return len(self.ids) - len(self._drop)

    @property
    def live(self) -> set[str]:
        return set(self.ids) - self._drop

    def held(self, rows: int) -> int:
        """Padded weight of `rows` rows at the batch's current widths."""
        if self.dec is None:
            return 0
        return rows * (self.dec.width + (self.enc.width if self.enc is not None else 0))

    def state_bytes(self, allocated: bool = False) -> int:
        """Bytes of the batch's tensors (caches, masks, encoder states): the live windows, or
        everything allocated (with the slack that lets rows join without copying the batch)."""
        groups = [c for c in (self.dec, self.enc) if c is not None]
        return sum(c.nbytes() if allocated else c.live_bytes() for c in groups)

    @torch.inference_mode()
    def compact(self) -> None:
        """Remove dropped rows (the last rows move into their places) and trim padding nobody needs."""
        if not self._drop or self.dec is None:
            return
        drop = [i for i, rid in enumerate(self.ids) if rid in self._drop]
        self._drop = set()
        for group in (self.dec, self.enc):
            if group is not None:
                group.remove_rows(drop)
        for i in sorted(drop, reverse=True):
            self.ids[i], self.pos[i] = self.ids[-1], self.pos[-1]
            self.ids.pop()
            self.pos.pop()
        dec_mask = self.dec.view(0)
        self.dec.shrink_to(int(dec_mask.sum(1).max()))  # real tokens are right-aligned
        if self.enc is not None:
            self.enc.shrink_to(int(self.enc.view(0).sum(1).max()))  # ... and left-aligned here
        self.refresh()

    def refresh(self) -> None:
        for layer in self._layers:
            layer.refresh()

    def merge(self, ids: list[str], feeds: list[list[int]], dec: list, enc: list | None) -> None:
        """Copy freshly prefilled rows into the batch's buffers (only their rows are copied)."""
        from transformers import DynamicCache, EncoderDecoderCache

        if self.dec is None:
            self.dec = Columns([1] + [2] * (len(dec) - 1), right_aligned=True)
            self.dec.add_rows(dec)
            self._layers = [WindowLayer(self.dec, i) for i in range(1, len(dec), 2)]
            self_cache = DynamicCache()
            self_cache.layers, self_cache.layer_class_to_replicate = list(self._layers), None
            self.cache = self_cache
            if enc is not None:
                self.enc = Columns([1, 1] + [2] * (len(enc) - 2), right_aligned=False)
                self.enc.add_rows(enc)
                cross = [WindowLayer(self.enc, i) for i in range(2, len(enc), 2)]
                self._layers += cross
                cross_cache = DynamicCache()
                cross_cache.layers, cross_cache.layer_class_to_replicate = cross, None
                self.cache = EncoderDecoderCache(self_cache, cross_cache)
        else:
            self.dec.add_rows(dec)
            if self.enc is not None:
                self.enc.add_rows(enc)
        self.ids += ids
        self.pos += [len(f) for f in feeds]
        self.refresh()
