"""Hostile and malformed input: property-based fuzzing of the request schema, the API mappings and
every HTTP route of a live gateway, plus a flood of connections opened and dropped.

Every refusal must be a RequestError (in code) or a 4xx naming the field (over HTTP); nothing may
raise anything else, answer 5xx, or crash the worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.gateway import openai_api, tgi_api
from weightq.tasks.limits import Door
from weightq.tasks.request import FIELDS, RequestError, parse_request

pytestmark = pytest.mark.service  # real Redis servers and worker processes

EXAMPLES = int(os.environ.get("WEIGHTQ_EXAMPLES", "150"))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", " ", "\t\n", "\ud800", "x" * 5000, "🎉" * 50]),
)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5), max_leaves=20
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "robot", 3]), "content": json_values}
    ),
    max_size=4,
)


def request_dicts(names: set[str]) -> st.SearchStrategy[dict]:
    keys = st.sampled_from(sorted(names)) | st.text(max_size=10)
    return st.dictionaries(keys, json_values | messages, max_size=8)


def test_lone_surrogates_are_refused_by_field():
    """JSON can carry "\\ud800", which no UTF-8 encoder accepts (found by the live route fuzzing: a TGI
    request with such inputs reached the worker and never ended)."""
    for data, field in (({"prompt": "\ud800"}, "prompt"), ({"prompt": "a", "stop": ["x\udfff"]}, "stop"),
                        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content")):  # fmt: skip
        with pytest.raises(RequestError) as e:
            parse_request(data)
        assert e.value.field == field


def test_stop_token_ids_are_checked_by_field():
    assert parse_request({"prompt": "a", "stop_token_ids": [3, 5]}).stop_token_ids == (3, 5)
    for bad in ("7", [True], [-1], [2**31], list(range(65)), {"a": 1}):
        with pytest.raises(RequestError) as e:
            parse_request({"prompt": "a", "stop_token_ids": bad})
        assert e.value.field == "stop_token_ids"


@settings(max_examples=EXAMPLES * 4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_dicts(FIELDS) | json_values)
def test_contract_refuses_by_field_or_accepts(data):
    from weightq.worker.to_engine import engine_request

    try:
        job = parse_request(data)
    except RequestError as e:
        assert e.field and str(e).startswith(e.field)
        return
    assert parse_request(json.loads(json.dumps(job.to_json()))) == job  # the worker reads what was sent
    engine_request("j", job)  # and gives it to its engine as it is


@settings(max_examples=EXAMPLES * 4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_dicts(openai_api.COMPLETION_FIELDS | openai_api.CHAT_FIELDS) | json_values, st.booleans())
def test_openai_mapping_refuses_by_field_or_yields_a_valid_job(body, chat):
    try:
        job = openai_api.chat_job(body, "m") if chat else openai_api.completion_job(body, "m")
        parse_request(job, Door.CHAT if chat else Door.COMPLETIONS)
    except RequestError as e:
        assert e.field


@settings(max_examples=EXAMPLES * 4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({"inputs": json_values, "parameters": request_dicts(tgi_api.PARAMETERS) | json_values})
       | json_values)  # fmt: skip
def test_tgi_mapping_refuses_by_field_or_yields_a_valid_job(body):
    try:
        job, _ = tgi_api.job_request(body)
        parse_request(job, Door.TGI)
    except RequestError as e:
        assert e.field


# ----- against a live gateway -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(redis_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("fuzz")
    redis.Redis.from_url(redis_url).flushall()
    worker = WorkerProcess(redis_url, "fuzz@test", home, max_batch_weight=4096, max_total_tokens=64, concurrency=64)
    gateway = GatewayProcess(redis_url, home)
    worker.wait_ready()
    gateway.wait_ready()
    yield worker, gateway
    gateway.stop()
    worker.stop()
    worker.kill()


ROUTES = {
    "/v1/completions": openai_api.COMPLETION_FIELDS,
    "/v1/chat/completions": openai_api.CHAT_FIELDS,
    "/generate": {"inputs", "parameters"},
    "/generate_stream": {"inputs", "parameters"},
    "/": {"inputs", "parameters", "stream"},
    "/v1/load_lora_adapter": {"lora_name", "lora_path"},
    "/v1/unload_lora_adapter": {"lora_name"},
}
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"[" * 50_000 + b"]" * 50_000, b'{"a":' * 10_000, b"\xff\xfe", b"", b"null", b"{}"]),
)


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()
        detail = err["error"] if isinstance(err.get("error"), dict) else err
        assert detail.get("message") or detail.get("error")
        assert "param" in detail or "field" in detail


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(ROUTES)), st.data())
def test_every_route_answers_bad_input_with_a_4xx_naming_the_field(live, route, data):
    _, gateway = live
    if data.draw(st.booleans()):
        content = data.draw(raw_bodies)
    else:
        body = data.draw(request_dicts(ROUTES[route]))
        content = json.dumps(body, allow_nan=True).encode()
    with httpx.Client(base_url=gateway.base, timeout=60) as http:
        r = http.post(route, content=content, headers={"content-type": "application/json"})
        check(r)


def test_thousands_of_connections_opened_and_dropped(live):
    worker, gateway = live
    host, port = "127.0.0.1", int(gateway.base.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "flood", "max_tokens": 40, "ignore_eos": True, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip

    async def one(i: int) -> None:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            return
        if i % 3 == 0:
            writer.write(request[: len(request) // 2])  # a half-sent request
        elif i % 3 == 1:
            writer.write(request)  # a full streaming request, then gone before reading much
            await asyncio.sleep(0.05)
        writer.close()

    async def flood() -> None:
        await asyncio.gather(*(one(i) for i in range(2000)))

    asyncio.run(flood())
    deadline = time.monotonic() + 300  # ~700 jobs to cancel or finish; slower on a busy machine
    while True:
        try:
            healthy = httpx.get(gateway.base + "/health", timeout=30).status_code == 200
        except httpx.TransportError:
            healthy = False
        stats = worker.wait_stats()
        if healthy and stats["running"] == 0 and stats["waiting"] == 0 and stats["active_jobs"] == 0:
            break
        assert time.monotonic() < deadline, stats
    assert stats["kv_blocks_used"] == 0
    ok = httpx.post(gateway.base + "/v1/completions", json={"prompt": "after the flood", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and worker.proc.poll() is None


def test_the_fuzzed_routes_are_every_post_route_of_the_openapi_document(live):
    _, gateway = live
    paths = httpx.get(gateway.base + "/openapi.json", timeout=10).json()["paths"]
    assert {p for p, ops in paths.items() if "post" in ops} == set(ROUTES)


@pytest.mark.parametrize("ours", sorted(openai_api.CLIENT_FIELDS))
def test_weightqs_own_name_at_the_openai_door_names_openais(ours):
    """A client that sends weightq's field name (max_new_tokens) to an OpenAI route is told OpenAI's."""
    with pytest.raises(RequestError) as refused:
        openai_api.completion_job({"prompt": "hi", ours: 3}, "m")
    assert refused.value.field == ours
    assert f"OpenAI's name for it: {openai_api.CLIENT_FIELDS[ours]}" in str(refused.value)
