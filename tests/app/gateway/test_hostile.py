"""Hostile and careless clients (issue 31): one test per finding, against a real stack (Redis, a worker
with its engine in a process of its own, a keyless gateway and one with two keys), and property-based
fuzzing of both front doors' JSON while another client's stream runs. Nothing here may answer 5xx,
stall another client, or let one tenant read, resume or cancel another's job.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.tasks.contract import EntryType, job_key, stream_key
from weightq.tasks.limits import OPEN_MAX_PRIORITY

pytestmark = pytest.mark.service  # real Redis servers and worker processes

EXAMPLES = int(os.environ.get("WEIGHTQ_EXAMPLES", "150"))
KEYS = ("key-alice", "key-bob")


@pytest.fixture(scope="module")
def hostile(redis_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("hostile")
    redis.Redis.from_url(redis_url).flushall()
    worker = WorkerProcess(
        redis_url, "hostile@test", home, max_batch_weight=8192, max_total_tokens=1024, concurrency=64,
        engine_process="on", grammar_compile_timeout_s=3,
    )  # fmt: skip
    open_gw = GatewayProcess(redis_url, home, body_timeout_s=2)  # keyless, on loopback: the defaults
    keyed = GatewayProcess(redis_url, home, api_key=",".join(KEYS))  # the keys' default limits
    worker.wait_ready()
    open_gw.wait_ready()
    keyed.wait_ready()

    class Stack:
        url = redis_url
        base = open_gw.base
        keyed_base = keyed.base
        r = redis.Redis.from_url(redis_url, decode_responses=True)

        @staticmethod
        def as_key(key: str) -> dict:
            return {"Authorization": f"Bearer {key}"}

        @staticmethod
        def alive() -> bool:
            return worker.proc.poll() is None

        @staticmethod
        def stats(ok=lambda s: True) -> dict:
            return worker.wait_stats(ok)

        @staticmethod
        def log() -> str:
            return worker.log()

    yield Stack
    keyed.stop()
    open_gw.stop()
    worker.stop()
    worker.kill()


def post(base: str, path: str, body: dict, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=headers, timeout=timeout)


def param(r: httpx.Response) -> str | None:
    body = r.json()
    return body["error"]["param"] if isinstance(body.get("error"), dict) else body.get("field")


def stream_lines(base: str, body: dict, headers: dict | None = None, stop_after: int | None = None):
    """(status, [(SSE id, data)] ...) of a streamed completion; closes the connection after
    `stop_after` data lines (a client going away)."""
    events, sid = [], None
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text
        for line in r.iter_lines():
            if line.startswith("id: "):
                sid = line[4:]
            elif line.startswith("data: "):
                events.append((sid, line[6:]))
                if stop_after is not None and len(events) >= stop_after:
                    break
    return 200, events


def job_keys(stack) -> set[str]:
    return set(stack.r.scan_iter("weightq:job:*"))


def wait_for(check, timeout: float = 60, what: str = ""):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return result


LONG = {"prompt": "The scheduler admits", "max_tokens": 300, "ignore_eos": True, "stream": True}


def text_of(events: list) -> str:
    chunks = [json.loads(d) for _, d in events if d.startswith("{")]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


# ----- crossing tenants -------------------------------------------------------------------------------
def test_another_tenant_can_neither_resume_nor_replay_a_job(hostile):
    alice, bob = hostile.as_key(KEYS[0]), hostile.as_key(KEYS[1])
    status, events = stream_lines(hostile.keyed_base, {**LONG, "max_tokens": 8}, alice)
    assert status == 200
    job_id = events[0][0].split("/")[0]
    resume = {"Last-Event-ID": f"{job_id}/0-0"}
    for who in (bob, {}):  # another key, and no key at all
        r = post(hostile.keyed_base, "/v1/completions", {**LONG, "max_tokens": 8}, who | resume)
        assert r.status_code in (401, 404), r.text
    r = post(hostile.keyed_base, "/v1/completions", {**LONG, "max_tokens": 8}, bob | resume)
    unknown = post(
        hostile.keyed_base, "/v1/completions", {**LONG, "max_tokens": 8}, bob | {"Last-Event-ID": "nope/0-0"}
    )
    assert r.status_code == unknown.status_code == 404 and r.json()["error"]["message"].endswith("unknown or expired")
    status, again = stream_lines(hostile.keyed_base, {**LONG, "max_tokens": 8}, alice | resume)  # its owner may
    assert status == 200 and text_of(again) == text_of(events)
    assert hostile.r.hget(job_key(job_id), "tenant").startswith("key-") and KEYS[0] not in json.dumps(
        hostile.r.hgetall(job_key(job_id))
    )  # a hash of the key, never the key


def test_a_second_follower_of_a_live_stream_is_served_and_cancels_nothing(hostile):
    alice = hostile.as_key(KEYS[0])
    with httpx.stream("POST", hostile.keyed_base + "/v1/completions", json=LONG, headers=alice, timeout=60) as r:
        lines = r.iter_lines()
        sid = next(line[4:] for line in lines if line.startswith("id: "))
        job_id = sid.split("/")[0]
        # the same client resumes the live stream on the same gateway: served (was a 500), then it leaves
        status, seen = stream_lines(hostile.keyed_base, LONG, alice | {"Last-Event-ID": sid}, stop_after=3)
        assert status == 200 and len(seen) == 3
        got, done = 0, False
        for line in lines:  # the original keeps streaming to its end
            got += line.startswith("data: {")
            if done := line == "data: [DONE]":
                break
    result = json.loads(hostile.r.hget(job_key(job_id), "result"))
    assert result["finish_reason"] == "length" and result["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert done and got >= 2  # its tokens, joined a few to a chunk (STREAM_FLUSH_MS), and its end


def test_the_prefix_cache_is_per_tenant(hostile):
    prompt = " ".join(f"secret{i}" for i in range(80))  # several 16-token blocks
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    cached = lambda key: post(hostile.keyed_base, "/v1/completions", body, hostile.as_key(key)).json()["usage"][  # noqa: E731
        "prompt_tokens_details"
    ]["cached_tokens"]
    cached(KEYS[0])
    assert cached(KEYS[0]) > 0  # its own prompt, cached
    assert cached(KEYS[1]) == 0  # another tenant learns nothing of it


# ----- a 4xx naming the field, before any work or write -----------------------------------------------
DEEP = json.loads('{"type":"object","properties":{"a":' * 300 + "{}" + "}}" * 300)  # 601 levels


@pytest.mark.parametrize(
    ("path", "body", "headers", "field"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 1}, {"X-Priority": "²".encode()}, "X-Priority"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1}, {"X-Priority": "5" * 5001}, "X-Priority"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logit_bias": {"²": 1}}, {}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": "7", "n": 2}, {}, "seed"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": 2**63 - 1, "n": 2}, {}, "seed"),
        ("/v1/completions", {"prompt": [""] * 300_000, "max_tokens": 1}, {}, "prompt"),
        ("/v1/completions", {"prompt": [7] * 300_000, "n": 32, "max_tokens": 1}, {}, "prompt"),
        ("/generate", {"inputs": "x" * 900_000, "parameters": {"best_of": 8, "do_sample": True}}, {}, "inputs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"schema": DEEP}}}, {}, "response_format"),
    ],
    ids=["priority-superscript", "priority-5001-digits", "logit-bias-superscript", "string-seed-n2",
         "seed-overflow-n2", "300k-prompts", "300k-ids-x32", "tgi-best-of-huge", "schema-900-deep"],
)  # fmt: skip
def test_hostile_inputs_are_a_4xx_naming_the_field_before_any_job(hostile, path, body, headers, field):
    before = job_keys(hostile)
    r = httpx.post(hostile.base + path, content=json.dumps(body), timeout=60,
                   headers={"Content-Type": "application/json", **headers})  # fmt: skip
    assert r.status_code == 400 and param(r) == field, r.text[:500]
    assert job_keys(hostile) == before  # nothing written


def test_keyless_callers_cannot_take_the_top_priority_classes(hostile):
    r = post(hostile.base, "/v1/completions", {"prompt": "now", "max_tokens": 1}, {"X-Priority": "9"})
    assert r.status_code == 200
    request = json.loads(hostile.r.hget(job_key(r.json()["id"].removeprefix("cmpl-")), "request"))
    assert request["priority"] == OPEN_MAX_PRIORITY < 9


def test_a_request_is_stored_once(hostile):
    ids = [10 + i % 1000 for i in range(600)]
    r = post(hostile.base, "/v1/completions", {"prompt": ids, "max_tokens": 2})
    job_id = r.json()["id"].removeprefix("cmpl-")
    assert json.loads(hostile.r.hget(job_key(job_id), "request"))["prompt_token_ids"] == ids  # for recovery
    meta = wait_for(lambda: hostile.r.get(f"celery-task-meta-{job_id}"), what="Celery's result")
    assert "prompt_token_ids" not in meta and "args" not in json.loads(meta)  # not again, for RESULT_TTL_S


# ----- wrong answers --------------------------------------------------------------------------------------
def test_a_temperature_below_1e_5_is_greedy(hostile):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    greedy = post(hostile.base, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    for t in (1e-45, 5e-324, 9e-6):
        r = post(hostile.base, "/v1/completions", {**body, "temperature": t})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy


def test_a_grammar_no_text_satisfies_is_refused(hostile):
    r = post(
        hostile.base, "/generate", {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "[^\\s\\S]"}}}
    )
    assert r.status_code == 400 and r.json()["field"] == "parameters.grammar" and "empty" in r.json()["error"]


# ----- one request stalls no one ---------------------------------------------------------------------------
def test_a_slow_grammar_is_refused_and_holds_up_no_other_stream(hostile):
    # 1,800 optional properties: within the contract's 65,536 characters, minutes for xgrammar to compile
    slow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1800)}}
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"schema": slow}}}  # fmt: skip
    result: dict = {}

    def slow_request() -> None:
        try:
            result["r"] = post(hostile.base, "/v1/chat/completions", body, timeout=300)
        except Exception as e:
            result["r"] = e

    t = threading.Thread(target=slow_request)
    t.start()
    time.sleep(1.5)  # it reached the worker: another client's stream starts while it compiles
    status, events = stream_lines(hostile.base, {**LONG, "max_tokens": 40})
    assert status == 200 and events[-1][1] == "[DONE]"
    result = json.loads(hostile.r.hget(job_key(events[0][0].split("/")[0]), "result"))
    assert result["usage"]["completion_tokens"] == 40
    t.join(300)
    r = result["r"]
    assert isinstance(r, httpx.Response), r
    assert r.status_code == 400 and param(r) == "response_format" and "to compile" in r.text, r.text
    again = post(hostile.base, "/v1/chat/completions", body, timeout=30)  # remembered: refused at once
    assert again.status_code == 400 and hostile.alive()


def test_a_trickled_body_is_cut_off(hostile):
    port = int(hostile.base.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{")  # fmt: skip
    t0, reply = time.monotonic(), b""
    sock.settimeout(0.5)
    for _ in range(60):  # a byte every half second: 30 s to send it all
        try:
            sock.sendall(b" ")
            reply += sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:  # the gateway closed the connection
            break
        if reply:
            break
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert time.monotonic() - t0 < 20  # BODY_TIMEOUT_S is 2 here
    sock.settimeout(10)
    try:  # and the connection is closed: the trickle holds nothing
        while sock.recv(4096):
            pass
    except ConnectionError:
        pass
    sock.close()


# ----- defaults that invite abuse ---------------------------------------------------------------------------
def test_a_keyless_gateway_refuses_what_a_browser_page_could_send(hostile):
    body = {"prompt": "x", "max_tokens": 1}
    rebound = httpx.post(hostile.base + "/v1/completions", json=body, headers={"Host": "evil.example"}, timeout=30)
    assert rebound.status_code == 403 and param(rebound) == "Host"
    assert httpx.get(hostile.base + "/v1/models", headers={"Host": "evil.example:8000"}, timeout=30).status_code == 403
    form = httpx.post(hostile.base + "/v1/completions", content=json.dumps(body), timeout=30,
                      headers={"Content-Type": "text/plain"})  # fmt: skip
    assert form.status_code == 415 and param(form) == "Content-Type"
    for host in ("localhost", "127.0.0.1:1", "[::1]:8000", "app.localhost"):
        assert (
            httpx.post(hostile.base + "/v1/completions", json=body, headers={"Host": host}, timeout=60).status_code
            == 200
        )


def test_keys_get_default_limits(hostile):
    alice = hostile.as_key(KEYS[0])
    r = post(hostile.keyed_base, "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 33}, alice)
    assert r.status_code == 400 and param(r) == "n" and "32 concurrent" in r.text
    codes = [httpx.post(hostile.keyed_base + "/v1/completions", content=b"{", headers=alice, timeout=30).status_code
             for _ in range(25)]  # fmt: skip
    assert 429 in codes  # 10 requests per second, in bursts of 10
    ok = post(hostile.keyed_base, "/v1/completions", {"prompt": "x", "max_tokens": 1}, hostile.as_key(KEYS[1]))
    assert ok.status_code == 200  # another key has its own allowance


def test_a_stream_write_redis_refuses_ends_the_job_with_an_error(hostile):
    from weightq.client import Client
    from weightq.settings import Settings

    client = Client(hostile.url, settings=Settings(redis_url=hostile.url))
    job = client.submit("Once upon a time", max_new_tokens=900, ignore_eos=True)
    wait_for(lambda: hostile.r.xlen(stream_key(job.id)) > 5, what="the job's first tokens")
    admin = redis.Redis.from_url(hostile.url)
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", max(1, admin.info("memory")["used_memory"] - 2**20))  # full now
        last_entry = lambda: hostile.r.xrevrange(stream_key(job.id), count=1)  # noqa: E731
        last = wait_for(lambda: last_entry()[0][1]["type"] != EntryType.TOKEN and last_entry(), 90, "its last entry")
    finally:
        admin.config_set("maxmemory", 0)
    fields = last[0][1]
    assert fields["type"] == EntryType.ERROR and "refused" in fields["message"], fields
    assert hostile.r.hget(job_key(job.id), "state") == "done"
    assert client.submit("after", max_new_tokens=3).result(timeout=120)["usage"]["completion_tokens"] == 3
    assert hostile.alive()


# ----- fuzzing both front doors while another stream runs ----------------------------------------------------
lengths = st.integers(-3, 6) | st.sampled_from([0, 2**63, "7", None, 1e-45, True])
values = st.sampled_from([0, 1, -1, 1e-45, 5e-324, 1e308, 2**63, 2**64, "7", "²", None, True, 0.5, 2])
texts = st.sampled_from(["", "x", "\ud800", "²", "🎉" * 30, "a" * 300, "\x00", "stop"])
schemas = st.sampled_from([
    {"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "integer"}, {"enum": ["a", "b"]},
    json.loads('{"type":"object","properties":{"a":' * 40 + "{}" + "}}" * 40), {"type": "no-such-type"}, [],
])  # fmt: skip
SAMPLING = {
    "temperature": values | st.floats(0, 3), "top_p": values, "seed": values, "presence_penalty": values,
    "frequency_penalty": values, "stop": texts | st.lists(texts, max_size=40), "min_tokens": st.integers(-1, 3),
    "logit_bias": st.dictionaries(texts | st.just("5"), values, max_size=3), "ignore_eos": st.booleans(),
    "n": st.integers(0, 3) | values, "stream": st.booleans(), "logprobs": values | st.booleans(),
    "response_format": st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"schema": schemas})}
    ),
}  # fmt: skip
OPENAI = st.tuples(
    st.just("/v1/completions"),
    st.fixed_dictionaries({"prompt": texts | st.lists(st.integers(-1, 2000), max_size=5) | st.lists(texts, max_size=3),
                           "max_tokens": lengths}, optional=SAMPLING),
) | st.tuples(
    st.just("/v1/chat/completions"),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "robot"]), "content": texts}), max_size=3),
        "max_tokens": lengths}, optional=SAMPLING),
)  # fmt: skip
TGI = st.tuples(
    st.sampled_from(["/generate", "/generate_stream", "/"]),
    st.fixed_dictionaries({"inputs": texts, "parameters": st.fixed_dictionaries({"max_new_tokens": lengths}, optional={
        "temperature": values, "top_k": values, "seed": values, "best_of": st.integers(0, 3) | values,
        "do_sample": st.booleans(), "stop": st.lists(texts, max_size=3), "details": st.booleans(),
        "top_n_tokens": values, "repetition_penalty": values, "decoder_input_details": st.booleans(),
        "grammar": st.fixed_dictionaries({"type": st.sampled_from(["json", "regex"]),
                                          "value": st.sampled_from(["[^\\s\\S]", "a{0}", "(a|", ""]) | schemas}),
    })}),
)  # fmt: skip


def test_fuzzed_front_doors_never_5xx_and_another_stream_keeps_going(hostile):
    """OpenAI's and TGI's bodies, mostly well formed with hostile values, against the live gateway
    while another client streams: never a 5xx, the worker lives, the stream runs to its end (the
    figure for its token rate beside costly requests is bench.hostile's)."""
    victim: dict = {}
    runner = threading.Thread(target=lambda: victim.update(out=stream_lines(hostile.base, LONG)))
    runner.start()

    @settings(max_examples=max(10, EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck))
    @given(OPENAI | TGI)
    def fuzz(case):
        path, body = case
        r = httpx.post(hostile.base + path, content=json.dumps(body, allow_nan=True), timeout=120,
                       headers={"Content-Type": "application/json"})  # fmt: skip
        assert r.status_code < 500, (path, body, r.status_code, r.text[:500])

    try:
        fuzz()
    finally:
        runner.join(300)
    status, events = victim["out"]
    assert status == 200 and events[-1][1] == "[DONE]" and len(text_of(events)) > 0, events[-3:]
    assert hostile.alive()
