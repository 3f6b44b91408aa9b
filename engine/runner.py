"""The model runner: turns one step's work into one packed forward pass and returns logits.

Every running sequence contributes its tokens for this step (a prompt chunk, or its last token)
to a single [1, T] row with per-token position ids; the step metadata tells attention where each
token's K/V lives. Logits are computed only for the rows of sequences that emit a token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
from weightq.batcher import BlockLedger

from .attention import DecodeGroup, PrefillChunk, StepMeta, step_context
from .decode_kernel import compile_paged_decode
from .kv_cache import KVCache


class HasTokens(Protocol):
    token_ids: list[int]
    block_table: list[int]


@dataclass(slots=True)
class Work:
    """Feed tokens [start, start + n) of `seq` this step; `emits` when the last one yields logits."""

    seq: HasTokens
    start: int
    n: int
    emits: bool


class Runner(Protocol):
    """What the engine loop needs of a runner (the paged ModelRunner here, the PaddedRunner in
    padded.py; a third, e.g. a simulated device, implements the same)."""

    compiled: bool  # its shapes are compiled: the engine warms them up before serving
    can_isolate: bool  # a failed step can be retried request by request (False: one batch, one fate)
    model_s: float  # seconds spent inside the model's forward so far
    # forward() may return before the device is done (its logits are read after synchronize()): the
    # engine then does the last step's detokenization and events in between, while the device runs.
    asynchronous: bool
    # it can return the logits of prompt positions (prompt log-probabilities): see ModelRunner.prompt_rows
    prompt_logprobs: bool

    def synchronize(self) -> None:
        """Wait until the last forward's logits are ready (and count its device time in model_s)."""

    def ensure(self, seq: HasTokens, tokens: int) -> None:
        """Make room for `tokens` tokens of `seq` (the batcher guarantees the memory suffices)."""

    def release(self, seq: HasTokens) -> None:
        """Free what `seq` holds."""

    def forward(self, prefill: list[Work], decode: list[Work]) -> torch.Tensor:
        """One step: the logits of every emitting work item, prefill first, in order."""
        ...

    def memory(self) -> dict:
        """Memory counters for stats()."""
        ...

    def check(self, seqs: list, budget: int) -> None:
        """Assert the runner's own accounting agrees with the batcher's (tests and debugging)."""


class PagedMemory:
    """The memory side of a runner on a KVCache (the paged runner, the simulated device); the padded
    runner has the same methods over its own rows. The batcher hands out the blocks (its ledger):
    a sequence's block table is its batcher request's, filled before the step is planned."""

    cache: KVCache
    ledger: BlockLedger | None = None  # the batcher's, set when the engine is built (memory counters)
    asynchronous = False
    prompt_logprobs = False

    def synchronize(self) -> None:
        pass

    def ensure(self, seq: HasTokens, tokens: int) -> None:
        """The batcher gave `seq` its blocks when it planned the step."""
        if tokens > len(seq.block_table) * self.cache.block_size:
            raise RuntimeError(f"no KV block for token {tokens - 1}: the batcher did not allocate it")

    def release(self, seq: HasTokens) -> None:
        """The batcher took the blocks back when the request left it."""

    def memory(self) -> dict:
        c, ledger = self.cache, self.ledger
        out = {"kv_blocks_total": c.num_blocks, "block_size": c.block_size}
        if ledger is not None:
            out |= {"kv_blocks_used": ledger.used, "prefix_cached_blocks": ledger.idle}
        return out

    def check(self, seqs: list, budget: int) -> None:
        """Invariants after a step (tests): the batcher's check_memory covers the blocks."""


class ModelRunner(PagedMemory):
    can_isolate = True  # each request's rows are its own: a failed step is retried one by one
    prompt_logprobs = True

    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        backend: str,
        device: torch.device,
        *,
        compiled: bool = False,
    ) -> None:
        self.model = model
        self.compiled = compiled
        self.asynchronous = device.type == "cuda"  # kernels queue; the sampler's read waits for them
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        cfg = getattr(model, "config", None)
        heads = getattr(cfg, "num_attention_heads", 0)
        pool = cache.k[0]
        self.decode_kernel = (
            compile_paged_decode(heads, pool.shape[2], pool.shape[3], pool.dtype, device) if compiled else None
        )
        self._decode_fn = self.decode_kernel.fn if self.decode_kernel else None
        # Attention is an opaque op inside the compiled graph (attention.step_context); token counts are dynamic.
        import os

        _opts = {"freezing": True} if os.environ.get("WQ_FREEZE") else None
        self._compiled_model = torch.compile(model, fullgraph=True, options=_opts) if compiled else None
        self.cache = cache
        self.backend = backend
        self.device = device
        self.model_s = 0.0  # time inside the model's forward (the rest of a step is overhead)
        self._ar = torch.arange(4096)
        # the last step's prompt positions whose logits were asked for (prompt log-probabilities):
        # (sequence, first position, logits [rows, vocab]); row i predicts token first + i + 1
        self.prompt_rows: list[tuple[HasTokens, int, torch.Tensor]] = []
        self._prompt_keep: list[tuple[HasTokens, int, int]] = []  # (seq, first position, rows)

    def _arange(self, n: int) -> torch.Tensor:
        if n > len(self._ar):
            self._ar = torch.arange(max(n, 2 * len(self._ar)))
        return self._ar[:n]

    def build(
        self, prefill: list[Work], decode: list[Work]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepMeta]:
        """Packed input ids, position ids, rows to keep, and the step metadata (prefill first)."""
        bs = self.cache.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_parts: list[torch.Tensor] = []
        keep: list[int] = []
        chunks: list[PrefillChunk] = []
        extra: list[int] = []  # prompt positions whose logits are asked for, after the emitting rows
        self._prompt_keep = []
        for w in prefill:
            q_start = len(ids)
            ids.extend(w.seq.token_ids[w.start : w.start + w.n])
            p = torch.arange(w.start, w.start + w.n)
            pos.extend(range(w.start, w.start + w.n))
            k_len = w.start + w.n
            bt = torch.tensor(w.seq.block_table[: -(-k_len // bs)], dtype=torch.long)
            slot_parts.append(bt[p // bs] * bs + p % bs)
            if w.start == 0:
                chunks.append(PrefillChunk(q_start, w.n, k_len, None, None))
            else:
                mask = self._arange(k_len)[None, :] <= p[:, None]
                chunks.append(PrefillChunk(q_start, w.n, k_len, bt.to(self.device), mask.to(self.device)))
            if w.emits:
                keep.append(len(ids) - 1)
            if w.seq.params.prompt_logprobs is not None:  # every position but the sampling one
                rows = w.n - 1 if w.emits else w.n
                extra.extend(range(q_start, q_start + rows))
                self._prompt_keep.append((w.seq, w.start, rows))
        groups: list[DecodeGroup] = []
        if decode:
            first = len(ids)
            dec_slots: list[int] = []
            lens: list[int] = []
            for w in decode:
                p = w.start
                bt = w.seq.block_table
                ids.append(w.seq.token_ids[p])
                pos.append(p)
                dec_slots.append(bt[p // bs] * bs + p % bs)
                lens.append(p + 1)
            if self.backend != "flash":
                ragged = self.decode_kernel is not None and self.decode_kernel.ragged
                for rows in [list(range(len(lens)))] if ragged else _split_by_length(lens, bs):
                    groups.append(self._decode_group(decode, rows, lens, first))
            slot_parts.append(torch.tensor(dec_slots, dtype=torch.long))
            keep.extend(range(first, first + len(decode)))
        keep.extend(extra)
        slots = torch.cat(slot_parts).to(self.device)
        meta = StepMeta(self.cache, slots, len(ids), groups, chunks, decode_kernel=self._decode_fn)
        if self.backend == "flash":
            self._add_varlen(meta, prefill, decode)
        ids_t = torch.tensor(ids, device=self.device).unsqueeze(0)
        pos_t = torch.tensor(pos, device=self.device).unsqueeze(0)
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        return ids_t, pos_t, keep_t, meta

    def _decode_group(self, decode: list[Work], rows: list[int], lens: list[int], first: int) -> DecodeGroup:
        """One batched attention call: the rows' blocks padded to the longest, masked past each length."""
        bs = self.cache.block_size
        row_lens = [lens[i] for i in rows]
        nb = -(-max(row_lens) // bs)
        flat: list[int] = []
        for i in rows:
            t = decode[i].seq.block_table
            flat.extend(t[:nb] if len(t) >= nb else t + [0] * (nb - len(t)))
        span = nb * bs
        mask = None
        lens_t = torch.tensor(row_lens)
        if self.decode_kernel is None and any(n != span for n in row_lens):
            mask = (self._arange(span)[None, :] < lens_t[:, None]).view(len(rows), 1, 1, span).to(self.device)
        q_idx = torch.tensor([first + i for i in rows], device=self.device)
        return DecodeGroup(q_idx, torch.tensor(flat, device=self.device), nb, mask, lens_t.to(self.device))

    def _add_varlen(self, meta: StepMeta, prefill: list[Work], decode: list[Work]) -> None:
        bs = self.cache.block_size
        works = prefill + decode
        q_lens = [w.n for w in works]
        k_lens = [w.start + w.n for w in works]
        nb = max(-(-k // bs) for k in k_lens)
        table = [w.seq.block_table[:nb] + [0] * (nb - min(nb, len(w.seq.block_table))) for w in works]
        cu_q, cu_k = [0], [0]
        for q, k in zip(q_lens, k_lens, strict=True):
            cu_q.append(cu_q[-1] + q)
            cu_k.append(cu_k[-1] + k)
        meta.cu_q = torch.tensor(cu_q, dtype=torch.int32, device=self.device)
        meta.cu_k = torch.tensor(cu_k, dtype=torch.int32, device=self.device)
        meta.max_q, meta.max_k = max(q_lens), max(k_lens)
        meta.block_table = torch.tensor(table, dtype=torch.int32, device=self.device)

    @torch.inference_mode()
    def forward(self, prefill: list[Work], decode: list[Work]) -> torch.Tensor:
        """Logits [rows, vocab] in float32 for the emitting works: prefill ones first, then decodes."""
        ids, pos, keep, meta = self.build(prefill, decode)
        t0 = time.perf_counter()
        if self.asynchronous:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        rows = len(keep) - sum(n for _, _, n in self._prompt_keep)
        if self._compiled_model is not None:
            # The attention op looks pure to the compiler: with no logits to keep, it would drop the
            # whole graph and with it the KV writes of a prompt chunk. One kept row keeps every layer.
            keep = keep if len(keep) else keep.new_tensor([ids.shape[1] - 1])
            for t, dim in ((ids, 1), (pos, 1), (keep, 0)):
                torch._dynamo.maybe_mark_dynamic(t, dim)
            with step_context(meta):
                out = self._compiled_model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep)
        else:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep, weightq_meta=meta)
        logits = out.logits[0, :rows].float()
        self.prompt_rows, at = [], rows
        for seq, first, n in self._prompt_keep:
            self.prompt_rows.append((seq, first, out.logits[0, at : at + n].float()))
            at += n
        if self.asynchronous:  # timed on the device; synchronize() waits, so the host works meanwhile
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._timing = (start, end)
        else:
            self.model_s += time.perf_counter() - t0
        return logits

    def synchronize(self) -> None:
        if self._timing is not None:
            start, end = self._timing
            self._timing = None
            end.synchronize()
            self.model_s += start.elapsed_time(end) / 1000


def _split_by_length(lens: list[int], block: int, max_groups: int = 4) -> list[list[int]]:
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
