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

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..params import GREEDY_BELOW, SamplingParams
from . import grammar


class Sampled(Protocol):
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    prompt_len: int
    grammar: Any  # a grammar.Guide (structured output), or None
    extras: RowExtras | None  # its logit bias, min_tokens and penalties as tensors (made at its first step)


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
        rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
        if rows:
            out[rows] = _draw(logits[rows], [seqs[i] for i in rows], default_generator)
    tokens = out.tolist()
    return tokens, _logprobs(raw, seqs, out)


def _adjust(logits: torch.Tensor, seqs: list[Sampled], eos: frozenset[int]) -> None:
    """Grammars, logit bias, min_tokens, and the three penalties, in place. The rows that ask carry
    their extras as dense vectors kept up to date a token at a time (RowExtras), so a step applies
    them in a few tensor operations over those rows (no Python loop over a bias, a prompt or an
    output): a request with every extra costs its neighbours little (bench.hostile)."""
    params = [s.params for s in seqs]
    guided = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
    if guided:
        grammar.apply(logits, guided)
    rows = [i for i, p in enumerate(params) if p.logit_bias or p.min_tokens or _penalised(p)]
    if not rows:
        return
    extras = [_extras(seqs[i], logits, eos) for i in rows]
    at = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, at)
    if any(x.before is not None for x in extras):  # logit bias, and -inf on what min_tokens holds back
        sub += torch.stack([x.before if x.before is not None else x.zeros() for x in extras])
    rep = [j for j, x in enumerate(extras) if x.seen is not None]
    if rep:  # transformers' rule: a seen token's logit is divided by the penalty if positive, else multiplied
        pen = torch.tensor([params[rows[j]].repetition_penalty for j in rep], dtype=logits.dtype, device=logits.device)
        part = sub[rep]
        factor = torch.where(part < 0, pen[:, None], 1 / pen[:, None])
        sub[rep] = torch.where(torch.stack([extras[j].seen for j in rep]), part * factor, part)
    if any(x.after is not None for x in extras):  # frequency and presence: OpenAI's, over the output
        sub -= torch.stack([x.after if x.after is not None else x.zeros() for x in extras])
    logits.index_copy_(0, at, sub)


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty or p.presence_penalty)


@dataclass(slots=True, eq=False)
class RowExtras:
    """One sequence's sampling extras as dense vectors over the vocabulary, on the logits' device:
    built at its first step, then kept up to date with one or two element writes per token."""

    before: torch.Tensor | None  # added before the penalties: logit bias, -inf on held-back ids
    seen: torch.Tensor | None  # bool: in the prompt or the output (repetition penalty)
    after: torch.Tensor | None  # subtracted last: count x frequency + (count > 0) x presence
    bias: dict[int, float]  # the logit bias, to restore held-back ids when min_tokens is reached
    held: list[int]  # the ids min_tokens holds back (stop ids, and EOS unless ignored)
    counts: dict[int, int] = field(default_factory=dict)  # output token -> times
    upto: int = 0  # the tokens of token_ids before this are counted
    holding: bool = False

    def zeros(self) -> torch.Tensor:
        ref = next(t for t in (self.before, self.after) if t is not None)
        return torch.zeros_like(ref)


def _extras(s: Sampled, logits: torch.Tensor, eos: frozenset[int]) -> RowExtras:
    p, x = s.params, s.extras
    if x is None:
        dev, vocab, dtype = logits.device, logits.shape[-1], logits.dtype
        held = [t for t in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos)) if t < vocab]
        held = held if p.min_tokens else []
        before = None
        if p.logit_bias or held:
            before = torch.zeros(vocab, dtype=dtype, device=dev)
            if p.logit_bias:
                before[torch.tensor([t for t, _ in p.logit_bias])] = torch.tensor(
                    [v for _, v in p.logit_bias], dtype=dtype
                )
        x = s.extras = RowExtras(
            before,
            torch.zeros(vocab, dtype=torch.bool, device=dev) if p.repetition_penalty != 1.0 else None,
            torch.zeros(vocab, dtype=dtype, device=dev) if p.frequency_penalty or p.presence_penalty else None,
            dict(p.logit_bias),
            held,
        )
    new = s.token_ids[x.upto :]
    if x.seen is not None and new:
        x.seen[new[0] if len(new) == 1 else torch.tensor(new)] = True
    if x.after is not None:
        for t in new[max(0, s.prompt_len - x.upto) :]:  # a step's one token (a resumed run's output once)
            n = x.counts[t] = x.counts.get(t, 0) + 1
            x.after[t] = n * p.frequency_penalty + p.presence_penalty
    x.upto = len(s.token_ids)
    holding = len(s.token_ids) - s.prompt_len < p.min_tokens and bool(x.held)
    if holding != x.holding and x.before is not None:  # min_tokens: held back, then released
        x.holding = holding
        x.before[torch.tensor(x.held)] = torch.tensor(
            [float("-inf") if holding else x.bias.get(t, 0.0) for t in x.held], dtype=x.before.dtype
        )
    return x


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
