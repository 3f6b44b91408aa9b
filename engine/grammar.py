"""Grammar-constrained decoding (structured output) with xgrammar.

A request's `guided` spec (a JSON schema, any JSON object, or a regular expression) is compiled once
per distinct spec (cached) on the submitting thread, never the engine's; each request gets a matcher
that advances with every token it accepts. The sampler fills the step's token bitmasks and applies
them in one pass (`apply`). Generated JSON has no free whitespace (any_whitespace=False), so a
bounded schema bounds the output: it cannot run to max_new_tokens on spaces.

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

from .params import InvalidRequest

CACHE_SIZE = 256  # compiled grammars kept (a schema compiles in ~1-100 ms)


@dataclass(slots=True)
class Guide:
    """One request's grammar state."""

    matcher: Any  # xgrammar.GrammarMatcher
    banned: torch.Tensor | None  # token ids its output may never hold (JSON: control characters)

    def accept(self, token: int) -> None:
        self.matcher.accept_token(token)


class Grammars:
    """Compiles and caches grammars for one tokenizer and logits width; hands out guides."""

    def __init__(self, tokenizer, vocab_size: int, token_texts) -> None:
        self.tokenizer, self.vocab_size, self.token_texts = tokenizer, vocab_size, token_texts
        self._control: torch.Tensor | None = None
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # submissions come from many threads

    def guide(self, guided: tuple[str, str]) -> Guide:
        """A fresh guide for the spec; InvalidRequest("guided") for one that cannot compile."""
        matcher = _xgr().GrammarMatcher(self.compiled(guided))
        return Guide(matcher, self.control_tokens() if guided[0] != "regex" else None)

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
            compiler = self._compiler
        if compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            compiler = self._compiler = xgr.GrammarCompiler(info)
        kind, spec = guided
        try:
            if kind == "json_schema":
                grammar = compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "json_object":
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif kind == "regex":
                grammar = compiler.compile_regex(spec)
            else:
                raise InvalidRequest("guided", f"unknown kind {kind!r}")  # the contract admits none
        except (RuntimeError, ValueError, TypeError) as e:
            message = str(e).split("\n")[0]
            raise InvalidRequest(
                "guided", f"the {kind.replace('_', ' ')} cannot be compiled: {message[:300]}"
            ) from None
        with self._lock:
            self._cache[guided] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def apply(logits: torch.Tensor, guides: list[tuple[int, Guide]]) -> None:
    """Mask every row's tokens its grammar forbids (-inf), in place: (row, guide) pairs."""
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(len(guides), logits.shape[-1])
    for j, (_, guide) in enumerate(guides):
        guide.matcher.fill_next_token_bitmask(bitmask, j)
    rows = [i for i, _ in guides]
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask)
    for j, (_, guide) in enumerate(guides):
        if guide.banned is not None and len(guide.banned):
            sub[j, guide.banned] = float("-inf")
    logits[rows] = sub


def available() -> bool:
    try:
        _xgr()
    except InvalidRequest:
        return False
    return True


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest(
            "guided",
            "structured output needs xgrammar on the worker: "
            "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2",
        ) from None
    return xgrammar
