"""A job stream's entry types and how a reader takes its token entries apart: one-token and joined
entries (see the contract's docstring, tasks/contract.py), resume positions, and the tokens a stream
holds. Part of the job contract, which re-exports every name here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class EntryType(StrEnum):
    ATTEMPT = "attempt"
    TOKEN = "token"
    END = "end"
    ERROR = "error"


END_TYPES = frozenset({EntryType.END, EntryType.ERROR})


def token_parts(fields: Mapping[str, str]) -> list[Mapping[str, str]]:
    """A token entry as one-token entries (a joined entry carries "n" of them; see the
    contract's docstring), each with the entry's "ts"."""
    if "n" not in fields:
        return [fields]
    first, text, ts = int(fields["i"]), fields.get("text", ""), fields.get("ts", "")
    parts, at = [], 0
    for k, (token_id, length) in enumerate(zip(fields["id"].split(","), fields["len"].split(","), strict=True)):
        end = at + int(length)
        parts.append({"type": EntryType.TOKEN, "i": str(first + k), "text": text[at:end], "id": token_id, "ts": ts})
        at = end
    return parts


def part_id(entry_id: str, part: Mapping[str, str], fields: Mapping[str, str]) -> str:
    """The id a reader gives one token of an entry: the entry's own for its last token, else
    "<entry id>@<token index>", which `resume_from` turns back into a position."""
    last = int(fields["i"]) + token_count(fields) - 1
    return entry_id if int(part["i"]) == last else f"{entry_id}@{part['i']}"


def resume_from(last_id: str) -> tuple[str, int]:
    """Where to read a stream after a reader's last id: (the stream id to read after, the token
    index to deliver from: 0 unless the id names a token inside a joined entry, "<entry id>@<i>")."""
    entry, at, index = last_id.partition("@")
    if not at:
        return last_id, 0
    ms, _, seq = entry.partition("-")
    before = f"{ms}-{int(seq) - 1}" if int(seq) else f"{int(ms) - 1}-18446744073709551615"
    return before, int(index) + 1


def token_count(fields: Mapping[str, str]) -> int:
    """How many tokens a token entry carries."""
    return int(fields.get("n", 1))


class Replay:
    """Drops a token entry whose indices a reader already has. Runs resume rather than restart and
    fenced writes never double an index, so nothing is dropped today; it keeps readers exact regardless."""

    __slots__ = ("delivered",)

    def __init__(self) -> None:
        self.delivered = 0

    def fresh(self, fields: Mapping[str, str]) -> bool:
        if fields.get("type") != EntryType.TOKEN:
            return True
        i = int(fields.get("i", 0))
        if i < self.delivered:
            return False
        self.delivered = i + token_count(fields)
        return True

    def unseen(self, fields: Mapping[str, str]) -> Mapping[str, str] | None:
        """The entry, or the tokens of it past those delivered (a joined entry that overlaps them),
        or None."""
        if fields.get("type") != EntryType.TOKEN or int(fields.get("i", 0)) >= self.delivered:
            return fields if self.fresh(fields) else None
        tail = [p for p in token_parts(fields) if int(p["i"]) >= self.delivered]
        if not tail:
            return None
        self.delivered = int(tail[-1]["i"]) + 1
        if len(tail) == 1:
            return tail[0]
        joined = {"text": "".join(p["text"] for p in tail), "id": ",".join(p["id"] for p in tail)}
        lengths = ",".join(str(len(p["text"])) for p in tail)
        return {**fields, "i": tail[0]["i"], "n": str(len(tail)), "len": lengths, **joined}


@dataclass(slots=True)
class Emitted:
    """What a job's stream says its runs have emitted so far, in index order: the token ids, their
    texts, and their log-probabilities as streamed ("lp" JSON, when the request asked for them)."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[str] = field(default_factory=list)

    def add(self, fields: Mapping[str, str]) -> None:
        """A one-token entry (`token_parts`); one at an index already held replaces it and what
        follows (a run that restarted from there, as runs of older versions did)."""
        i = int(fields["i"])
        if i > len(self.token_ids):
            raise ValueError(f"token {i} follows token {len(self.token_ids) - 1}: the stream was trimmed")
        for held in (self.token_ids, self.texts, self.logprobs):
            del held[i:]
        self.token_ids.append(int(fields["id"]))
        self.texts.append(fields.get("text", ""))
        if "lp" in fields:
            self.logprobs.append(fields["lp"])


def emitted_tokens(entries: list[Mapping[str, str]]) -> Emitted:
    """The tokens a job's stream holds (its entries' fields, oldest first)."""
    out = Emitted()
    for fields in entries:
        if fields.get("type") == EntryType.TOKEN:
            for part in token_parts(fields):
                out.add(part)
    return out
