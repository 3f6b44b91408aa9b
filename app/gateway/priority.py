"""A request's priority class at the gateway: its X-Priority header, capped by its API key's class, or
by OPEN_MAX_PRIORITY for a caller whose key has none (and a keyless caller): the top classes jump
every queue, so a key is granted them in KEY_PRIORITIES rather than taking them."""

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


def request_priority(header: str | None, key_class: int | None, open_max: int = MAX_PRIORITY) -> int | None:
    """A request's priority class: its X-Priority header (0-9), at most its API key's class, or
    `open_max` when the key has none; else the key's class; None (the job's default) when neither is
    set."""
    if header is None:
        return key_class
    value = header.strip()
    # one or two ASCII digits: isdigit() alone admits "²", and int() refuses 4,301 digits and more
    if not (value.isascii() and value.isdigit() and len(value) <= 2) or int(value) > MAX_PRIORITY:
        raise HTTPError(400, f"must be an integer in [0, {MAX_PRIORITY}] (got {header[:16]!r})", "X-Priority")
    return min(int(value), open_max if key_class is None else key_class)


def caller_priority(request: Request, classes: dict[str, int], open_max: int = MAX_PRIORITY) -> int | None:
    """The priority class of a request's jobs (the Guard left the caller's key in its state)."""
    key = getattr(request.state, "api_key", None)
    return request_priority(request.headers.get("x-priority"), classes.get(key) if key else None, open_max)
