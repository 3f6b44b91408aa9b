"""REDIS_URL forms and the failover-related settings (the real Sentinel runs are in test_sentinel.py)."""

from __future__ import annotations

import pytest
import redis
from pydantic import ValidationError
from weightq.celery_config import celery_config
from weightq.redis_conn import NotReplicated, connect, connect_streams, is_transient, parse_sentinel
from weightq.settings import Settings

URL = "sentinel://:s3cret@10.0.0.1:26379/2;sentinel://10.0.0.2;sentinel://10.0.0.3:26380"


def test_sentinel_urls_are_kombus_form():
    t = parse_sentinel(URL)
    assert t.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("10.0.0.3", 26380))
    assert (t.db, t.password, t.username) == (2, "s3cret", None)
    with pytest.raises(ValueError, match="REDIS_URL"):
        parse_sentinel("sentinel://a:1;redis://b:2")


def test_celery_gets_the_master_name_and_weightqs_transport():
    s = Settings(redis_url=URL, redis_sentinel_master="jobs", redis_sentinel_password="pw")
    conf = celery_config(s)
    assert conf["broker_url"] == conf["result_backend"] == URL
    assert conf["broker_transport"] == "weightq.transport:SentinelTransport"
    assert conf["broker_transport_options"]["master_name"] == "jobs"
    assert conf["broker_transport_options"]["visibility_timeout"] == s.worker.visibility_timeout_s
    assert conf["broker_transport_options"]["unacked_mutex_expire"] == 10  # a killed holder blocks restores
    assert conf["result_backend_transport_options"] == {"master_name": "jobs", "sentinel_kwargs": {"password": "pw"}}
    plain = celery_config(Settings(redis_url="redis://h:1/0"))
    assert plain["broker_transport"] == "weightq.transport:Transport"
    assert "result_backend_transport_options" not in plain


def test_replies_of_a_failing_over_master_are_transient_and_others_are_not():
    wrapped = "Error running script (call to f_1): @user_script:1: -NOREPLICAS Not enough good replicas to write."
    assert is_transient(redis.ResponseError(wrapped))
    assert is_transient(redis.ResponseError("NOREPLICAS Not enough good replicas to write."))
    assert is_transient(redis.ReadOnlyError("You can't write against a read only replica."))
    assert is_transient(NotReplicated("a write reached 0 of 1"))
    try:
        raise RuntimeError("wrapped by a library") from redis.ConnectionError("gone")
    except RuntimeError as e:
        assert is_transient(e)
    assert not is_transient(redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    assert not is_transient(ValueError("NOREPLICAS in a message that is not Redis's"))


def test_wait_replicas_is_a_count_or_all_and_errors_name_the_variable():
    assert Settings.from_env({"REDIS_WAIT_REPLICAS": "all"}).redis.wait_replicas == "all"
    assert Settings.from_env({"REDIS_WAIT_REPLICAS": "2"}).redis.wait_replicas == 2
    for bad in ("-1", "most"):
        with pytest.raises((ValueError, ValidationError), match="REDIS_WAIT_REPLICAS"):
            Settings.from_env({"REDIS_WAIT_REPLICAS": bad}).check()


def test_logged_urls_hide_passwords():
    from weightq.redis_conn import redacted

    assert redacted(URL) == URL.replace("s3cret", "***")
    assert redacted("rediss://user:pw@h:1/0") == "rediss://user:***@h:1/0"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"


def test_the_streams_redis_is_the_brokers_unless_set_and_may_be_another_sentinel_group():
    broker = "sentinel://s1:26379/0"
    same = Settings(redis_url=broker, redis_sentinel_master="jobs")
    assert same.redis.streams_urls()[0] == broker
    assert connect_streams(same.redis).connection_pool.service_name == "jobs"
    assert Settings(redis_url="redis://b:1/0").redis.streams_urls("redis://other:2/0")[0] == "redis://other:2/0"
    split = Settings(
        redis_url=broker, streams_redis_url="sentinel://s2:26379/1", redis_sentinel_master="jobs",
        streams_sentinel_master="tokens",
    )  # fmt: skip
    assert split.redis.streams_urls()[0] == "sentinel://s2:26379/1"
    assert connect_streams(split.redis).connection_pool.service_name == "tokens"
    assert connect(broker, split.redis).connection_pool.service_name == "jobs"
    assert celery_config(split)["broker_url"] == broker  # Celery never sees the streams' Redis
    unnamed = Settings(redis_url=broker, streams_redis_url="sentinel://s2:26379/1", redis_sentinel_master="jobs")
    assert connect_streams(unnamed.redis).connection_pool.service_name == "jobs"


def test_a_listed_token_plane_is_sharded_by_job_id_home_first():
    from collections import Counter

    from weightq.tasks.contract import shard_of
    from weightq.token_plane import TokenPlane

    s = Settings(redis_url="redis://b:1/0", streams_redis_url=" redis://s0:1/0, redis://s1:1/0 ,redis://s2:1/0")
    assert s.redis.streams_urls() == ["redis://s0:1/0", "redis://s1:1/0", "redis://s2:1/0"]
    assert s.redis.streams_urls()[0] == "redis://s0:1/0"  # the home: heartbeats, leases, LoRA
    assert Settings(redis_url="redis://b:1/0").redis.streams_urls() == ["redis://b:1/0"]
    with pytest.raises(ValueError, match="listed twice"):
        Settings(streams_redis_url="redis://s0:1/0,redis://s0:1/0").check()
    # the shard is a function of the id alone, the same in every process, spread evenly
    ids = [f"job-{n}" for n in range(3000)]
    spread = Counter(shard_of(j, 3) for j in ids)
    assert set(spread) == {0, 1, 2} and min(spread.values()) > 900
    assert shard_of("job-7", 1) == 0 and shard_of("job-7", 3) == shard_of("job-7", 3)
    plane = TokenPlane.connect(s.redis)
    assert len(plane) == 3 and plane.home is plane.shards[0]
    split = plane.split(ids[:50])
    assert sorted(j for part in split.values() for j in part) == sorted(ids[:50])
    assert all(plane.index(j) == n for n, part in split.items() for j in part)
    assert plane.of("job-7") is plane.shards[shard_of("job-7", 3)]
    assert plane.durable("job-7") is plane.durables[shard_of("job-7", 3)]


def test_commands_packed_in_c_are_the_bytes_redis_py_packs_and_refuse_what_it_refuses(redis_url):
    from redis._parsers.encoders import Encoder
    from redis.connection import PythonRespSerializer
    from weightq.redis_conn import CPacker

    python = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    packer = CPacker()
    for args in [
        ("EVALSHA", "a" * 40, 2, "k1", "k2", 0, -1, 2**70, 0.1 + 0.2, 1e-05, float("inf"), "é ✓", b"\x00\xff"),
        ("CLIENT SETNAME", "n"),  # redis-py splits a command name given with its subcommand
        (b"XINFO STREAM", "s"),
        ("SET", "k", memoryview(b"v")),
        ("SET", "k", bytearray(b"v")),  # hiredis refuses it: redis-py's way
    ]:
        assert b"".join(packer.pack(*args)) == b"".join(python.pack(*args)), args
    with pytest.raises(redis.DataError, match="bool"):
        packer.pack("SET", "k", True)
    r = connect(redis_url, Settings(redis_url=redis_url).redis)
    assert isinstance(r.connection_pool.connection_kwargs["command_packer"], CPacker)  # every client we open
    pipe = r.pipeline(transaction=False)
    pipe.set("packed", "é").get("packed").xadd("packed-s", {"n": 1.5, "t": "x y"})
    assert pipe.execute()[:2] == [True, "é".encode()]
    assert r.xrange("packed-s")[0][1] == {b"n": b"1.5", b"t": b"x y"}
    r.execute_command("CLIENT SETNAME", "weightq-test")
    assert r.client_getname() in ("weightq-test", b"weightq-test")  # redis-py decodes this one


def test_a_first_contact_passes_on_a_live_redis_and_names_the_variable_of_a_dead_one(redis_url):
    from weightq.cli.redis_server import free_port
    from weightq.redis_conn import RedisUnreachable, check_reachable

    dead = f"redis://127.0.0.1:{free_port()}/0"
    conf = Settings(redis_url=redis_url, streams_redis_url=f"{redis_url},{dead}").redis
    check_reachable(redis_url, conf)
    with pytest.raises(RedisUnreachable, match=rf"^cannot reach Redis at {dead} .*it is in STREAMS_REDIS_URL"):
        check_reachable(dead, conf)
