"""A stream writer's held tokens (app/worker/coalesce.py): when a stream is written, what is joined,
and that joined entries read back as the tokens they hold, through Redis and every reader."""

from __future__ import annotations

import time

import pytest
import redis
from weightq.engine import FinishEvent, TokenEvent
from weightq.engine.params import TokenLogprobs
from weightq.settings import RedisSettings
from weightq.tasks.contract import (
    BEGIN,
    DEAD,
    LEASES,
    QUEUED,
    RESUMING,
    STARTED_HW,
    Replay,
    emitted_tokens,
    held_key,
    job_key,
    resume_from,
    stream_key,
    token_parts,
)
from weightq.token_plane import TokenPlane
from weightq.worker.coalesce import Holding
from weightq.worker.publisher import StreamPublisher

END = {"type": "end", "reason": "length", "result": "{}"}


def tok(job: str, i: int, text: str = "x", stamp: str = "1.000000") -> tuple:
    return stream_key(job), (i, text, 100 + i, stamp)


def test_a_stream_is_written_at_once_then_within_an_interval_its_tokens_joined():
    h = Holding(0.05)
    h.add([tok("a", 0, "hé")], {"a": 1}, now_s=10.0)
    assert h.due(now_s=10.0) == [([tok("a", 0, "hé")], {"a": 1})]  # the first token: at once
    h.add([tok("a", 1, "b")], {"a": 1}, now_s=10.01)
    h.add([tok("a", 2, ""), tok("b", 0, "z")], {"a": 1, "b": 1}, now_s=10.02)
    assert h.wait_s(now_s=10.02) == 0.0  # b's first token is due
    (write,) = h.due(now_s=10.02)
    assert write == ([tok("b", 0, "z")], {"b": 1})  # a waits for its interval
    assert h.wait_s(now_s=10.02) == pytest.approx(0.03)
    assert h.due(now_s=10.04) == []
    (write,) = h.due(now_s=10.05)
    assert write == ([(stream_key("a"), (1, 2, "b", "101,102", "1,0", "1.000000"))], {"a": 1})
    assert h.wait_s() is None


def test_a_write_takes_along_the_streams_due_within_half_an_interval_so_streams_fall_into_step():
    h = Holding(0.1)
    for n, job in enumerate("abc"):  # three streams begun 20 ms apart: each first token at once
        h.add([tok(job, 0)], {job: 1}, now_s=1.0 + 0.02 * n)
        assert h.due(now_s=1.0 + 0.02 * n) == [([tok(job, 0)], {job: 1})]
    h.add([tok("a", 1), tok("b", 1), tok("c", 1)], {"a": 1, "b": 1, "c": 1}, now_s=1.05)
    assert h.due(now_s=1.09) == [] and h.wait_s(now_s=1.09) == pytest.approx(0.01)  # a is due at 1.1
    (write,) = h.due(now_s=1.1)  # b (due 1.12) and c (1.14) go along with a
    assert [e[0] for e in write[0]] == [stream_key(j) for j in "abc"]
    h.add([tok("a", 2), tok("b", 2), tok("c", 2)], {"a": 1, "b": 1, "c": 1}, now_s=1.15)
    assert h.due(now_s=1.19) == []  # from now on one write for the three, once per interval
    assert len(h.due(now_s=1.2001)[0][0]) == 3
    h.add([tok("d", 0)], {"d": 1}, now_s=1.21)  # a new stream's first token takes nothing along...
    h.add([tok("a", 3)], {"a": 1}, now_s=1.21)
    assert h.due(now_s=1.21) == [([tok("d", 0)], {"d": 1})]
    h.add([tok("d", 1)], {"d": 1}, now_s=1.26)
    (write,) = h.due(now_s=1.3001)  # ...until the others are due: then it joins them
    assert [e[0] for e in write[0]] == [stream_key("a"), stream_key("d")]


def test_an_end_or_a_logprob_token_goes_at_once_after_what_was_held_and_a_new_run_is_not_joined():
    h = Holding(1.0)
    h.due(now_s=0.0)
    h.add([tok("a", 0)], {"a": 1}, now_s=0.0)
    h.due(now_s=0.0)
    h.add([tok("a", 1), tok("a", 2)], {"a": 1}, now_s=0.1)
    lp = (stream_key("a"), {"type": "token", "i": 3, "lp": "[]"}, None)
    h.add([lp, tok("a", 4), (stream_key("a"), END, {"state": "done"})], {"a": 1}, now_s=0.2)
    (write,) = h.due(now_s=0.2)
    keys = [e[1] if len(e) == 3 else e[1][:2] for e in write[0]]
    assert keys == [(1, 2), lp[1], (4, "x"), END]  # in order; a lone token keeps the one-token form
    h.add([tok("a", 0)], {"a": 2}, now_s=0.3)  # the stream ended: a new run's first token goes at once
    h.add([tok("a", 1)], {"a": 2}, now_s=0.3)
    h.add([tok("a", 2)], {"a": 3}, now_s=0.3)  # another run here: the held go first, under their fence
    assert h.due(now_s=0.3) == [
        ([(stream_key("a"), (0, 2, "xx", "100,101", "1,1", "1.000000"))], {"a": 2}),
        ([tok("a", 2)], {"a": 3}),
    ]
    h.add([tok("a", 3)], {"a": 3}, now_s=0.4)
    assert h.due(now_s=0.4) == [] and h.due(everything=True, now_s=0.4) == [([tok("a", 3)], {"a": 3})]


def test_a_job_that_ends_without_an_entry_has_its_held_tokens_written_before_its_task_goes_on():
    h = Holding(1.0)
    h.add([tok("a", 0)], {"a": 1}, now_s=0.0)
    h.due(now_s=0.0)
    h.add([tok("a", 1)], {"a": 1}, now_s=0.1)  # requeued at shutdown: its finish writes no entry
    h.end(stream_key("a"))
    assert h.due(now_s=0.1) == [([tok("a", 1)], {"a": 1})]
    h.add([tok("a", 2)], {"a": 1}, now_s=0.2)  # run here again: its first token goes at once
    assert h.due(now_s=0.2) == [([tok("a", 2)], {"a": 1})]


def test_a_reader_gets_the_tokens_of_an_overlapping_joined_entry_it_has_not_seen():
    replay = Replay()
    joined = {"type": "token", "i": "0", "n": "3", "text": "abc", "id": "1,2,3", "len": "1,1,1", "ts": "1"}
    assert replay.unseen(joined) is joined
    again = {**joined, "i": "2", "text": "cde", "id": "3,4,5"}  # a repeat of index 2, then 3 and 4
    tail = replay.unseen(again)
    assert [p["text"] for p in token_parts(tail)] == ["d", "e"] and [p["i"] for p in token_parts(tail)] == ["3", "4"]
    assert replay.unseen(again) is None and replay.unseen({"type": "end"}) == {"type": "end"}


def test_at_interval_zero_only_the_steps_a_lagging_writer_missed_are_joined():
    h = Holding(0.0)
    h.add([tok("a", 0)], {}, now_s=1.0)
    h.add([tok("a", 1)], {}, now_s=1.0)
    assert h.due(now_s=1.0) == [([(stream_key("a"), (0, 2, "xx", "100,101", "1,1", "1.000000"))], {})]
    h.add([tok("a", 2)], {}, now_s=1.0)
    assert h.due(now_s=1.0) == [([tok("a", 2)], {})]


@pytest.mark.service  # a real Redis server
def test_joined_entries_read_back_as_their_tokens_everywhere(service):
    """Through the worker's writer, Redis, BEGIN's resume point and the client's reader."""
    r = redis.Redis.from_url(service.url, decode_responses=True)
    job_id = service.client.submit("joined", max_new_tokens=8).id  # no worker: it stays queued
    pub = StreamPublisher(
        TokenPlane([redis.Redis.from_url(service.url)], RedisSettings()), maxlen=1000, ttl_s=600, flush_s=0.3
    )
    texts = ["Hé", " wo", "", "rld", "🙂", "\n"]
    lp = TokenLogprobs("!", -0.5, (9,), ("!",), (-0.5,))
    try:
        for i, text in enumerate(texts):
            pub(TokenEvent(job_id, i, 10 + i, text))
            pub.flush()
            time.sleep(0.02)
        time.sleep(0.5)
        entries = [f for _, f in r.xrange(stream_key(job_id))]
        assert [f.get("n") for f in entries] == [None, "5"]  # the first at once, the rest in one entry
        assert entries[1]["text"] == "".join(texts[1:]) and entries[1]["id"] == "11,12,13,14,15"
        emitted = emitted_tokens(entries)
        assert emitted.texts == texts and emitted.token_ids == list(range(10, 16))
        parts = [p for f in entries for p in token_parts(f)]
        assert [p["i"] for p in parts] == [str(i) for i in range(6)]
        replay = Replay()
        assert [replay.fresh(f) for f in entries + entries] == [True, True, False, False]
        # BEGIN resumes after the last token of the joined entry
        keys = [job_key(job_id), stream_key(job_id), QUEUED, STARTED_HW, DEAD, held_key("w/1"), RESUMING, LEASES]
        args = [1000, 60, 60, 3, time.time(), "w@test", job_id, "{}", "run-a", 5, "w/1", "t"]
        assert r.register_script(BEGIN)(keys=keys, args=args)[4] == 6
        pub.runs.begin(job_id, 1, {})
        pub(TokenEvent(job_id, 6, 16, "!", lp))  # logprobs: never joined
        pub(FinishEvent(job_id, "length", "".join(texts) + "!", tuple(range(10, 17)), 3, 7, 0.0, 0.1, 0.2))
        pub.flush()
        events = list(service.client.job(job_id).events(timeout=10))
        tokens = [e for e in events if e.type == "token"]
        assert [e.text for e in tokens] == [*texts, "!"] and tokens[-1].logprobs.logprob == -0.5
        joined_id = tokens[5].entry_id  # the joined entry's last token has the entry's id, the others "@<i>"
        assert [e.entry_id for e in tokens[1:5]] == [f"{joined_id}@{i}" for i in range(1, 5)]
        for k in range(6):  # a reader resuming from any token's id gets exactly the tokens after it
            again = list(service.client.job(job_id).events(timeout=10, last_id=tokens[k].entry_id))
            assert [e.text for e in again if e.type == "token"] == [*texts, "!"][k + 1 :], k
        assert resume_from("5-0@3") == ("4-18446744073709551615", 4) and resume_from("5-2@3") == ("5-1", 4)
    finally:
        pub.close()
