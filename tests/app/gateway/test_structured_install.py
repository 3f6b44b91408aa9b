"""Structured output installed where it is used (issue 40): a worker without a grammar engine says so in
its heartbeat, and a job asking for structured output is refused at submission, naming the field and
the install that serves it, by the Python client and by the gateway (which names the OpenAI field):
it never waits its turn to fail at the worker."""

from __future__ import annotations

import httpx
import pytest
from weightq.cli.processes import GatewayProcess
from weightq.tasks.request import RequestError

pytestmark = pytest.mark.service  # real Redis servers and worker processes

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_worker_without_xgrammar_gets_no_structured_job(service, tmp_path):
    hidden = tmp_path / "hide"
    (hidden / "xgrammar").mkdir(parents=True)
    (hidden / "xgrammar" / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    worker = service.worker(runner="simulated", sim_step_cost="0.001,0,0", pythonpath=str(hidden)).wait_ready()
    assert worker.stats()["structured"] is False
    with pytest.raises(RequestError, match="xgrammar") as refused:
        service.client.submit("{", max_new_tokens=8, guided={"json_schema": SCHEMA})
    assert refused.value.field == "guided"
    assert service.client.submit("plain text is fine", max_new_tokens=3).result(timeout=60)
    gateway = GatewayProcess(service.url, tmp_path).wait_ready()
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
                "response_format": {"type": "json_object"}}  # fmt: skip
        r = httpx.post(gateway.base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "xgrammar" in r.text and r.json()["error"]["param"] == "response_format"
    finally:
        gateway.stop()
