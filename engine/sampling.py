"""Sampling for every emitting sequence of a step at once.

Order as in transformers' generate: repetition penalty, temperature, top-k, top-p. Each row
draws one uniform number — from its own generator when seeded — and picks its token by inverse
CDF, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .params import SamplingParams


class Sampled(Protocol):
    params: SamplingParams
    token_ids: list[int]
    generator: torch.Generator | None


def sample(logits: torch.Tensor, seqs: list[Sampled], default_generator: torch.Generator) -> list[int]:
    """One token per row of `logits` ([rows, vocab], float32)."""
    params = [s.params for s in seqs]
    if all(p.temperature == 0 and p.repetition_penalty == 1.0 for p in params):
        return logits.argmax(-1).tolist()
    logits = logits.clone()
    pen_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if pen_rows:
        _apply_repetition_penalty(logits, [seqs[i] for i in pen_rows], pen_rows)
    out = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        sub = logits[rows]
        temp = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype)
        sub = sub / temp[:, None]
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        vocab = sub.shape[-1]
        top_k = torch.tensor([params[i].top_k or vocab for i in rows])
        ranks = torch.arange(vocab)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(-1)
        top_p = torch.tensor([params[i].top_p for i in rows], dtype=probs.dtype)
        if (top_p < 1).any():
            before = probs.cumsum(-1) - probs  # mass of strictly better tokens
            probs = probs.masked_fill((before >= top_p[:, None]) & (ranks > 0), 0.0)
        cdf = probs.cumsum(-1)
        u = torch.rand(len(rows), generator=default_generator, dtype=cdf.dtype)
        for j, i in enumerate(rows):
            gen = seqs[i].generator
            if gen is not None:
                u[j] = torch.rand(1, generator=gen, dtype=cdf.dtype)[0]
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=vocab - 1)
        out[rows] = order.gather(1, pick).squeeze(1)
    return out.tolist()


def _apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sampled], rows: list[int]) -> None:
    """transformers' rule: a seen token's logit is divided by the penalty if positive, else multiplied."""
    longest = max(len(s.token_ids) for s in seqs)
    ids = torch.tensor([s.token_ids + [s.token_ids[0]] * (longest - len(s.token_ids)) for s in seqs])
    row_t = torch.tensor(rows)
    pen = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=logits.dtype)[:, None]
    sub = logits[row_t]
    seen = sub.gather(1, ids)
    sub.scatter_(1, ids, torch.where(seen < 0, seen * pen, seen / pen))
    logits[row_t] = sub
