"""The worker's stream writer against a real Redis: one WRITE_BATCH per step, applied at most once."""

from __future__ import annotations

import json

import pytest
import redis
from weightq.engine import FinishEvent, TokenEvent
from weightq.engine.params import TokenLogprobs
from weightq.settings import RedisSettings
from weightq.tasks.contract import STREAM_TICK, job_key, job_of_stream, stream_key, tick_entries, tick_streams
from weightq.tasks.scripts import TICK_DATA
from weightq.token_plane import TokenPlane
from weightq.worker.publisher import StreamPublisher
from weightq.worker.runs import RunEnd

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def _apply(
    pub: StreamPublisher,
    seq: int,
    entries: list[tuple],
    fences: dict[str, int] | None = None,
    tops: dict[str, str] | None = None,
) -> None:
    """Entries of any shard, each shard's part in one script call, as the writer threads send them
    (`tops`: the ids a writer last wrote, kept across calls as a writer thread keeps them)."""
    by_shard: dict[int, list[tuple]] = {}
    for entry in entries:
        by_shard.setdefault(pub.plane.index(job_of_stream(entry[0])), []).append(entry)
    for shard, part in by_shard.items():
        fenced = pub.runs.fences() if fences is None else fences
        pub._apply_on(pub.plane.durables[shard], seq, part, fenced, {} if tops is None else tops)


def _fields(r: redis.Redis, job: str) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(stream_key(job))]


def _carried(r: redis.Redis, after: bytes = b"-") -> int:
    """Checks that each tick's data (those after `after`) is what its batch wrote: per stream, the
    entries that follow the id it names, as XRANGE gives them; returns how many entries they carried."""
    carried = 0
    for _, fields in r.xrange(STREAM_TICK, min=after if after == b"-" else b"(" + after):
        data = fields.get(b"data", b"").decode()
        for key, part in tick_streams(fields[b"keys"].decode(), data):
            if not part:
                continue
            before, entries = tick_entries(part)
            start = "-" if before == "0-0" else f"({before}"
            stream = [
                (i.decode(), [x.decode() for kv in f.items() for x in kv])
                for i, f in r.xrange(key, min=start, count=len(entries))
            ]
            assert [(i, f) for i, f in entries] == stream
            carried += len(entries)
    return carried


def test_plain_tokens_logprobs_and_the_end_land_as_the_contract_says_once(service):
    r = redis.Redis.from_url(service.url)
    pub = StreamPublisher(TokenPlane([r], RedisSettings()), maxlen=1000, ttl_s=600)
    try:
        lp = TokenLogprobs("a", -0.25, (5, 8), ("a", "b"), (-0.25, -1.5))
        finish = FinishEvent("j2", "length", "ab", (5, 7), 3, 2, 0.0, 0.1, 0.2)
        batch = [
            (TokenEvent("j1", 0, 5, " hé"), 100.5),
            (TokenEvent("j2", 0, 5, "a", lp), 100.5),
            (TokenEvent("j2", 1, 7, "b"), 100.75),
            (finish, 100.75),
        ]
        entries = pub._entries(batch)
        _apply(pub, 1, entries)
        tick = r.xrange(STREAM_TICK)
        _apply(pub, 1, entries)  # a retry after a lost reply: nothing twice
        assert r.xrange(STREAM_TICK) == tick and len(tick) == 1  # one tick per batch applied, the last kept
        assert _fields(r, "j1") == [{"type": "token", "i": "0", "text": " hé", "id": "5", "ts": "100.500000"}]
        j2 = _fields(r, "j2")
        assert [f["type"] for f in j2] == ["token", "token", "end"]
        assert json.loads(j2[0]["lp"])[:2] == ["a", -0.25] and j2[0]["text"] == "a"
        assert j2[1] == {"type": "token", "i": "1", "text": "b", "id": "7", "ts": "100.750000"}
        assert j2[2]["reason"] == "length" and json.loads(j2[2]["result"])["token_ids"] == [5, 7]
        assert r.hget(job_key("j2"), "state") == b"done" and r.ttl(stream_key("j2")) > 0
        _apply(pub, 2, pub._entries([(TokenEvent("j1", 1, 6, ""), 101.0)]))  # an empty text is a value too
        assert _fields(r, "j1")[1]["text"] == ""
        later = r.xrange(STREAM_TICK)[-1]  # readers blocked on the tick wake after the batch's entries
        assert later[0] > tick[0][0] and later[1][b"seq"] == b"2" and later[1][b"keys"] == stream_key("j1").encode()
        assert _carried(r) == 5  # each tick carries what its batch wrote (read from it, not from each stream)
        assert set(tick[0][1][b"keys"].split()) == {stream_key(j).encode() for j in ("j1", "j2")}  # what to read
        # A step's tuples from an engine process (tokens()) land as the same entries as its events.
        _apply(pub, 3, pub._entries([([("j3", 0, 5, " hé", None), ("j3", 1, 6, "a", lp)], 102.25)]))
        j3 = _fields(r, "j3")
        assert j3[0] == {"type": "token", "i": "0", "text": " hé", "id": "5", "ts": "102.250000"}
        assert json.loads(j3[1].pop("lp"))[:2] == ["a", -0.25]
        assert j3[1] == {"type": "token", "i": "1", "text": "a", "id": "6", "ts": "102.250000"}
        # A writer that knows the last id it wrote adds after it (no look-up); one whose id is stale (an
        # entry came since, or the stream is gone) is answered by the look-up: each tick stays exact.
        tops: dict[str, str] = {}

        def lookups() -> int:
            return r.info("commandstats").get("cmdstat_xrevrange", {}).get("calls", 0)

        _apply(pub, 5, pub._entries([(TokenEvent("j6", 5, 1, "a"), 105.0)]), tops=tops)
        looked = lookups()
        _apply(pub, 6, pub._entries([(TokenEvent("j6", 6, 1, "a"), 105.0)]), tops=tops)
        assert lookups() == looked
        r.xadd(stream_key("j6"), {"type": "attempt", "attempt": "2", "from": "7"})  # not this writer's
        _apply(pub, 7, pub._entries([(TokenEvent("j6", 7, 1, "b"), 106.0)]), tops=tops)
        assert lookups() == looked + 1
        assert [f["type"] for f in _fields(r, "j6")] == ["token", "token", "attempt", "token"]
        assert _carried(r) == 7 + 3
        tick = r.xrange(STREAM_TICK)[-1][0]
        r.delete(stream_key("j6"))  # expired: nothing lies between the writer's last id and its next entry
        _apply(pub, 8, pub._entries([(TokenEvent("j6", 8, 1, "c"), 107.0)]), tops=tops)
        _apply(pub, 9, pub._entries([(TokenEvent("j6", 9, 1, "d"), 108.0)]), tops=tops)
        assert [f["text"] for f in _fields(r, "j6")] == ["c", "d"] and _carried(r, after=tick) == 2
        assert tops[stream_key("j6")] == r.xrange(stream_key("j6"))[-1][0].decode()
        tick = r.xrange(STREAM_TICK)[-1][0]
        # texts of any characters (JSON's own, the separator of streams' parts), joined tokens, and a
        # batch too large for a tick, whose reader reads the stream (an empty part)
        odd = ['"\\/\x1e\n', "\x00é😀", "</b>"]
        events = [(TokenEvent("j4", n, n, t), 103.0) for n, t in enumerate(odd)]
        held = [(stream_key("j4"), (3, 2, "xy", "3,4", "1,1", "103.500000"))]  # joined (coalesce.Holding)
        _apply(pub, 10, pub._entries(events) + held + pub._entries([(TokenEvent("j5", 0, 1, "x" * TICK_DATA), 104.0)]))
        assert [f["text"] for f in _fields(r, "j4")] == [*odd, "xy"] and _carried(r, after=tick) == 4
        assert r.xrange(STREAM_TICK)[-1][1][b"data"].split(b"\x1e")[1] == b""  # j5's: too large to carry
    finally:
        pub.close()


def test_writes_of_a_run_that_another_run_replaced_are_refused(service):
    """The fence: once a job's attempt moved on (it resumed elsewhere while this worker was taken for
    dead), this writer's entries and final state for it are dropped, and the job is reported once."""
    r = redis.Redis.from_url(service.url)
    pub = StreamPublisher(TokenPlane([r], RedisSettings()), maxlen=1000, ttl_s=600)
    told: list[str] = []
    pub.on_superseded = told.append
    try:
        r.hset(job_key("old"), mapping={"attempt": 2, "state": "running"})
        r.hset(job_key("mine"), mapping={"attempt": 1, "state": "running"})
        for job in ("old", "mine"):
            pub.runs.begin(job, 1, {})
        batch = [
            (TokenEvent("old", 7, 5, "x"), 1.0),
            (TokenEvent("mine", 0, 5, "y"), 1.0),
            (FinishEvent("old", "length", "x", (5,), 1, 1, 0.0, 0.0, 0.0), 1.0),
            (FinishEvent("mine", "length", "y", (5,), 1, 1, 0.0, 0.0, 0.0), 1.0),
        ]
        _apply(pub, 1, pub._entries(batch))
        _apply(pub, 2, pub._entries([(TokenEvent("old", 8, 6, "z"), 2.0)]))
        assert r.xrange(stream_key("old")) == [] and r.hget(job_key("old"), "state") == b"running"
        assert [f["type"] for f in _fields(r, "mine")] == ["token", "end"]
        assert r.hget(job_key("mine"), "state") == b"done"
        assert told == ["old"] and pub.runs.ended("old").superseded and not pub.runs.ended("mine").superseded
    finally:
        pub.close()


def test_an_abort_is_fenced_too(service):
    """A batch Redis keeps refusing ends its jobs with an error entry (ABORT), except a job a later run
    owns: that run is left alone, and this one is stopped as superseded."""
    r = redis.Redis.from_url(service.url)
    pub = StreamPublisher(TokenPlane([r], RedisSettings()), maxlen=1000, ttl_s=600)
    told, failed = [], []
    pub.on_superseded, pub.on_write_failed = told.append, failed.append
    try:
        r.hset(job_key("old-a"), mapping={"attempt": 2, "state": "running"})
        r.hset(job_key("mine-a"), mapping={"attempt": 1, "state": "running"})
        for job in ("old-a", "mine-a"):
            pub.runs.begin(job, 1, {})
        entries = pub._entries([(TokenEvent("old-a", 3, 5, "x"), 1.0), (TokenEvent("mine-a", 0, 5, "y"), 1.0)])
        pub._abort(entries, redis.ResponseError("OOM command not allowed"))
        assert r.xrange(stream_key("old-a")) == [] and r.hget(job_key("old-a"), "state") == b"running"
        assert told == ["old-a"] and pub.runs.ended("old-a") == RunEnd(None, True)
        assert [f["type"] for f in _fields(r, "mine-a")] == ["error"] and r.hget(job_key("mine-a"), "state") == b"done"
        end = pub.runs.ended("mine-a")
        assert failed == ["mine-a"] and "refused" in end.refused and not end.superseded
    finally:
        pub.close()


def test_a_batch_retried_through_an_outage_keeps_its_fences_and_drops_what_its_task_gave_up(tmp_path):
    """Redis down longer than a task waits for its job's end: the batches still queued are retried
    under the fences they were flushed with (the task has dropped its own by then), so a job that
    resumed elsewhere meanwhile never gets this run's entries; and a job whose task gave up and ends
    it itself (FAIL) loses its queued entries here, so it never ends twice."""
    import time

    from weightq.cli.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path)
    url = server.start()
    r = redis.Redis.from_url(url)
    pub = StreamPublisher(
        TokenPlane([redis.Redis.from_url(url, socket_timeout=2)], RedisSettings()), maxlen=1000, ttl_s=600
    )
    told: list[str] = []
    pub.on_superseded = told.append
    try:
        r.hset(job_key("moved"), mapping={"attempt": 2, "state": "running"})  # a later run began elsewhere
        r.hset(job_key("gave-up"), mapping={"attempt": 1, "state": "running"})
        r.hset(job_key("fine"), mapping={"attempt": 1, "state": "running"})
        written = {job: pub.runs.begin(job, 1, {}) for job in ("moved", "gave-up", "fine")}["gave-up"]
        server.stop()  # the outage: the writer retries the batch
        for job in ("moved", "gave-up", "fine"):
            pub(TokenEvent(job, 0, 5, "x"), 1.0)
        pub(FinishEvent("gave-up", "length", "x", (5,), 1, 1, 0.0, 0.0, 0.0), 1.0)
        pub.flush()
        time.sleep(1.0)
        for job in ("moved", "gave-up", "fine"):
            pub.runs.end(job)  # every task stopped waiting and dropped its fence
        pub.runs.abandon("gave-up")
        server.start()
        assert written.wait(30)
        deadline = time.monotonic() + 30
        while not r.xrange(stream_key("fine")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [f["type"] for f in _fields(r, "fine")] == ["token"]
        assert r.xrange(stream_key("moved")) == [] and told == ["moved"]
        assert r.xrange(stream_key("gave-up")) == [] and r.hget(job_key("gave-up"), "state") == b"running"
        assert pub.runs.drop_abandoned([(stream_key("gave-up"),)]) == [(stream_key("gave-up"),)]  # forgotten
    finally:
        pub.close()
        server.stop()


def test_each_shard_has_a_writer_of_its_own(service, tmp_path):
    """Two token-plane shards: a shard that refuses writes for good (full under maxmemory) ends its own
    jobs alone (the other shard's stream on), and a shard that is down holds up only its own jobs'
    streams."""
    import time

    from weightq.cli.redis_server import EmbeddedRedis
    from weightq.tasks.contract import shard_of

    server = EmbeddedRedis(tmp_path)
    a, b = redis.Redis.from_url(service.url), redis.Redis.from_url(server.start(), socket_timeout=2)
    pub = StreamPublisher(TokenPlane([a, b], RedisSettings()), maxlen=1000, ttl_s=600)
    failed: list[str] = []
    pub.on_write_failed = failed.append
    on_a, on_b, later_b = (next(f"{p}{i}" for i in range(64) if shard_of(f"{p}{i}", 2) == s)
                           for p, s in (("a", 0), ("b", 1), ("c", 1)))  # fmt: skip
    try:
        for job in (on_a, on_b, later_b):
            (a, b)[shard_of(job, 2)].hset(job_key(job), mapping={"attempt": 1, "state": "running"})
            pub.runs.begin(job, 1, {})
        b.hset(job_key(on_b), "request", "{}")  # what ABORT frees to get its error entry through
        b.config_set("maxmemory", 1)  # shard b full: every stream write there is refused (OOM)
        pub(TokenEvent(on_a, 0, 5, "x"), 1.0)
        pub(TokenEvent(on_b, 0, 5, "y"), 1.0)
        pub.flush()
        deadline = time.monotonic() + 30
        while not failed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert failed == [on_b] and "refused" in pub.runs.ended(on_b).refused
        assert [f["type"] for f in _fields(a, on_a)] == ["token"] and pub.runs.ended(on_a).refused is None
        assert [f["type"] for f in _fields(b, on_b)] == ["error"]  # ABORT gets through under maxmemory
        b.config_set("maxmemory", 0)
        server.stop()  # shard b down: its writer retries, shard a's goes on
        pub(TokenEvent(later_b, 0, 5, "w"), 2.0)
        pub(TokenEvent(on_a, 1, 6, "z"), 2.0)
        pub.flush()
        while len(a.xrange(stream_key(on_a))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [f["i"] for f in _fields(a, on_a)] == ["0", "1"]
        server.start()  # back: what waited for it is written
        while not b.exists(stream_key(later_b)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [f["text"] for f in _fields(b, later_b)] == ["w"]
    finally:
        pub.close()
        server.stop()
