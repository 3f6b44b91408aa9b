"""What a stack exposes on its own host (issue 31's findings, moved from test_hostile.py, which tests a
running stack): Flower binds loopback unless it asks for a password, and the embedded Redis has a
password that only its owner can read."""

from __future__ import annotations

import stat

import pytest
import redis

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def test_flower_listens_on_loopback_unless_it_asks_for_a_password(monkeypatch):
    from weightq.cli.stack import Stack
    from weightq.settings import Settings

    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    stack = Stack(Settings(), host="0.0.0.0", flower_port=5555)
    assert "--address=127.0.0.1" in stack.flower_command() and not any("auth" in a for a in stack.flower_command())
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "admin:pw")
    assert {"--address=0.0.0.0", "--basic-auth=admin:pw"} <= set(stack.flower_command())


def test_the_embedded_redis_has_a_password_only_its_owner_reads(tmp_path):
    from weightq.cli.redis_server import ensure_redis
    from weightq.settings import Settings

    url = ensure_redis(Settings(weightq_home=str(tmp_path)).redis)
    try:
        for name in ("password", "url"):
            assert stat.S_IMODE((tmp_path / "redis" / name).stat().st_mode) == 0o600
        password = (tmp_path / "redis" / "password").read_text().strip()
        assert len(password) >= 32 and f":{password}@" in url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=int(url.rsplit(":", 1)[1].split("/")[0])).ping()
        assert Settings(weightq_home=str(tmp_path)).redis.resolved_url() == url  # what clients read
    finally:
        redis.Redis.from_url(url).shutdown(nosave=True)
