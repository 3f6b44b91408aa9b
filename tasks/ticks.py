"""What a STREAM_TICK entry carries: the streams a worker's batch wrote to ("keys") and, for each, the
entries it wrote ("data"), so a reader that follows many streams takes a batch from one entry instead of
reading each stream (an XREAD of a stream costs Redis several times what writing its entry does). Part of
the job contract, which re-exports every name here; WRITE_BATCH (tasks/scripts.py) writes them.

A stream's part is JSON: [the id of the stream's entry before the batch's first ("0-0": none), then
each entry's id and its fields as a flat [name, value, ...] list]. A reader whose position is that
first id (or one of the batch's) takes the entries past it as if it had read the stream; any other
position means the stream holds entries the reader has not seen (written without a tick, or in a tick
it missed), so it reads the stream. An empty part (a batch too large to carry) or a tick without
"data" (a worker of an earlier version) is read the same way.
"""

from __future__ import annotations

import json

SEPARATOR = "\x1e"  # between the streams' parts of "data": JSON escapes every control character


def tick_streams(keys: str | None, data: str | None) -> list[tuple[str, str]] | None:
    """The streams a tick names, each with its part of "data" ('' where it carries none); None for a
    tick that names no stream (a writer that asks readers to read every stream)."""
    if keys is None:
        return None
    if not keys:
        return []
    names = keys.split(" ")
    parts = data.split(SEPARATOR) if data else ()
    if len(parts) != len(names):
        return [(name, "") for name in names]
    return list(zip(names, parts, strict=True))


def tick_entries(part: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """A stream's part of a tick: (the id of the entry before the batch's, [(entry id, [name, value,
    ...]), ...]), the shape an XREAD reply's entries have. ValueError: not such a part."""
    seg = json.loads(part)
    if not isinstance(seg, list) or len(seg) % 2 != 1:
        raise ValueError("a tick's part is a list of an id and pairs of an entry id and its fields")
    return seg[0], list(zip(seg[1::2], seg[2::2], strict=True))
