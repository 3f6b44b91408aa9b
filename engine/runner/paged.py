"""The model runner: turns one step's work into one packed forward pass and returns logits.

Every running sequence contributes its tokens for this step (a prompt chunk, or its last token)
to a single [1, T] row with per-token position ids; the step metadata tells attention where each
token's K/V lives. Logits are computed only for the rows of sequences that emit a token.
"""

from __future__ import annotations

import logging
import time

import torch

from ..attention import StepMeta, step_context
from ..attention.decode_kernel import compile_paged_decode
from ..attention.flash import BACKENDS as FLASH_BACKENDS
from ..attention.flash import add_varlen
from ..lora import Resident, lora_context
from .base import HasTokens, PagedMemory, Work
from .kv_cache import KVCache
from .step_meta import MetaBuilder

log = logging.getLogger(__name__)


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
        lora: Resident | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # installed in the model before it is compiled
        self._segments: list[tuple[str, list[int]]] = []
        self.compiled = compiled
        self.asynchronous = device.type == "cuda"  # kernels queue; the sampler's read waits for them
        self._timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        cfg = getattr(model, "config", None)
        heads = getattr(cfg, "num_attention_heads", 0)
        k_pool, v_pool = cache.k[0], cache.v[0]
        self.decode_kernel = (
            compile_paged_decode(heads, k_pool.shape[2], k_pool.shape[3], k_pool.dtype, device, v_pool.shape[3])
            if compiled
            else None
        )
        self._decode_fn = self.decode_kernel.fn if self.decode_kernel else None
        # Attention is an opaque op inside the compiled graph (attention.step_context); token counts are dynamic.
        self._compiled_model = torch.compile(model, fullgraph=True) if compiled else None
        # Token counts unbacked: one graph serves steps of one token and of many, where backed sizes are
        # specialised at 1 (three graphs to trace, the bulk of a warm start). A model whose code branches
        # on them cannot be traced so: its first compile falls back to backed sizes (`_compiled_forward`).
        self._unbacked = True
        self._traced = False  # a compiled forward succeeded: errors from now on are the step's own
        self.cache = cache
        self.backend = backend
        self.device = device
        self.model_s = 0.0  # time inside the model's forward (the rest of a step is overhead)
        ragged = self.decode_kernel is not None and self.decode_kernel.ragged
        self._meta = MetaBuilder(cache.block_size, device, ragged, backend in FLASH_BACKENDS)
        # the last step's prompt positions whose logits were asked for (prompt log-probabilities):
        # (sequence, first position, logits [rows, vocab]); row i predicts token first + i + 1
        self.prompt_rows: list[tuple[HasTokens, int, torch.Tensor]] = []
        self._prompt_keep: list[tuple[HasTokens, int, int]] = []  # (seq, first position, rows)

    def build(
        self, prefill: list[Work], decode: list[Work]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, StepMeta]:
        """Packed input ids, position ids, rows to keep, and the step metadata (prefill first)."""
        ids: list[int] = []
        pos: list[int] = []
        keep: list[int] = []
        q_starts: list[int] = []
        extra: list[int] = []  # prompt positions whose logits are asked for, after the emitting rows
        self._prompt_keep = []
        for w in prefill:
            q_start = len(ids)
            q_starts.append(q_start)
            ids.extend(w.seq.token_ids[w.start : w.start + w.n])
            pos.extend(range(w.start, w.start + w.n))
            if w.emits:
                keep.append(len(ids) - 1)
            if w.seq.params.prompt_logprobs is not None:  # every position but the sampling one
                rows = w.n - 1 if w.emits else w.n
                extra.extend(range(q_start, q_start + rows))
                self._prompt_keep.append((w.seq, w.start, rows))
        first = len(ids)
        for w in decode:
            ids.append(w.seq.token_ids[w.start])
            pos.append(w.start)
        keep.extend(range(first, first + len(decode)))
        keep.extend(extra)
        layout, meta_of = self.cache.layout, self._meta
        kinds = []
        for k, kind in enumerate(layout.kinds):
            if kind.full:
                kinds.append(meta_of.full(prefill, decode, q_starts, first))
            else:
                kinds.append(meta_of.window(kind, k - layout.has_full, prefill, decode, q_starts, first))
        meta = StepMeta(self.cache, len(ids), kinds, layout.place, layout.masks, decode_kernel=self._decode_fn)
        if self.backend in FLASH_BACKENDS:
            add_varlen(meta, prefill, decode, self.cache.block_size, self.device)
        ids_t = torch.tensor(ids, device=self.device).unsqueeze(0)
        pos_t = torch.tensor(pos, device=self.device).unsqueeze(0)
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        if self.lora is not None:
            self._segments = self._adapter_rows(prefill, decode, q_starts, first)
        return ids_t, pos_t, keep_t, meta

    def _adapter_rows(
        self, prefill: list[Work], decode: list[Work], q_starts: list[int], first: int
    ) -> list[tuple[str, list[int]]]:
        """Each adapter's rows of the packed step (the base's rows are left out)."""
        rows: dict[str, list[int]] = {}
        for w, q_start in zip(prefill, q_starts, strict=True):
            if name := w.seq.request.adapter:
                rows.setdefault(name, []).extend(range(q_start, q_start + w.n))
        for i, w in enumerate(decode):
            if name := w.seq.request.adapter:
                rows.setdefault(name, []).append(first + i)
        return list(rows.items())

    @torch.inference_mode()
    def forward(self, prefill: list[Work], decode: list[Work]) -> torch.Tensor:
        """Logits [rows, vocab] in float32 for the emitting works: prefill ones first, then decodes."""
        ids, pos, keep, meta = self.build(prefill, decode)
        self._fill_rings(prefill)
        t0 = time.perf_counter()
        if self.asynchronous:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        rows = len(keep) - sum(n for _, _, n in self._prompt_keep)
        if self._compiled_model is not None:
            # The attention op looks pure to the compiler: with no logits to keep, it would drop the
            # whole graph and with it the KV writes of a prompt chunk. One kept row keeps every layer.
            keep = keep if len(keep) else keep.new_tensor([ids.shape[1] - 1])
            with step_context(meta), lora_context(self.lora, self._segments):
                out = self._compiled_forward(ids, pos, keep)
        else:
            with lora_context(self.lora, self._segments):
                out = self.model(
                    input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep, weightq_meta=meta
                )
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

    def _compiled_forward(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor):
        """The compiled model on one step; the first call traces it, with unbacked token counts if the
        model allows, else (the error logged) with backed ones."""
        mark = torch._dynamo.decorators.mark_unbacked if self._unbacked else torch._dynamo.maybe_mark_dynamic
        for t, dim in ((ids, 1), (pos, 1), (keep, 0)):
            mark(t, dim)
        try:
            out = self._compiled_model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep)
        except Exception as e:
            if self._traced or not self._unbacked:
                raise
            log.warning("compile: unbacked token counts failed (%s); tracing with backed ones", str(e)[:300])
            self._unbacked = False
            self._compiled_model = torch.compile(self.model, fullgraph=True)
            return self._compiled_forward(ids, pos, keep)
        self._traced = True
        return out

    def _fill_rings(self, prefill: list[Work]) -> None:
        """A prefix-cache hit's window blocks: copied from the cache into the request's ring first."""
        src: list[int] = []
        dst: list[int] = []
        windows = self.cache.layout.windows
        for w in prefill:
            sched = w.seq.sched
            for kind_index, j, pages in sched.ring_copies:
                kind = windows[kind_index]
                unit = (j % kind.ring) * kind.pages
                src.extend(pages)
                dst.extend(sched.rings[kind_index][unit : unit + kind.pages])
        self.cache.copy_pages(src, dst)

    def synchronize(self) -> None:
        if self._timing is not None:
            start, end = self._timing
            self._timing = None
            end.synchronize()
            self.model_s += start.elapsed_time(end) / 1000
