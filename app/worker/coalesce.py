"""A stream writer's held tokens: a stream's tokens wait at most one flush interval (STREAM_FLUSH_MS),
its first token not at all, and the tokens it held in between go as one entry.

Redis, the gateway and every reader pay per entry, not per token: a job streaming 60 tokens/s in
entries of 3 costs a third of what one entry per token does, while a reader still sees its first
token as soon as the engine emits it and the rest within one interval. A writer that lags behind the
engine joins the steps that waited for it the same way, at any interval (0 included).

Redis and every reader also pay per write (a script call, a tick, a reader woken per shard), so a write
takes along every stream that has held its tokens for half an interval (TAKE_ALONG): streams that began
at different moments fall into step with each other instead of each being written on its own clock.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from weightq.tasks.contract import END_TYPES, job_of_stream

# entries of the writer's shape (publisher.entries_of): (stream key, (index, text, token id, stamp))
# for a plain token, else (stream key, fields, final state or None)
Entry = tuple
Write = tuple[list[Entry], dict[str, int]]  # entries and the fences (job -> attempt) they go under
PRUNE_AT = 4096  # streams remembered before the ones idle past the interval are forgotten
TAKE_ALONG = 0.5  # a write takes the streams due within this part of an interval


@dataclass(slots=True)
class _Stream:
    """A stream's entries waiting to be written, in order, and the fence they were flushed under."""

    fence: int | None
    due_s: float  # monotonic seconds: when they are written at the latest
    entries: list[Entry] = field(default_factory=list)


class Holding:
    """One writer thread's held entries; the writer asks `due()` what to write and `wait_s()` how
    long it may block for the next step."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._held: dict[str, _Stream] = {}  # stream key -> what it waits to write
        self._last_s: dict[str, float] = {}  # stream key -> when it was last written (open streams)
        self._early: list[Write] = []  # held entries a change of fence sends ahead of the rest
        self._prune_at = PRUNE_AT

    def add(self, entries: list[Entry], fences: dict[str, int], now_s: float | None = None) -> None:
        """A step's entries, flushed under `fences`. A stream's token waits for its interval unless
        nothing of it was written within one; anything else (an end, a token with logprobs, an
        error) goes at once, after the stream's held tokens."""
        now_s = time.monotonic() if now_s is None else now_s
        for entry in entries:
            key = entry[0]
            fence = fences.get(job_of_stream(key))
            held = self._held.get(key)
            if held is not None and held.fence != fence:  # a new run of the job on this worker
                self._early.append(([*_joined(held.entries)], _fences(key, held.fence)))
                del self._held[key]
                held = None
            if held is None:
                last = self._last_s.get(key)
                due = now_s if last is None or now_s - last >= self.interval_s else last + self.interval_s
                held = self._held[key] = _Stream(fence, due)
            held.entries.append(entry)
            if len(entry) == 3:  # not a plain token
                held.due_s = now_s

    def end(self, key: str) -> None:
        """The stream's job finished here, whether or not an entry says so (a job requeued at shutdown
        has none): what it holds goes in the next write, before its task goes on."""
        if (held := self._held.get(key)) is not None:
            held.due_s = float("-inf")
        self._last_s.pop(key, None)

    def due(self, *, everything: bool = False, now_s: float | None = None) -> list[Write]:
        """What to write now (all of it when the writer closes): usually one write, each stream's
        plain tokens in a row joined into one entry. When anything is due, the streams due within
        TAKE_ALONG of an interval go along with it."""
        now_s = time.monotonic() if now_s is None else now_s
        writes, self._early = self._early, []
        entries: list[Entry] = []
        fences: dict[str, int] = {}
        until = float("inf") if everything else now_s
        if self._held and not everything and min(h.due_s for h in self._held.values()) <= now_s:
            until = now_s + TAKE_ALONG * self.interval_s
        for key, held in list(self._held.items()):
            if held.due_s > until:
                continue
            del self._held[key]
            entries += _joined(held.entries)
            if held.fence is not None:
                fences[job_of_stream(key)] = held.fence
            last = held.entries[-1]
            if len(last) == 3 and last[1].get("type") in END_TYPES:
                self._last_s.pop(key, None)  # the stream has ended
            elif held.due_s != float("-inf"):  # (not ended here without an entry: `end`)
                self._last_s[key] = now_s
        if entries:
            writes.append((entries, fences))
        if len(self._last_s) > self._prune_at:  # a stream idle past the interval is written at once anyway
            self._last_s = {k: t for k, t in self._last_s.items() if now_s - t < self.interval_s}
            self._prune_at = max(PRUNE_AT, 2 * len(self._last_s))
        return writes

    def wait_s(self, now_s: float | None = None) -> float | None:
        """How long the writer may block for the next step: until the first held stream is due
        (None: nothing held)."""
        if not self._held and not self._early:
            return None
        now_s = time.monotonic() if now_s is None else now_s
        if self._early:
            return 0.0
        return max(0.0, min(h.due_s for h in self._held.values()) - now_s)


def take_all(q: queue.SimpleQueue, timeout_s: float | None) -> list:
    """The next item of `q` within `timeout_s` (None: wait for it), and every item queued behind it."""
    try:
        items = [q.get(timeout=timeout_s)] if timeout_s is None or timeout_s > 0 else [q.get_nowait()]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def _fences(key: str, fence: int | None) -> dict[str, int]:
    return {} if fence is None else {job_of_stream(key): fence}


def _joined(entries: list[Entry]) -> list[Entry]:
    """A stream's entries with each run of plain tokens as one entry: (key, (first index, count,
    texts joined, ids, lengths, first stamp)) when there are several (WRITE_BATCH's joined form)."""
    out: list[Entry] = []
    run: list[tuple] = []

    def close_run() -> None:
        if len(run) == 1:
            out.append((key, run[0]))
        elif run:
            first = run[0]
            ids = ",".join(str(v[2]) for v in run)
            lengths = ",".join(str(len(v[1])) for v in run)
            out.append((key, (first[0], len(run), "".join(v[1] for v in run), ids, lengths, first[3])))
        run.clear()

    key = entries[0][0]
    for entry in entries:
        if len(entry) == 2:
            run.append(entry[1])
        else:
            close_run()
            out.append(entry)
    close_run()
    return out
