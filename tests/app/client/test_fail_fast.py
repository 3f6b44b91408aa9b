"""A client or command whose Redis does not answer fails at once, naming the URL, why that URL, and the
fix; a Redis that answered once and went away is waited for (REDIS_RETRY_S)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
from weightq.cli.redis_server import EmbeddedRedis, free_port
from weightq.tasks.contract import job_key

ROOT = Path(__file__).resolve().parents[3]

# Runs in a process of its own with REDIS_RETRY_S an hour: a client that waited instead of failing
# would be stopped by the subprocess timeout, a failure and not a hang.
FIRST_CALL = """
import json, sys
from weightq.client import Client, RedisUnreachable
client = Client()  # contacts nothing: a failure here fails the test
try:
    if sys.argv[1] == "submit":
        client.submit("hello", max_new_tokens=4)
    else:
        client.job("0123abcd").result()
    print(json.dumps({"error": None}))
except RedisUnreachable as e:
    import redis
    print(json.dumps({"error": str(e), "connection_error": isinstance(e, redis.ConnectionError)}))
"""


def first_call(home: Path, call: str = "submit", **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    full = base | {"WEIGHTQ_HOME": str(home), "REDIS_RETRY_S": "3600"} | env
    out = subprocess.run([sys.executable, "-c", FIRST_CALL, call], cwd=ROOT, env=full, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_redis_url_and_no_embedded_redis_fails_at_the_first_call_naming_the_fix(tmp_path):
    try:
        redis.Redis(port=6379, socket_connect_timeout=1).ping()
        pytest.skip("a Redis answers on 127.0.0.1:6379 here: the default would be reached")
    except redis.RedisError:
        pass
    for call in ("submit", "result"):  # a result read does not loop on a Redis that never answered
        got = first_call(tmp_path, call)
        assert got["connection_error"], got
        message = got["error"]
        assert message.startswith("cannot reach Redis at redis://127.0.0.1:6379/0"), message
        assert "REDIS_URL is unset and no embedded Redis is running" in message
        assert str(tmp_path / "redis" / "url") in message
        assert "Set REDIS_URL" in message and "`weightq up`" in message and "`weightq redis`" in message


def test_a_recorded_embedded_redis_that_is_not_running_is_named_as_such(tmp_path):
    (tmp_path / "redis").mkdir()
    dead = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    (tmp_path / "redis" / "url").write_text(dead)
    message = first_call(tmp_path)["error"]
    assert f"recorded in {tmp_path / 'redis' / 'url'} is not running" in message, message
    assert "`weightq up`" in message and "s3cret" not in message and "redis://:***@127.0.0.1" in message


def test_an_unreachable_redis_url_names_the_variable_and_hides_its_password(tmp_path):
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    message = first_call(tmp_path, REDIS_URL=url)["error"]
    assert message.startswith(f"cannot reach Redis at redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]}"), message
    assert "REDIS_URL names it" in message and "s3cret" not in message


def test_a_redis_that_answered_once_is_waited_for_when_it_restarts(tmp_path):
    from weightq.client import Client
    from weightq.settings import Settings

    server = EmbeddedRedis(tmp_path / "r", appendfsync="everysec")
    url = server.start()
    client = Client(url, settings=Settings(redis_url=url, redis_retry_s=120))
    client.ping()
    server.stop()
    again = EmbeddedRedis(tmp_path / "r", port=server.port, appendfsync="everysec")
    restart = threading.Timer(1.0, again.start)
    restart.start()
    try:
        job = client.submit("hello", max_new_tokens=4)  # waits out the restart (REDIS_RETRY_S)
        restart.join()
        assert redis.Redis.from_url(url).hget(job_key(job.id), "state") == b"queued"
    finally:
        restart.cancel()
        restart.join()
        again.stop()
