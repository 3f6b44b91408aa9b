"""Sampling for every emitting sequence of a step at once.

Order as vLLM applies it: the grammar's token mask (structured output), logit bias and min_tokens,
then the repetition (transformers' rule, over prompt and output), frequency and presence penalties
(OpenAI's rule, over the output), temperature, top-k, top-p. Each row draws one uniform number and
picks its token by inverse CDF. A seeded request's number is a hash of (seed, output index), not a
draw from a generator: it samples the same tokens whatever else is in the batch, and a run resumed
after k tokens (another worker, after a crash) continues exactly where an uninterrupted run would,
with nothing to replay.

Log-probabilities are the model's own: log_softmax of the raw logits, before any of the above (as
vLLM reports them by default), for the rows that ask, in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import grammar
from .params import SamplingParams


class Sampled(Protocol):
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    prompt_len: int
    grammar: Any  # a grammar.Guide (structured output), or None


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """A sampled token's log-probability and the `k` most likely tokens' (ids and values, best first)."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def sample(
    logits: torch.Tensor, seqs: list[Sampled], default_generator: torch.Generator, eos: frozenset[int] = frozenset()
) -> tuple[list[int], list[RowLogprobs | None] | None]:
    """One token per row of `logits` ([rows, vocab], float32), and the log-probabilities of the rows
    whose request asks for them (None when none does). `eos`: the ids min_tokens holds back."""
    params = [s.params for s in seqs]
    raw = logits
    if all(p.plain_greedy for p in params):
        out = logits.argmax(-1)
    else:
        logits = logits.clone()
        _adjust(logits, seqs, eos)
        out = logits.argmax(-1)
        rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if rows:
            out[rows] = _draw(logits[rows], [seqs[i] for i in rows], default_generator)
    tokens = out.tolist()
    return tokens, _logprobs(raw, seqs, out)


def _adjust(logits: torch.Tensor, seqs: list[Sampled], eos: frozenset[int]) -> None:
    """Grammars, logit bias, min_tokens, and the three penalties, in place."""
    params = [s.params for s in seqs]
    guided = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
    if guided:
        grammar.apply(logits, guided)
    bias_rows, bias_ids, bias_vals = [], [], []
    for i, p in enumerate(params):
        for tok, val in p.logit_bias:
            bias_rows.append(i)
            bias_ids.append(tok)
            bias_vals.append(val)
    if bias_rows:
        logits.index_put_(
            (torch.tensor(bias_rows), torch.tensor(bias_ids)),
            torch.tensor(bias_vals, dtype=logits.dtype),
            accumulate=True,
        )
    held_rows, held_ids = [], []
    for i, (s, p) in enumerate(zip(seqs, params, strict=True)):
        if p.min_tokens and len(s.token_ids) - s.prompt_len < p.min_tokens:
            ends = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
            held_rows += [i] * len(ends)
            held_ids += sorted(ends)
    if held_rows:
        logits[torch.tensor(held_rows), torch.tensor(held_ids)] = float("-inf")
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        _repetition_penalty(logits, [seqs[i] for i in rep], rep)
    pen = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if pen:
        _frequency_presence(logits, [seqs[i] for i in pen], pen)


def _draw(logits: torch.Tensor, seqs: list[Sampled], default_generator: torch.Generator) -> torch.Tensor:
    params = [s.params for s in seqs]
    temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    sub = logits / temp[:, None]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    vocab = sub.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params])
    ranks = torch.arange(vocab)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    if (top_p < 1).any():
        before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        probs = probs.masked_fill((before >= top_p[:, None]) & (ranks > 0), 0.0)
    cdf = probs.cumsum(-1)
    u = torch.rand(len(seqs), generator=default_generator, dtype=cdf.dtype)
    for j, s in enumerate(seqs):
        if s.params.seed is not None:
            u[j] = seeded_uniform(s.params.seed, len(s.token_ids) - s.prompt_len)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=vocab - 1)
    return order.gather(1, pick).squeeze(1)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers whose outputs look independent."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) a request seeded `seed` draws for its output token `index`: 24
    bits (exact in float32) of a counter-based hash, the same on every device, process and resume."""
    return (_mix64(_mix64(seed & _MASK64) ^ index) >> 40) / (1 << 24)


def _logprobs(raw: torch.Tensor, seqs: list[Sampled], tokens: torch.Tensor) -> list[RowLogprobs | None] | None:
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    lp = raw[rows].float().log_softmax(-1)
    chosen = lp.gather(1, tokens[rows][:, None]).squeeze(1).tolist()
    k = max(seqs[i].params.logprobs or 0 for i in rows)
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    vals, ids = top_vals.tolist(), top_ids.tolist()
    out: list[RowLogprobs | None] = [None] * len(seqs)
    for j, i in enumerate(rows):
        n = seqs[i].params.logprobs or 0
        out[i] = RowLogprobs(chosen[j], tuple(ids[j][:n]), tuple(vals[j][:n]))
    return out


def _output_ids(seqs: list[Sampled]) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, longest] output token ids, padded with 0, and the mask of real ones."""
    spans = [s.token_ids[s.prompt_len :] for s in seqs]
    longest = max(1, max(len(x) for x in spans))
    ids = torch.tensor([x + [0] * (longest - len(x)) for x in spans])
    mask = torch.tensor([[1.0] * len(x) + [0.0] * (longest - len(x)) for x in spans])
    return ids, mask


def _repetition_penalty(logits: torch.Tensor, seqs: list[Sampled], rows: list[int]) -> None:
    """transformers' rule: a seen token's logit is divided by the penalty if positive, else multiplied.
    Rows are padded with their own first token: a repeated index writes the same value."""
    longest = max(len(s.token_ids) for s in seqs)
    ids = torch.tensor([s.token_ids + [s.token_ids[0]] * (longest - len(s.token_ids)) for s in seqs])
    row_t = torch.tensor(rows)
    pen = torch.tensor([s.params.repetition_penalty for s in seqs], dtype=logits.dtype)[:, None]
    sub = logits[row_t]
    seen = sub.gather(1, ids)
    sub.scatter_(1, ids, torch.where(seen < 0, seen * pen, seen / pen))
    logits[row_t] = sub


def _frequency_presence(logits: torch.Tensor, seqs: list[Sampled], rows: list[int]) -> None:
    """OpenAI's rule, over the output so far: logit -= count * frequency + (count > 0) * presence."""
    ids, mask = _output_ids(seqs)
    counts = torch.zeros(len(seqs), logits.shape[-1], dtype=logits.dtype).scatter_add_(1, ids, mask.to(logits.dtype))
    freq = torch.tensor([s.params.frequency_penalty for s in seqs], dtype=logits.dtype)[:, None]
    pres = torch.tensor([s.params.presence_penalty for s in seqs], dtype=logits.dtype)[:, None]
    row_t = torch.tensor(rows)
    logits[row_t] -= counts * freq + (counts > 0).to(logits.dtype) * pres
