"""The worker's result backend (app/worker/result_backend.py) on a real Redis: one round trip per result, and
what it stores is what Celery's own backend stores and reads."""

from __future__ import annotations

import json

import redis
from celery import Celery, states
from celery.backends.redis import RedisBackend, SentinelBackend
from weightq.celery import WorkerCelery
from weightq.worker.result_backend import OneTripStore, one_trip


def _apps(url: str, **conf) -> tuple[Celery, Celery]:
    ours, stock = WorkerCelery("ours"), Celery("stock")
    for app in (ours, stock):
        app.conf.update(result_backend=url, result_serializer="json", result_expires=600, **conf)
    return ours, stock


def test_a_result_is_stored_published_and_read_as_celerys_own(redis_url):
    ours, stock = _apps(redis_url)
    assert isinstance(ours.backend, OneTripStore) and isinstance(ours.backend, RedisBackend)
    r = redis.Redis.from_url(redis_url)
    key = ours.backend.get_key_for_task("rb-1")
    sub = r.pubsub()
    sub.subscribe(key)
    sub.get_message(timeout=2)  # the subscription's confirmation
    ours.backend.store_result("rb-0", None, states.SUCCESS)  # the script loaded once (another channel)
    commands = r.info("commandstats")
    ours.backend.store_result("rb-1", {"text": "hi"}, states.SUCCESS)
    after = r.info("commandstats")
    calls = {k: after[k]["calls"] - commands.get(k, {"calls": 0})["calls"] for k in after}
    assert calls.get("cmdstat_evalsha", 0) + calls.get("cmdstat_eval", 0) == 1
    assert calls.get("cmdstat_multi", 0) == 0  # Celery's own: GET, then MULTI SETEX PUBLISH EXEC
    message = sub.get_message(timeout=5)
    assert message and json.loads(message["data"])["status"] == states.SUCCESS
    assert 0 < r.ttl(key) <= 600
    assert stock.AsyncResult("rb-1").get(timeout=5) == {"text": "hi"}
    stored = json.loads(r.get(key))
    stock.backend.store_result("rb-2", {"text": "hi"}, states.SUCCESS)
    expected = json.loads(r.get(stock.backend.get_key_for_task("rb-2")))
    assert stored.keys() == expected.keys() and stored["task_id"] == "rb-1"
    assert {k: v for k, v in stored.items() if k not in ("task_id", "date_done")} == {
        k: v for k, v in expected.items() if k not in ("task_id", "date_done")
    }


def test_a_success_is_never_overwritten_and_failures_keep_their_own_expiry(redis_url):
    ours, stock = _apps(redis_url, result_failure_expires=60)
    ours.backend.store_result("rb-3", 7, states.SUCCESS)
    ours.backend.store_result("rb-3", ValueError("late duplicate"), states.FAILURE)
    assert stock.AsyncResult("rb-3").get(timeout=5) == 7
    ours.backend.store_result("rb-4", ValueError("boom"), states.FAILURE)
    assert stock.AsyncResult("rb-4").state == states.FAILURE
    assert 0 < redis.Redis.from_url(redis_url).ttl(ours.backend.get_key_for_task("rb-4")) <= 60
    ours.backend.store_result("rb-4", 8, states.SUCCESS)  # a retry that succeeds replaces a failure
    assert stock.AsyncResult("rb-4").get(timeout=5) == 8


def test_a_value_the_script_cannot_read_takes_celerys_own_check(redis_url):
    """Compressed results are bytes Lua cannot decode: Celery's path decodes them and keeps a SUCCESS."""
    ours, stock = _apps(redis_url, result_compression="zlib")
    ours.backend.store_result("rb-5", "first", states.SUCCESS)
    assert redis.Redis.from_url(redis_url).get(ours.backend.get_key_for_task("rb-5"))[:1] != b"{"
    ours.backend.store_result("rb-5", "second", states.SUCCESS)
    assert stock.AsyncResult("rb-5").get(timeout=5) == "first"


def test_only_redis_backends_change():
    assert issubclass(one_trip(SentinelBackend), SentinelBackend)
    assert issubclass(one_trip(SentinelBackend), OneTripStore)
    assert one_trip(Celery) is Celery
