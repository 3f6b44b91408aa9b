"""A request's priority class at the gateway: its X-Priority header, capped by its API key's class."""

from __future__ import annotations

from fastapi import Request
from weightq.tasks.limits import MAX_PRIORITY

from .errors import HTTPError


def key_classes(spec: str) -> dict[str, int]:
    """KEY_PRIORITIES ("key:class,..."): each key's priority class (0-9)."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, cls = item.rpartition(":")
        if not key or not cls.isdigit() or not 0 <= int(cls) <= MAX_PRIORITY:
            raise ValueError(f"KEY_PRIORITIES: {item[:8]}...: give key:class with a class in [0, {MAX_PRIORITY}]")
        out[key] = int(cls)
    return out


def request_priority(header: str | None, key_class: int | None) -> int | None:
    """A request's priority class: its X-Priority header (0-9), at most its API key's class; else
    the key's class; None (the job's default) when neither is set."""
    if header is None:
        return key_class
    if not header.strip().isdigit() or not 0 <= int(header) <= MAX_PRIORITY:
        raise HTTPError(400, f"must be an integer in [0, {MAX_PRIORITY}] (got {header[:16]!r})", "X-Priority")
    return min(int(header), key_class) if key_class is not None else int(header)


def caller_priority(request: Request, classes: dict[str, int]) -> int | None:
    """The priority class of a request's jobs (the Guard left the caller's key in its state)."""
    key = getattr(request.state, "api_key", None)
    return request_priority(request.headers.get("x-priority"), classes.get(key) if key else None)
