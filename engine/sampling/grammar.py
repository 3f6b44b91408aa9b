"""Grammar-constrained decoding (structured output) with xgrammar.

A request's `guided` spec (a JSON schema, any JSON object, or a regular expression) is compiled once
per distinct spec (cached), first in a trial process under a deadline and a memory limit
(grammar_trial.py), then on the engine's grammar thread, never its loop or its command thread; each
request gets a matcher that advances with every token it accepts, and a token it does not accept (a
mask that left nothing) ends the request with an error rather than text outside the grammar. The
sampler fills the step's token bitmasks and applies them in one pass (`apply`). Generated JSON has no
free whitespace (any_whitespace=False), so a bounded schema bounds the output: it cannot run to
max_new_tokens on spaces.

xgrammar's JSON string rule excludes only the quote, the backslash, CR and LF, so a byte-level vocabulary's control
characters (U+0000-U+001F) could appear raw inside a string, which RFC 8259 forbids and strict
parsers refuse (seen with the tiny model). JSON grammars also mask every token containing one; with
no free whitespace, valid JSON never needs them.

xgrammar is an optional dependency: its wheel requires triton (about 1 GB) on Linux, which only its
CUDA kernel uses, so `make` installs it without dependencies (see the Makefile).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..params import InvalidRequest
from .grammar_spec import GrammarError, available, compile_spec, xgrammar

CACHE_SIZE = 256  # compiled grammars kept (a compile costs far more than a lookup) ...
CACHE_BYTES = 256 * 2**20  # ... and at most this much of them (xgrammar's own cache is off)
REFUSED_SIZE = 1024  # specs refused lately: sent again, refused at once, not compiled again


@dataclass(slots=True)
class Guide:
    """One request's grammar state."""

    matcher: Any  # xgrammar.GrammarMatcher
    banned: torch.Tensor | None  # token ids its output may never hold (JSON: control characters)
    dead: bool = False  # its last mask left no token at all (apply): the request cannot go on

    def accept(self, token: int) -> bool:
        """False for a token the grammar does not allow (then the request ends with an error)."""
        return not self.dead and self.matcher.accept_token(token)


class Grammars:
    """Compiles and caches grammars for one tokenizer and logits width; hands out guides.

    A spec not seen before is compiled first by the trial process (grammar_trial.py: refused past
    `timeout_s` or `memory_mb`), then here, on the caller's thread (the engine's grammar thread, never
    its loop); the compiled grammar is cached (CACHE_SIZE, CACHE_BYTES) and a refused spec is
    remembered (REFUSED_SIZE). A grammar that no text satisfies (its first mask allows no token, not
    even the end) is refused: it could only end in text outside it."""

    def __init__(self, tokenizer, vocab_size: int, token_texts, *, timeout_s: float = 0.0, memory_mb: int = 0) -> None:
        self.tokenizer, self.vocab_size, self.token_texts = tokenizer, vocab_size, token_texts
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.available = available()  # xgrammar installed: `guided` can be served (workers advertise it)
        self._control: torch.Tensor | None = None
        self._compiler: Any = None
        self._trial: Any = None  # a GrammarTrial once a spec needs one (timeout_s > 0)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_bytes = 0
        self._refused: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()  # submissions come from many threads

    def guide(self, guided: tuple[str, str]) -> Guide:
        """A fresh guide for the spec; InvalidRequest("guided") for one that cannot compile."""
        matcher = xgrammar().GrammarMatcher(self.compiled(guided))
        return Guide(matcher, self.control_tokens() if guided[0] != "regex" else None)

    def ready(self, guided: tuple[str, str]) -> bool:
        """Compiled (or refused) already: guide() answers at once."""
        with self._lock:
            return guided in self._cache or guided in self._refused

    def control_tokens(self) -> torch.Tensor:
        if self._control is None:
            texts = self.token_texts(list(range(self.vocab_size)))
            self._control = torch.tensor([i for i, t in enumerate(texts) if any(c < " " for c in t)], dtype=torch.long)
        return self._control

    def compiled(self, guided: tuple[str, str]) -> Any:
        with self._lock:
            hit = self._cache.get(guided)
            if hit is not None:
                self._cache.move_to_end(guided)
                return hit
            refused = self._refused.get(guided)
        if refused is None:
            try:
                grammar = self._compile(guided)
            except GrammarError as e:
                refused = str(e)
        with self._lock:
            if refused is not None:
                self._refused[guided] = refused
                while len(self._refused) > REFUSED_SIZE:
                    self._refused.popitem(last=False)
                raise InvalidRequest("guided", refused)
            self._keep(guided, grammar)
        return grammar

    def close(self) -> None:
        if self._trial is not None:
            self._trial.close()

    def _compile(self, guided: tuple[str, str]) -> Any:
        """The spec compiled, tried first in the trial process; GrammarError if it cannot be, in time
        and memory, or if no text satisfies it."""
        xgr = xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            if self.timeout_s > 0:
                from .grammar_trial import GrammarTrial

                self._trial = GrammarTrial(info.serialize_json(), self.timeout_s, self.memory_mb)
        kind, spec = guided
        if self._trial is not None and (problem := self._trial.check(kind, spec)) is not None:
            raise GrammarError(problem)
        grammar = compile_spec(self._compiler, kind, spec)
        first = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(first, 0)
        if not first.any():
            raise GrammarError(f"no text matches the {kind.replace('_', ' ')}: its language is empty")
        return grammar

    def _keep(self, guided: tuple[str, str], grammar: Any) -> None:
        size = int(grammar.memory_size_bytes)
        self._cache[guided] = grammar
        self._cache_bytes += size
        while len(self._cache) > CACHE_SIZE or (self._cache_bytes > CACHE_BYTES and len(self._cache) > 1):
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= int(old.memory_size_bytes)


def apply(logits: torch.Tensor, guides: list[tuple[int, Guide]]) -> None:
    """Mask every row's tokens its grammar forbids (-inf), in place: (row, guide) pairs."""
    xgr = xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(guides), logits.shape[-1])
    for j, (_, guide) in enumerate(guides):
        guide.matcher.fill_next_token_bitmask(bitmask, j)
    rows = [i for i, _ in guides]
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask)
    for j, (_, guide) in enumerate(guides):
        if guide.banned is not None and len(guide.banned):
            sub[j, guide.banned] = float("-inf")
    for j in (~torch.isfinite(sub).any(-1)).nonzero().flatten().tolist():
        guides[j][1].dead = True  # every token masked: whatever is drawn would leave the grammar
    logits[rows] = sub
