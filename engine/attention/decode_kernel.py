"""Decode attention that reads the KV block pool in place (the compiled runner's decode path).

Both honour the variants of paged.py (a window's first visible position per row, soft-capping,
sinks, a V head size of its own). Two kernels, both reading each sequence's blocks where they lie
instead of copying a padded batch of contexts every layer (the eager path: index_select + SDPA):
- `CppDecode` (CPU, float32): a hand-written vectorised C++ kernel (decode_kernel.cpp) built at
  start-up by inductor's C++ toolchain, specialised on the head size and head counts. Each row stops
  at its own length, so one call serves every decode row of a step, with no padding to a group's
  longest: faster than the inductor kernel below wherever it builds.
- `paged_decode` under torch.compile: the same attention as plain tensor algebra; inductor fuses the
  block-table gather into the reductions. Rows are padded to the group's longest, so the runner
  groups rows by length. It serves other dtypes and shapes the C++ kernel does not build for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

Kernel = Callable[..., torch.Tensor]
log = logging.getLogger(__name__)


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    starts: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    q [B, H, D]; pools [num_blocks, block_size, Hkv, D (V: Dv)]; table [B, nb] block ids (padded rows
    repeat any valid block); lens [B] context ends and starts [B] (a window's first visible position)
    within the rows' blocks; softcap and sinks as in paged.dense_attention. Returns [B, H, Dv]."""
    batch, heads, dim = q.shape
    block, kv_heads, dv = k_pool.shape[1], k_pool.shape[2], v_pool.shape[3]
    span = table.shape[1] * block
    pos = torch.arange(span, device=q.device)
    slots = table[:, pos // block] * block + pos % block  # [B, L]
    k = k_pool.view(-1, kv_heads, dim)[slots]  # [B, L, Hkv, D], fused into the reduction below
    qg = q.view(batch, kv_heads, heads // kv_heads, dim)
    scores = (qg[:, None] * k[:, :, :, None, :]).sum(-1) * scale  # [B, L, Hkv, G]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    hidden = pos[None, :] >= lens[:, None]
    if starts is not None:
        hidden = hidden | (pos[None, :] < starts[:, None])
    scores = scores.masked_fill(hidden[:, :, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, 1, kv_heads, heads // kv_heads).expand(batch, 1, -1, -1)
        probs = torch.softmax(torch.cat([scores, sink], dim=1), dim=1)[:, :-1]
    else:
        probs = torch.softmax(scores, dim=1)
    v = v_pool.view(-1, kv_heads, dv)[slots]
    out = (probs[..., None] * v[:, :, :, None, :]).sum(1)  # [B, Hkv, G, Dv]
    return out.reshape(batch, heads, dv)


def _inductor_decode() -> Kernel:
    compiled = torch.compile(paged_decode, fullgraph=True)

    def run(q, k_pool, v_pool, table, lens, scale, starts=None, softcap=None, sinks=None):
        # the pools' block count too: engines of different capacities in one process share the kernel
        for t, dims in ((q, (0,)), (table, (0, 1)), (lens, (0,)), (k_pool, (0,)), (v_pool, (0,))):
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        if starts is not None:
            torch._dynamo.maybe_mark_dynamic(starts, 0)
        return compiled(q, k_pool, v_pool, table, lens, scale, starts, softcap, sinks)

    return run


_ARGS = (
    ["const float*"] * 3
    + ["const int64_t*"] * 3
    + ["const float*", "float*"]
    + ["const int64_t"] * 6
    + ["const float"] * 2
)


class CppDecode:
    """The C++ decode kernel for one attention geometry; rows may have any lengths (`ragged`)."""

    ragged = True

    def __init__(self, heads: int, kv_heads: int, head_dim: int, v_head_dim: int = 0) -> None:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        dv = v_head_dim or head_dim
        sizes = {"WQ_D": head_dim, "WQ_DV": dv, "WQ_G": heads // kv_heads, "WQ_HKV": kv_heads}
        defines = "".join(f"#define {k} {v}\n" for k, v in sizes.items())
        source = defines + (Path(__file__).with_name("decode_kernel.cpp")).read_text()
        self._fn = CppPythonBindingsCodeCache.load_pybinding(_ARGS, source)
        self.shape = (heads, head_dim)
        self.dv = dv
        self._none_i = torch.zeros(1, dtype=torch.int64)
        self._none_f = torch.zeros(1, dtype=torch.float32)

    def __call__(self, q, k_pool, v_pool, table, lens, scale, starts=None, softcap=None, sinks=None) -> torch.Tensor:
        batch = q.shape[0]
        assert q.shape[1:] == self.shape and k_pool.is_contiguous() and v_pool.is_contiguous()
        q = q.contiguous()
        table = table.to(torch.int64).contiguous()
        lens = lens.to(torch.int64).contiguous()
        out = q.new_empty(batch, self.shape[0], self.dv)
        self._fn(
            q,
            k_pool,
            v_pool,
            table,
            lens,
            self._none_i if starts is None else starts.to(torch.int64).contiguous(),
            self._none_f if sinks is None else sinks.float().contiguous(),
            out,
            batch,
            k_pool.shape[1],
            table.shape[1],
            torch.get_num_threads(),
            int(starts is not None),
            int(sinks is not None),
            float(scale),
            float(softcap or 0.0),
        )
        return out


@dataclass(frozen=True, slots=True)
class DecodeKernel:
    """The runner's decode kernel and whether it takes rows of any length in one call."""

    fn: Kernel
    ragged: bool
    name: str


def compile_paged_decode(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, v_head_dim: int = 0
) -> DecodeKernel:
    """The fastest decode kernel that builds here: C++ on CPU for float32, else the inductor kernel."""
    if device.type == "cpu" and dtype == torch.float32 and heads > 0 and heads % kv_heads == 0:
        try:
            return DecodeKernel(CppDecode(heads, kv_heads, head_dim, v_head_dim), True, "cpp")
        except Exception as e:  # no compiler, or a head size the vector width does not divide
            log.warning("C++ decode kernel unavailable (%s); using the inductor kernel", str(e).splitlines()[0][:200])
    return DecodeKernel(_inductor_decode(), False, "inductor")
