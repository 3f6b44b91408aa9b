"""The kinds of input line a batch file may hold, and the columns a line carries through to its output.

A user's file has columns besides the request (a `metadata` object, a category, a source), and a data
tool keeps them: every top-level field that is not the request's is copied to the line's output as
it was. A field one edit away from a request field is refused instead, naming the field it resembles:
a typo of `max_new_tokens` must not run a job with the default length and carry the typo along.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Protocol

from weightq.tasks.request import FIELDS, JobRequest, RequestError, parse_request


class LineFormat(Protocol):
    """One kind of input line: how to know it, name it, turn it into a job request, and write its outcome."""

    def matches(self, obj: object) -> bool: ...

    def line_id(self, obj: dict, n: int) -> str: ...

    def request(self, obj: dict, priority: int | None) -> JobRequest:
        """The line's job request, parsed (once) with the door's defaults and `priority` for a line
        that names none (None: the contract's default); raises RequestError naming the field."""
        ...

    def done(self, line_id: str, obj: dict, job_id: str, result: dict) -> dict: ...

    def failed(self, line_id: str, obj: dict | None, job_id: str | None, message: str, field: str | None) -> dict: ...


def carried(obj: dict | None, known: Collection[str], output: Collection[str], fields: Collection[str] = ()) -> dict:
    """The line's own columns: its top-level fields that are not `known` (the format's), in order.
    Raises RequestError for one that the output writes itself (`output`), or that is a near miss of
    a request field (`fields`)."""
    if obj is None:
        return {}
    extra = {k: v for k, v in obj.items() if k not in known}
    for name in extra:
        if name in output:
            raise RequestError(name, "is a field of the output line; rename the column (it would be lost)")
        near = difflib.get_close_matches(name, fields, n=1, cutoff=0.85)
        if near:
            raise RequestError(name, f"unknown field; did you mean {near[0]!r}? (other columns are carried as is)")
    return extra


def columns(obj: dict | None, known: Collection[str], output: Collection[str], fields: Collection[str] = ()) -> dict:
    """`carried` for an outcome: none when the columns are what the line was refused for."""
    try:
        return carried(obj, known, output, fields)
    except RequestError:
        return {}


class JobLines:
    """weightq's own lines: a job request with an optional "id" and any columns of the user's own;
    out, {"id", <the columns>, "result"} or {"id", <the columns>, "error"}."""

    OUTPUT = ("id", "result", "error")

    def matches(self, obj: object) -> bool:
        return True

    def line_id(self, obj: dict, n: int) -> str:
        return str(obj.get("id", f"line-{n}"))

    def request(self, obj: dict, priority: int | None) -> JobRequest:
        carried(obj, {*FIELDS, "id"}, self.OUTPUT, FIELDS)  # refuses a near miss before anything runs
        req = {k: v for k, v in obj.items() if k in FIELDS}
        if priority is not None:
            req.setdefault("priority", priority)
        return parse_request(req)

    def done(self, line_id: str, obj: dict, job_id: str, result: dict) -> dict:
        return {"id": line_id, **columns(obj, {*FIELDS, "id"}, self.OUTPUT, FIELDS), "result": result}

    def failed(self, line_id: str, obj: dict | None, job_id: str | None, message: str, field: str | None) -> dict:
        error = {"message": message, "field": field}
        return {"id": line_id, **columns(obj, {*FIELDS, "id"}, self.OUTPUT, FIELDS), "error": error}
