"""The padded runner: continuous batching for models that cannot use the paged attention backend.

The running batch is one set of left-padded tensors and the model's own attention. Every step:
finished or cancelled rows leave and padding no row needs any more is trimmed; admitted requests
are prefilled on their own (an encoder-decoder runs its encoder here, once per request) and their
rows copied into the batch's preallocated tensors (padded_state.py); then every row decodes one
token together. Decoder caches are left-padded (real tokens right-aligned, so one new column
serves every row); encoder states and cross-attention caches are right-padded and masked.

Its memory is rows x padded length (decoder-only) or rows x (longest input + longest decoder
length) (encoder-decoder): the batcher's padded weight model, with the input as the fixed part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from .base import Work
from .padded_batch import PaddedBatch
from .seq2seq import cross_projections, patch_decoder_positions


class PaddedRunner:
    """Same contract as the paged ModelRunner: forward(prefill, decode) -> logits of the emitting
    works, prefill first; release(seq) when a sequence leaves."""

    compiled = False  # the model's own cache: not compiled (see EngineConfig.compile)
    lora = None  # adapters are served on the paged runner only (builder.py refuses them here)
    asynchronous = False

    def synchronize(self) -> None:
        pass

    def __init__(self, model: nn.Module, device: torch.device, *, pad_id: int, decoder_start_id: int | None) -> None:
        self.model = model
        self.device = device
        self.seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
        self.pad_id = pad_id
        self.start_id = decoder_start_id
        if self.seq2seq and decoder_start_id is None:
            raise ValueError("an encoder-decoder model needs decoder_start_token_id in its config")
        self.positions = patch_decoder_positions(model) if self.seq2seq else None
        self.cross = cross_projections(model) if self.seq2seq else None
        self.batch = PaddedBatch()
        self.model_s = 0.0
        self.budget = 0  # set by the builder once the batch weight is known (for stats)

    # ----- memory ---------------------------------------------------------------------------------
    def ensure(self, seq, tokens: int) -> None:
        """Nothing to reserve: rows join the preallocated batch (the batcher bounds its weight)."""

    def release(self, seq) -> None:
        self.batch.release(seq.id)

    @property
    def rows(self) -> list[str] | None:
        return self.batch.rows

    @property
    def num_rows(self) -> int:
        return self.batch.num_rows

    def weight(self) -> int:
        """Padded weight held now: rows x (encoder length + decoder length), after pending drops."""
        self.batch.compact()
        return self.batch.held(len(self.batch.ids))

    def memory(self) -> dict:
        """Stats in the paged runner's terms: a "block" is one padded weight unit (one token)."""
        return {"kv_blocks_used": self.batch.held(self.batch.num_rows), "kv_blocks_total": self.budget, "block_size": 1}

    def check(self, seqs: list, budget: int) -> None:
        """Invariants after a step (tests): the rows are the live prefilled sequences, and the padded
        weight the tensors really hold is within the budget."""
        live = {s.id for s in seqs if s.sched.prefilled}
        rows = self.batch.live
        assert rows == live, f"padded rows {sorted(rows)} != live sequences {sorted(live)}"
        held = self.weight()
        assert held <= budget, f"padded weight {held} > budget {budget}"

    def state_bytes(self, allocated: bool = False) -> int:
        return self.batch.state_bytes(allocated)

    # ----- the step -------------------------------------------------------------------------------
    can_isolate = False  # every running row is in every step: a failed step fails them all
    prompt_logprobs = False  # prompts are prefilled keeping the last position's logits alone

    def forward(self, prefill: list[Work], decode: list[Work]) -> torch.Tensor:
        try:
            return self._forward(prefill, decode)
        except BaseException:
            self.batch.reset()  # the batch may be half-updated: its requests fail, and nothing stale stays
            raise

    @torch.inference_mode()
    def _forward(self, prefill: list[Work], decode: list[Work]) -> torch.Tensor:
        self.batch.compact()
        t0 = time.perf_counter()
        parts: list[torch.Tensor] = []
        new = None
        if prefill and self.cross is not None and all(w.n == w.seq.prompt_len for w in prefill):
            self._join(prefill)  # encoder only: the new rows' first decoder step is this step's
            prefill, decode = [], prefill + decode
        if prefill:
            logits, new = self._prefill(prefill)
            parts.append(logits)
        if decode:
            parts.append(self._decode(decode))
        elif self.batch.ids:
            raise RuntimeError("padded runner: running rows left out of a step")
        if new is not None:
            self.batch.merge(*new)
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        out = out.float()
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.model_s += time.perf_counter() - t0
        return out

    def _decode(self, decode: list[Work]) -> torch.Tensor:
        """One token for every row: its last token, or the decoder start token for a row that
        joined this step (its decoder is still empty)."""
        batch = self.batch
        if not batch.ids:
            raise RuntimeError("padded runner: decode without a running batch")
        where = {rid: i for i, rid in enumerate(batch.ids)}
        if len(decode) != len(batch.ids) or any(w.seq.id not in where for w in decode):
            raise RuntimeError("padded runner: the decode set differs from the running rows")
        tokens = [0] * len(batch.ids)
        for w in decode:
            i = where[w.seq.id]
            tokens[i] = w.seq.token_ids[w.start] if batch.pos[i] else self.start_id
        n = len(batch.ids)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        pos = torch.tensor(batch.pos, device=self.device)
        dec = batch.dec
        if dec.reserve_columns(1):
            batch.refresh()
        mask = dec.append_column(0, torch.ones(n, 1, dtype=torch.long, device=self.device))
        try:
            if self.seq2seq:
                enc = batch.enc
                out = self._run_decoder(ids, mask, pos, batch.cache, enc.view(1), enc.view(0))
            else:
                out = self.model(
                    input_ids=ids, attention_mask=mask, position_ids=pos[:, None], cache=batch.cache, use_cache=True
                )
        except BaseException:
            batch.refresh()  # the layers' windows went one column ahead: back to the batch's
            raise
        dec.advance(1)
        batch.refresh()
        batch.pos = [p + 1 for p in batch.pos]
        logits = out.logits[:, -1]
        order = torch.tensor([where[w.seq.id] for w in decode], device=self.device)
        return logits.index_select(0, order)

    def _encode(self, prefill: list[Work]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder states [N, S, d] and mask [N, S] of the prompts, right-padded."""
        prompts = [w.seq.token_ids[: w.seq.prompt_len] for w in prefill]
        s = max(map(len, prompts))
        enc_ids = torch.full((len(prompts), s), self.pad_id, dtype=torch.long)
        enc_mask = torch.zeros((len(prompts), s), dtype=torch.long)
        for i, p in enumerate(prompts):
            enc_ids[i, : len(p)] = torch.tensor(p)
            enc_mask[i, : len(p)] = 1
        enc_ids, enc_mask = enc_ids.to(self.device), enc_mask.to(self.device)
        return self.model.get_encoder()(input_ids=enc_ids, attention_mask=enc_mask).last_hidden_state, enc_mask

    def _join(self, prefill: list[Work]) -> None:
        """Fresh seq2seq rows join with their encoder states and cross K/V, and an empty decoder."""
        states, enc_mask = self._encode(prefill)
        kv = [t for project in self.cross for t in project(states)]
        empty = kv[0].new_zeros(len(prefill), kv[0].shape[1], 0, kv[0].shape[3])
        dec = [enc_mask.new_zeros(len(prefill), 0)] + [empty] * (2 * len(self.cross))
        self.batch.merge([w.seq.id for w in prefill], [[] for _ in prefill], dec, [enc_mask, states, *kv])

    def _prefill(self, prefill: list[Work]):
        for w in prefill:
            if w.start != 0 or not w.emits:
                raise RuntimeError("padded runner: prompts are prefilled whole (chunked prefill is off)")
        if self.seq2seq:
            return self._prefill_seq2seq(prefill)
        from transformers import DynamicCache

        feeds = [w.seq.token_ids[: w.n] for w in prefill]
        ids, mask = self._left_pad(feeds)
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=1
        )
        dec = [mask] + [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return out.logits[:, -1], ([w.seq.id for w in prefill], feeds, dec, None)

    def _prefill_seq2seq(self, prefill: list[Work]):
        from transformers import DynamicCache, EncoderDecoderCache

        states, enc_mask = self._encode(prefill)
        # The decoder starts from its start token; a readmitted request re-feeds what it generated.
        feeds = [[self.start_id, *w.seq.token_ids[w.seq.prompt_len : w.n]] for w in prefill]
        dec_ids, dec_mask = self._left_pad(feeds)
        starts = torch.tensor([len(f) - dec_ids.shape[1] for f in feeds], device=self.device)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        out = self._run_decoder(dec_ids, dec_mask, starts, cache, states, enc_mask)
        sa, ca = cache.self_attention_cache.layers, cache.cross_attention_cache.layers
        dec = [dec_mask] + [t for layer in sa for t in (layer.keys, layer.values)]
        enc = [enc_mask, states] + [t for layer in ca for t in (layer.keys, layer.values)]
        return out.logits[:, -1], ([w.seq.id for w in prefill], feeds, dec, enc)

    def _run_decoder(self, ids, mask, starts, cache, states, enc_mask):
        from transformers.modeling_outputs import BaseModelOutput

        if self.positions is not None:
            self.positions.start = starts
        try:
            return self.model(
                encoder_outputs=BaseModelOutput(last_hidden_state=states),
                attention_mask=enc_mask,
                decoder_input_ids=ids,
                decoder_attention_mask=mask,
                cache=cache,
                use_cache=True,
            )
        finally:
            if self.positions is not None:
                self.positions.start = None

    def _left_pad(self, feeds: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(map(len, feeds))
        ids = torch.full((len(feeds), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(feeds), n), dtype=torch.long)
        for i, f in enumerate(feeds):
            ids[i, n - len(f) :] = torch.tensor(f)
            mask[i, n - len(f) :] = 1
        return ids.to(self.device), mask.to(self.device)


@dataclass(slots=True, eq=False)
class _Probe:
    id: str
    token_ids: list[int]
    prompt_len: int


def measure_padded(runner: PaddedRunner, lm, rows: int = 4, length: int = 32, steps: int = 4) -> tuple[float, str]:
    """Bytes of memory per padded weight unit, measured on a short warm-up batch: the tensors the
    batch holds (caches, masks, encoder states) and, on CUDA, the peak allocation of its steps."""
    vocab = int(getattr(lm.model.config, "vocab_size", 0) or len(lm.tokenizer))
    probes = [_Probe(f"probe-{i}", [(31 * i + 7 * j + 3) % vocab for j in range(length)], length) for i in range(rows)]
    cuda = lm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(lm.device)
        base = torch.cuda.memory_allocated(lm.device)
        torch.cuda.reset_peak_memory_stats(lm.device)
    runner.forward([Work(p, 0, length, True) for p in probes], [])
    for _ in range(steps):
        for p in probes:
            p.token_ids.append(1)
        runner.forward([], [Work(p, len(p.token_ids) - 1, 1, True) for p in probes])
    weight, state = runner.weight(), runner.state_bytes()
    per_unit = state / weight
    how = f"warm-up of {rows} rows: {state} B held at weight {weight}"
    if cuda:
        peak = torch.cuda.max_memory_allocated(lm.device) - base
        per_unit = max(per_unit, peak / weight)
        how += f", peak {peak} B"
    for p in probes:
        runner.release(p)
    runner.model_s = 0.0
    return per_unit, how
