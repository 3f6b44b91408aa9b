"""Incremental detokenization and stop sequences.

Byte-level tokenizers split multi-byte characters across tokens, and decoding a token alone can
yield half a character. The detokenizer decodes a small window of recent tokens and only releases
text once it no longer ends in an incomplete character (U+FFFD), so every delta is whole
characters and the deltas concatenate to the full decode (the approach of TGI and vLLM).
Text that could be the start of a stop sequence is held back until it is known not to be one, so
the stream never shows text that the final result excludes.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start: decoding from here gives context for the next token
        self._read = 0  # tokens before this have been released as text

    def push(self, token_id: int) -> str:
        return push_many([self], [token_id])[0]

    def _windows(self) -> tuple[list[int], list[int]]:
        return self.ids[self._prefix : self._read], self.ids[self._prefix :]

    def _advance(self, prefix_text: str, new_text: str) -> str:
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (e.g. a character cut off by the end of generation)."""
        old, new = (decode_many(self.tokenizer, list(w)) for w in zip(self._windows(), strict=True))
        self._prefix = self._read = len(self.ids)
        return new[0][len(old[0]) :]


def decode_many(tokenizer, windows: list[list[int]]) -> list[str]:
    """Decode several id lists, straight through the Rust tokenizer when there is one: its Python
    wrapper costs several times the decode itself, and its parallel batch decode more still."""
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is not None and hasattr(rust, "decode"):
        decode = rust.decode
        return [decode(w, skip_special_tokens=True) for w in windows]
    return [tokenizer.decode(w, skip_special_tokens=True) for w in windows]


def push_many(detoks: list[IncrementalDetokenizer], tokens: list[int]) -> list[str]:
    """Push one token into each detokenizer (all of one tokenizer); returns each new text."""
    if not detoks:
        return []
    windows: list[list[int]] = []
    for d, t in zip(detoks, tokens, strict=True):
        d.ids.append(t)
        windows.extend(d._windows())
    texts = decode_many(detoks[0].tokenizer, windows)
    return [d._advance(texts[2 * i], texts[2 * i + 1]) for i, d in enumerate(detoks)]


class StopMatcher:
    """Finds stop sequences in streamed text; `feed` returns (text safe to emit, stopped).

    One KMP matcher per stop sequence, advanced a character at a time: a stop's state is the length
    of the longest suffix of the text that begins it, so the text to hold back is the longest state,
    and a character costs only the stops it continues or begins. Memory is one failure table per
    stop (32 stops of 256 characters: 8,192 small integers), where every prefix of every stop, kept
    as a string, would be a megabyte a request."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._fail = [_failure(s) for s in stops]
        self._starting: dict[str, list[int]] = {}  # first character -> the stops it begins
        for i, stop in enumerate(stops):
            self._starting.setdefault(stop[0], []).append(i)
        self._state: dict[int, int] = {}  # stop index -> characters of it matched (only > 0)
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        text = self.pending + delta
        state, stops, fail = self._state, self.stops, self._fail
        cut = len(text)  # the earliest start of a stop found in this text (as text.find would give)
        for end, c in enumerate(delta, len(self.pending) + 1):  # `end`: the text's length through c
            starting = self._starting.get(c)
            if not state and starting is None:
                continue  # most characters: no stop under way, none begins here
            for i in [*state, *(j for j in starting or () if j not in state)]:
                stop, k = stops[i], state.get(i, 0)
                while k and stop[k] != c:
                    k = fail[i][k - 1]
                k += stop[k] == c
                if k == len(stop):
                    cut = min(cut, end - k)
                    k = fail[i][k - 1]
                if k:
                    state[i] = k
                else:
                    state.pop(i, None)
        if cut < len(text):
            self.pending, self._state = "", {}
            return text[:cut], True
        hold = max(state.values(), default=0)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        out, self.pending, self._state = self.pending, "", {}
        return out


def _failure(stop: str) -> list[int]:
    """KMP's table: entry k is the length of the longest proper border of stop[: k + 1]."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        k += stop[i] == stop[k]
        table[i] = k
    return table


class TokenTexts:
    """Each token's own text (decoded alone, special tokens shown), as log-probabilities report it.
    Cached: a step asks for up to 21 per request, from a vocabulary that repeats."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> list[str]:
        cache = self._cache
        missing = sorted({i for i in ids if i not in cache})
        if missing:
            rust = getattr(self.tokenizer, "_tokenizer", None)
            decode = rust.decode if rust is not None and hasattr(rust, "decode") else self.tokenizer.decode
            for i in missing:
                cache[i] = decode([i], skip_special_tokens=False)
        return [cache[i] for i in ids]
