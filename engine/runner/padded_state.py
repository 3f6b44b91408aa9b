"""The padded batch's tensors, preallocated so that rows join and leave without copying the batch.

Each group of tensors shares its rows and a window of columns: the decoder group (self-attention
K/V of every layer and the decoder mask) keeps its tokens right-aligned in columns [start, end),
so one new column per step serves every row; the encoder group (cross-attention K/V, encoder
states and mask) keeps them left-aligned in [0, end). A leaving row is replaced by the last row
(one row copied, not the batch); trimming padding no row needs moves `start`; a decode step writes
one column in place. Models see the windows through cache layers (`WindowLayer`) whose keys/values
are views. Buffers start zeroed and only ever hold finite values, so masked columns stay inert.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class Columns:
    """Tensors [rows, ..., cols, ...] sharing rows [0, n) and the live column window [start, end)."""

    def __init__(self, dims: list[int], right_aligned: bool) -> None:
        self.dims = dims  # the column dimension of each tensor
        self.right = right_aligned
        self.bufs: list[torch.Tensor] = []
        self.n = 0
        self.start = 0
        self.end = 0

    @property
    def width(self) -> int:
        return self.end - self.start

    def view(self, i: int, extra: int = 0) -> torch.Tensor:
        return self.bufs[i][: self.n].narrow(self.dims[i], self.start, self.width + extra)

    def _realloc(self, rows: int, width: int, offset: int, templates: list[torch.Tensor] | None = None) -> None:
        """New buffers of `rows` x `width` columns; the live window moves to begin at `offset`."""
        new = []
        for i, d in enumerate(self.dims):
            src = self.bufs[i] if self.bufs else templates[i]
            shape = list(src.shape)
            shape[0], shape[d] = rows, width
            buf = src.new_zeros(shape)
            if self.bufs and self.n:
                buf[: self.n].narrow(d, offset, self.width).copy_(self.view(i))
            new.append(buf)
        self.bufs = new
        self.start, self.end = offset, offset + self.width

    def capacity(self) -> tuple[int, int]:
        b = self.bufs[0]
        return b.shape[0], b.shape[self.dims[0]]

    def append_column(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Write `t` (one or more columns for every row) after the window of tensor i, without moving
        `end` (the runner moves it once every layer wrote); returns the window including it."""
        width = t.shape[self.dims[i]]
        self.bufs[i][: self.n].narrow(self.dims[i], self.end, width).copy_(t)
        return self.view(i, width)

    def reserve_columns(self, k: int) -> bool:
        """Room for k more columns; True when the buffers moved (views over them must be remade)."""
        rows, cols = self.capacity()
        if self.end + k <= cols:
            return False
        self._realloc(rows, self.width + k + max(64, self.width // 2), 0)
        return True

    def advance(self, k: int = 1) -> None:
        self.end += k

    def remove_rows(self, drop: list[int]) -> None:
        """Remove rows (indices into [0, n)); the last rows fill the holes (their window is copied)."""
        for i in sorted(drop, reverse=True):
            last = self.n - 1
            if i != last:
                for j, d in enumerate(self.dims):
                    buf = self.bufs[j]
                    buf[i].narrow(d - 1, self.start, self.width).copy_(buf[last].narrow(d - 1, self.start, self.width))
            self.n -= 1

    def shrink_to(self, width: int) -> None:
        """Keep only the `width` columns rows still need (the rightmost when right-aligned)."""
        if self.right:
            self.start = self.end - width
        else:
            self.end = self.start + width

    def add_rows(self, tensors: list[torch.Tensor]) -> None:
        """Append rows whose columns (fewer or more than the window) align at the window's edge.
        Columns that enter the window are zeroed for the rows that have no data there (masked)."""
        k = tensors[0].shape[0]
        w = tensors[0].shape[self.dims[0]]
        if not self.bufs:
            self.n = self.start = self.end = 0
            self._realloc(k + 8, w + 64, w if self.right else 0, tensors)
        rows, cols = self.capacity()
        old_start, old_end = self.start, self.end
        if self.right:
            if rows < self.n + k or self.start < w - self.width:
                self._realloc(max(self.n + k, rows + rows // 4 + 8), max(self.width, w) + 64, max(0, w - self.width))
                old_start, old_end = self.start, self.end
            lo = self.end - w
            self.start = min(self.start, lo)
        else:
            if rows < self.n + k or w > cols:
                self._realloc(max(self.n + k, rows + rows // 4 + 8), max(cols, w), 0)
                old_start, old_end = self.start, self.end
            lo = 0
            self.end = max(self.end, w)
        for j, d in enumerate(self.dims):
            buf = self.bufs[j]
            if self.n:  # old rows: columns newly in the window
                if self.start < old_start:
                    buf[: self.n].narrow(d, self.start, old_start - self.start).zero_()
                if self.end > old_end:
                    buf[: self.n].narrow(d, old_end, self.end - old_end).zero_()
            rows_new = buf[self.n : self.n + k]
            rows_new.narrow(d, self.start, self.width).zero_()
            rows_new.narrow(d, lo, w).copy_(tensors[j])
        self.n += k

    def nbytes(self) -> int:
        """Bytes allocated, slack included (rows grow by a quarter, columns by at least 64)."""
        return sum(b.numel() * b.element_size() for b in self.bufs)

    def live_bytes(self) -> int:
        """Bytes of the live rows x window: what the batch's weight really costs."""
        return sum(self.view(i).numel() * b.element_size() for i, b in enumerate(self.bufs))


class WindowLayer(DynamicLayer):
    """A transformers cache layer whose keys/values are a Columns window (K at index ki, V at ki+1)."""

    def __init__(self, cols: Columns, ki: int) -> None:
        super().__init__()
        self.cols, self.ki = cols, ki
        self.is_initialized = True
        self.refresh()

    def refresh(self) -> None:
        self.keys, self.values = self.cols.view(self.ki), self.cols.view(self.ki + 1)
        self.device = self.keys.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys = self.cols.append_column(self.ki, key_states)
        self.values = self.cols.append_column(self.ki + 1, value_states)
        return self.keys, self.values
