"""The parts of a job request that are types of their own (a chat's messages, a structured-output
grammar) and the checks the request's fields share, each refusal a RequestError naming the field.
request.py builds the whole request from them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .limits import GUIDED_KINDS, MAX_GUIDED_CHARS, MAX_GUIDED_DEPTH, MAX_MESSAGES, MAX_PROMPT_CHARS, ROLES


class RequestError(ValueError):
    """A job request that breaks the contract; `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field

    def __reduce__(self):  # survives pickling and Celery's exception round trip
        return (RequestError, (self.field, str(self).split(": ", 1)[-1]))


def field_name(name: object) -> str:
    """How an unknown field is named in an error: as sent, or quoted when it is blank or unprintable."""
    name = str(name)
    return name if name.strip() and name.isprintable() and len(name) <= 64 else repr(name[:64])


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a chat; the worker renders the chat with the model's template."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Guided:
    """Structured output: decoding follows a grammar. `spec` is the JSON schema as JSON text
    (json_schema), "" (json_object: any JSON object) or the pattern (regex)."""

    kind: str
    spec: str

    @classmethod
    def from_json(cls, value: object) -> Guided:
        """{"json_schema": schema or its JSON text}, {"json_object": true} or {"regex": pattern}."""
        if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in GUIDED_KINDS:
            raise RequestError("guided", f"must be an object with one of {', '.join(GUIDED_KINDS)}")
        kind, spec = next(iter(value.items()))
        if kind == "json_object":
            if spec is not True:
                raise RequestError("guided", "json_object must be true")
            return cls(kind, "")
        if kind == "json_schema" and isinstance(spec, Mapping):
            try:
                spec = json.dumps(spec, sort_keys=True)  # one text per schema: the worker caches by it
            except (TypeError, ValueError, RecursionError):
                raise RequestError("guided", "json_schema must be a JSON schema") from None
        return cls(kind, spec)

    def to_json(self) -> dict[str, Any]:
        return {self.kind: True if self.kind == "json_object" else self.spec}

    def check(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise RequestError("guided", f"must be one of {', '.join(GUIDED_KINDS)} (got {str(self.kind)[:32]!r})")
        if not isinstance(self.spec, str):
            raise RequestError("guided", f"{self.kind} must be given as text (got {type(self.spec).__name__})")
        if len(self.spec) > MAX_GUIDED_CHARS:
            raise RequestError("guided", f"{len(self.spec)} characters exceeds {MAX_GUIDED_CHARS}")
        check_utf8("guided", self.spec)
        if self.kind == "regex" and not self.spec:
            raise RequestError("guided", "regex must be a non-empty string")
        if self.kind == "json_object" and self.spec:
            raise RequestError("guided", "json_object takes no schema (use json_schema)")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except (ValueError, RecursionError):
                schema = None
            if not isinstance(schema, dict):
                raise RequestError("guided", "json_schema must be a JSON schema (an object, or its JSON text)")
            if nesting(schema, MAX_GUIDED_DEPTH) > MAX_GUIDED_DEPTH:
                raise RequestError("guided", f"json_schema nests deeper than {MAX_GUIDED_DEPTH} levels")


def nesting(value: object, limit: int) -> int:
    """How deeply a JSON value's arrays and objects nest, counted iteratively up to `limit` + 1."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, Mapping | list):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            todo.extend((c, depth + 1) for c in (v.values() if isinstance(v, Mapping) else v))
    return deepest


def check_utf8(name: str, text: str) -> None:
    """JSON may carry lone surrogates (\\ud800) that no UTF-8 encoder accepts: Redis writes and the
    tokenizer would fail on them later, far from the request. Refuse them here, by field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(name, f"not valid Unicode text (a lone surrogate at character {e.start})") from None


def parse_messages(messages: object) -> tuple[Message, ...]:
    if not isinstance(messages, list | tuple) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise RequestError("messages", f"must be a list of 1 to {MAX_MESSAGES} messages")
    out, total = [], 0
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            if set(m) - {"role", "content", "name"}:
                raise RequestError(f"messages[{i}]", "must be an object with role and content (and optionally name)")
            m = Message(m.get("role"), m.get("content"))  # type: ignore[arg-type]
        if not isinstance(m, Message):
            raise RequestError(f"messages[{i}]", "must be an object with role and content (and optionally name)")
        if m.role not in ROLES:
            raise RequestError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)} (got {str(m.role)[:32]!r})")
        if not isinstance(m.content, str):
            raise RequestError(f"messages[{i}].content", f"must be a string (got {type(m.content).__name__})")
        check_utf8(f"messages[{i}].content", m.content)
        total += len(m.content)
        if total > MAX_PROMPT_CHARS:
            raise RequestError("messages", f"more than {MAX_PROMPT_CHARS} characters in all")
        out.append(m)
    return tuple(out)
