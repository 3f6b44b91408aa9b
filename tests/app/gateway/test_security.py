"""Security: a password-protected Redis end to end, TLS settings, and the gateway's bind guard."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys

import httpx
import pytest
import redis
from weightq.celery_config import celery_config
from weightq.cli.processes import ROOT, GatewayProcess, WorkerProcess
from weightq.cli.redis_server import EmbeddedRedis
from weightq.client import Client
from weightq.settings import Settings

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def test_a_password_protected_redis_works_end_to_end(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis", password="s3cret-pw")
    url = server.start()
    assert url.startswith("redis://:s3cret-pw@")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port).ping()  # no password: refused
    worker = WorkerProcess(url, "pw@test", tmp_path, max_batch_weight=2048)
    gateway = GatewayProcess(url, tmp_path)
    try:
        worker.wait_ready()
        gateway.wait_ready()
        job = Client(url, settings=Settings(redis_url=url)).submit("locked", max_new_tokens=4)
        assert job.result(timeout=60)["usage"]["completion_tokens"] == 4
        r = httpx.post(gateway.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        gateway.stop()
        worker.stop()
        worker.kill()
        server.stop()


def test_rediss_urls_get_certificate_checking_for_broker_and_backend():
    cfg = celery_config(Settings(redis_url="rediss://:pw@redis.example:6380/0", redis_ssl_ca_certs="/etc/ca.pem"))
    want = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/ca.pem"}
    assert cfg["broker_use_ssl"] == want and cfg["redis_backend_use_ssl"] == want
    assert "broker_transport" not in cfg  # kombu's own transport handles TLS
    with pytest.raises(ValueError, match="REDIS_SSL_CERT_REQS"):
        celery_config(Settings.from_env({"REDIS_URL": "rediss://h/0", "REDIS_SSL_CERT_REQS": "maybe"}))
    assert "broker_use_ssl" not in celery_config(Settings(redis_url="redis://h/0"))


def test_gateway_refuses_a_public_bind_without_an_api_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "API_KEY"} | {"WEIGHTQ_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "weightq.cli", "gateway", "--host", "0.0.0.0", "--port", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0 and "refusing to serve 0.0.0.0 without an API key" in out.stderr


def test_probes_are_open_the_docs_need_a_key_and_the_metrics_key_reads_only_the_metrics(redis_url, tmp_path):
    """Kubernetes probes need no key and mean what they say (/live: the process; /ready: its Redis,
    not the workers, which may be scaled to zero); /docs and /openapi.json are behind the key; a
    METRICS_KEY (Prometheus' one credential beside several API keys) reads the metrics and nothing else."""
    gateway = GatewayProcess(redis_url, tmp_path, api_key="k1,k2", metrics_key="scraper").wait_ready()
    try:

        def get(path: str, key: str | None = None) -> int:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.get(gateway.base + path, headers=headers, timeout=30).status_code

        assert get("/live") == get("/ready") == 200 and get("/health") == 503  # no worker: alive and ready
        assert get("/docs") == get("/openapi.json") == 401 and get("/openapi.json", "k2") == 200
        assert get("/metrics", "scraper") == get("/metrics/cluster", "scraper") == 200
        assert get("/metrics") == 401 and get("/v1/models", "scraper") == 401
        assert get("/metrics/cluster", "k1") == 200
    finally:
        gateway.stop()
