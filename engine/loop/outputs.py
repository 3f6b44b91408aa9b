"""The output side of an engine step: sampled tokens become text, events and finishes.

A synchronous runner accepts a step's tokens at once (`accept_all`); an asynchronous one (CUDA, the
simulated device) records them and retires the requests they end at once, so the next plan is exact,
and leaves their text and events (`Deferred`) to `finish_deferred`, which runs while the device
computes the next step. Log-probabilities get their tokens' texts here, in one cached pass per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..params import Event, FinishEvent, FinishReason, InvalidRequest, TokenEvent, TokenLogprobs
from ..sampling.sampler import RowLogprobs
from ..sequence import Sequence
from ..text.detokenizer import TokenTexts, push_many

if TYPE_CHECKING:
    from ..model import LoadedModel

PROMPT_LOGPROB_ROWS = 256  # prompt positions whose log_softmax is taken at once


@dataclass(slots=True)
class Deferred:
    """A sampled token whose text and event wait for the next forward (an asynchronous device)."""

    seq: Sequence
    token: int
    index: int
    has_text: bool  # False: an EOS or stop id, which ends its request without text
    reason: FinishReason | None  # the request ends here (already retired from the batcher)
    logprobs: TokenLogprobs | None = None


class StepOutputs:
    """The engine's output side, composed into it: `emit` sends an event to the sink and the
    request's handle, `retire` takes a request out of the batcher and the pool, `finish` does both
    (the engine's, so a finish anywhere goes the same way)."""

    def __init__(
        self,
        lm: LoadedModel,
        token_texts: TokenTexts,
        emit: Callable[[Event], None],
        retire: Callable[[Sequence, FinishReason], None],
        finish: Callable[..., None],
    ) -> None:
        self.lm = lm
        self.token_texts = token_texts
        self._emit, self._retire, self._finish = emit, retire, finish
        # An asynchronous device's step leaves its text and events here, done during the next forward.
        self.deferred: list[list[Deferred]] = []

    def logprobs(self, tokens: list[int], rows: list[RowLogprobs | None]) -> list[TokenLogprobs | None]:
        """The sampler's figures with each token's text (one cached decode pass for the step)."""
        ids = [t for t, r in zip(tokens, rows, strict=True) if r is not None]
        for r in rows:
            if r is not None:
                ids += r.top_ids
        texts = iter(self.token_texts(ids))
        chosen = {i: next(texts) for i, r in enumerate(rows) if r is not None}
        out: list[TokenLogprobs | None] = [None] * len(rows)
        for i, r in enumerate(rows):
            if r is not None:
                top = tuple(next(texts) for _ in r.top_ids)
                out[i] = TokenLogprobs(chosen[i], r.logprob, r.top_ids, top, r.top_logprobs)
        return out

    def prompt_logprobs(self, rows: list[tuple[Sequence, int, torch.Tensor]]) -> dict[str, str]:
        """Log-probabilities of prompt tokens from a step's prompt rows (row i of a chunk starting at
        position p predicts token p + i + 1), PROMPT_LOGPROB_ROWS rows at a time (the prefill cap's
        rows over a large vocabulary are gigabytes at once). Returns the sequences whose rows failed
        (out of memory, most likely), with why: they end with an error once the step is sampled,
        while the step and the others go on. A prompt prefilled again (after a preemption) adds nothing."""
        failed: dict[str, str] = {}
        for seq, first, logits in rows:
            # rows past the prompt (a preempted or resumed request prefills its output too) predict output
            logits = logits[: max(0, seq.prompt_len - 1 - first)]
            for at in range(0, len(logits), PROMPT_LOGPROB_ROWS):
                try:
                    self._prompt_rows(seq, first + at, logits[at : at + PROMPT_LOGPROB_ROWS])
                except Exception as e:
                    failed[seq.id] = f"prompt_logprobs: could not be computed ({e!r:.200})"
                    break
        return failed

    def _prompt_rows(self, seq: Sequence, first: int, logits: torch.Tensor) -> None:
        have = seq.prompt_logprobs
        if not have:  # the first token: nothing predicts it
            have.append(TokenLogprobs(self.token_texts(seq.token_ids[:1])[0], None))
        skip = len(have) - (first + 1)  # rows already recorded
        if skip >= len(logits):
            return
        logits = logits[max(skip, 0) :]
        first += max(skip, 0)
        targets = seq.token_ids[first + 1 : first + 1 + len(logits)]
        lp = logits.log_softmax(-1)
        chosen = lp.gather(1, torch.tensor(targets)[:, None]).squeeze(1).tolist()
        k = seq.params.prompt_logprobs or 0
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        vals, ids = top_vals.tolist(), top_ids.tolist()
        texts = iter(self.token_texts(targets + [i for row in ids for i in row]))
        names = [next(texts) for _ in targets]
        for j, tok_text in enumerate(names):
            tops = tuple(next(texts) for _ in ids[j])
            have.append(TokenLogprobs(tok_text, chosen[j], tuple(ids[j]), tops, tuple(vals[j])))

    def drop_failed(
        self, seqs: dict[str, Sequence], emitted: list[Sequence], tokens: list[int], rows: list | None, failed: dict
    ) -> tuple:
        """After sampling: each guided sequence's matcher takes its token before the next step fills
        its mask, and one whose token the grammar does not take (its mask left nothing to draw) fails,
        never going on with text outside the grammar; the sequences in `failed` (id -> why: their
        prompt log-probabilities) fail too. Failures end with an error; returns the step's
        (sequences, tokens, logprob rows) that go on."""
        for seq, tok in zip(emitted, tokens, strict=True):
            if seq.grammar is not None and not seq.grammar.accept(tok):
                failed[seq.id] = "guided: the grammar cannot go on with any token of this model's vocabulary"
        if not failed:
            return emitted, tokens, rows
        for rid, message in failed.items():
            if rid in seqs:
                self._finish(seqs[rid], "error", message)
        keep = [i for i, seq in enumerate(emitted) if seq.id not in failed]
        return [emitted[i] for i in keep], [tokens[i] for i in keep], None if rows is None else [rows[i] for i in keep]

    def accept_all(
        self, emitted: list[Sequence], tokens: list[int], done: float, lps: list[TokenLogprobs | None]
    ) -> None:
        """Detokenize and report a step's tokens now: one detokenizer pass for every token that has
        text; None marks an EOS or stop id that ends its request."""
        eos = self.lm.eos_token_ids
        texting = [i for i, (s, t) in enumerate(zip(emitted, tokens, strict=True)) if _has_text(s, t, eos)]
        deltas: list[str | None] = [None] * len(emitted)
        pieces = push_many([emitted[i].detok for i in texting], [tokens[i] for i in texting])
        for i, piece in zip(texting, pieces, strict=True):
            deltas[i] = piece
        for seq, tok, delta, lp in zip(emitted, tokens, deltas, lps, strict=True):
            self._accept(seq, tok, delta, done, lp)

    def defer(self, emitted: list[Sequence], tokens: list[int], done: float, lps: list[TokenLogprobs | None]) -> None:
        """An asynchronous device: record the step's tokens and retire the requests they end (so the
        next step's plan is exact), and leave their text and events to `finish_deferred`, which runs
        while the device computes the next step. Requests with stop strings need their text to know
        whether they end: they are detokenized now."""
        eos = self.lm.eos_token_ids
        now_seqs, now_tokens, now_lps, later = [], [], [], []
        for seq, tok, lp in zip(emitted, tokens, lps, strict=True):
            params = seq.params
            if params.stop:
                now_seqs.append(seq)
                now_tokens.append(tok)
                now_lps.append(lp)
                continue
            req = _record(seq, tok, lp, done)
            reason: FinishReason | None = None
            if tok in params.stop_token_ids:
                reason = "stop"
            elif tok in eos and not params.ignore_eos:
                reason = "eos"
            elif req.generated >= req.max_new_tokens:
                reason = "length"
            if reason is not None:
                self._retire(seq, reason)
            later.append(Deferred(seq, tok, req.generated - 1, reason is None or reason == "length", reason, lp))
        if now_seqs:
            self.accept_all(now_seqs, now_tokens, done, now_lps)
        if later:
            self.deferred.append(later)

    def finish_deferred(self) -> None:
        """Text and events of deferred steps, in order (before any other event of their requests)."""
        while self.deferred:
            batch = self.deferred.pop(0)
            texting = [d for d in batch if d.has_text]
            pieces = iter(push_many([d.seq.detok for d in texting], [d.token for d in texting]))
            for d in batch:
                seq = d.seq
                piece = next(pieces) if d.has_text else ""
                if d.reason is not None:
                    piece += seq.detok.flush()
                seq.text += piece
                self._emit(TokenEvent(seq.id, d.index, d.token, piece, d.logprobs))
                if d.reason is not None:
                    self._emit(self.finish_event(seq, d.reason))

    def _accept(
        self, seq: Sequence, token: int, delta: str | None, now: float, lp: TokenLogprobs | None = None
    ) -> None:
        """Record a sampled token; `delta` is its new text, None for an EOS or stop id that ends the request."""
        req = _record(seq, token, lp, now)
        piece, reason = _settle(seq, token, delta)
        self._emit(TokenEvent(seq.id, req.generated - 1, token, piece, lp))
        if reason is not None:
            self._finish(seq, reason)

    def finish_event(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> FinishEvent:
        now = time.monotonic()
        out = seq.output_ids
        return FinishEvent(
            seq.id,
            reason,
            seq.text,
            tuple(out),
            seq.prompt_len,
            len(out),
            queue_s=(seq.admitted_s or now) - seq.submitted_s,
            ttft_s=(seq.first_token_s - seq.submitted_s) if seq.first_token_s else 0.0,
            total_s=now - seq.submitted_s,
            error=error,
            logprobs=tuple(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=tuple(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            prompt_token_ids=tuple(seq.token_ids[: seq.prompt_len]) if seq.params.prompt_logprobs is not None else None,
            cached_tokens=seq.sched.cached_tokens,
        )


def _record(seq: Sequence, token: int, lp: TokenLogprobs | None, now: float):
    """Append a sampled token (and its log-probabilities); returns the request's batcher view."""
    seq.token_ids.append(token)
    if lp is not None:
        seq.logprobs.append(lp)
    if not seq.first_token_s:  # this run's first token (a resumed request's first new one)
        seq.first_token_s = now
    return seq.sched


def _has_text(seq: Sequence, token: int, eos: frozenset[int]) -> bool:
    """False for an EOS or stop id, which ends its request without text."""
    return (token not in eos or seq.params.ignore_eos) and token not in seq.params.stop_token_ids


def _settle(seq: Sequence, token: int, delta: str | None) -> tuple[str, FinishReason | None]:
    """The text a recorded token adds to the output (stop strings held back or cut) and the reason it
    ends the request, if it does; `delta` is its detokenized text, None for an EOS or stop id."""
    reason: FinishReason | None = None
    if delta is None:
        reason, piece = ("stop" if token in seq.params.stop_token_ids else "eos"), ""
    else:
        piece, stopped = seq.stopper.feed(delta)
        if stopped:
            reason = "stop"
        elif seq.sched.generated >= seq.sched.max_new_tokens:
            reason = "length"
    if reason in ("eos", "length") or (reason == "stop" and delta is None):
        tail, stopped = seq.stopper.feed(seq.detok.flush())
        piece += tail
        if stopped:
            reason = "stop"
        else:
            piece += seq.stopper.flush()
    seq.text += piece
    return piece, reason


def replay(seq: Sequence, emitted: list[int], logprobs: list[TokenLogprobs] | None, eos: frozenset[int]):
    """A resumed request: the tokens an earlier run of it emitted (and streamed) become its output so
    far, as if it had just sampled them, with no events (readers have them): its text, stop matcher,
    grammar and counts continue from there, and the batcher prefills them with the prompt. Returns
    the reason they already end it, if they do (its end entry was all the earlier run missed)."""
    reason: FinishReason | None = None
    for i, token in enumerate(emitted):
        if reason is not None or seq.sched.generated >= seq.sched.max_new_tokens:
            raise InvalidRequest("emitted", f"{len(emitted)} tokens run past the end of the output (at {i})")
        if seq.grammar is not None and not seq.grammar.accept(token):
            raise InvalidRequest("emitted", f"token {token} (at {i}) is outside the request's grammar")
        seq.sched.generated += 1
        _record(seq, token, logprobs[i] if logprobs else None, 0.0)
        delta = seq.detok.push(token) if _has_text(seq, token, eos) else None
        reason = _settle(seq, token, delta)[1]
    return reason
