"""The HTTP gateway driven by the clients people already use: `openai` and HF's `text_generation`.

One Redis, one worker and one gateway (with an API key) serve the whole module.
"""

from __future__ import annotations

import json
import time
from typing import ClassVar

import httpx
import openai
import pytest
import redis
import text_generation
from text_generation.errors import ValidationError
from text_generation.types import Grammar

from app.cli.processes import GatewayProcess, WorkerProcess
from tasks.contract import job_key

KEY = "test-key-123"


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    home = tmp_path_factory.mktemp("gateway")
    redis.Redis.from_url(redis_url).flushall()
    worker = WorkerProcess(redis_url, "gw@test", home, max_batch_weight=8192, concurrency=32)
    gateway = GatewayProcess(redis_url, home, api_key=KEY)
    worker.wait_ready()
    gateway.wait_ready()

    class Stack:
        url = redis_url
        base = gateway.base
        oai = openai.OpenAI(base_url=gateway.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        tgi = text_generation.Client(gateway.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        headers: ClassVar[dict] = {"Authorization": f"Bearer {KEY}"}

        @staticmethod
        def stats(ok=lambda s: True) -> dict:
            return worker.wait_stats(ok)  # a heartbeat written from now on that satisfies `ok`

        @staticmethod
        def worker_log() -> str:
            return worker.log()

    yield Stack
    gateway.stop()
    worker.stop()
    worker.kill()


def test_openai_completions_stream_equals_non_stream(stack):
    kw = {"model": "builtin:tiny", "prompt": "The scheduler admits", "max_tokens": 20, "temperature": 0}
    full = stack.oai.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason in ("length", "stop")
    u = full.usage
    assert 0 < u.completion_tokens <= 20 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(stack.oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def _job_result(stack, response_id: str) -> dict:
    job_id = response_id.split("-", 1)[1]
    return json.loads(redis.Redis.from_url(stack.url).hget(job_key(job_id), "result"))


def test_openai_logprobs_streamed_and_not(stack, tiny_loaded):
    kw = {"model": "builtin:tiny", "prompt": "The scheduler admits", "max_tokens": 16, "temperature": 0}
    full = stack.oai.completions.create(**kw, logprobs=3)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == full.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # up to 3 alternatives and the chosen token, fewer where tokens share a text (partial characters)
        assert 1 <= len(top) <= 4 and chosen <= 0 and abs(max(top.values()) - chosen) < 1e-4  # greedy
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(stack.oai.completions.create(**kw, logprobs=3, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text

    echoed = stack.oai.completions.create(**kw, logprobs=2, echo=True)
    elp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == kw["prompt"] + full.choices[0].text
    n_prompt = echoed.usage.prompt_tokens
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None and len(elp.tokens) == n_prompt + 16
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    assert echoed.choices[0].text == kw["prompt"] + full.choices[0].text  # the same greedy completion
    assert elp.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)  # as without echo
    ids = stack.oai.completions.create(**{**kw, "prompt": [5, 17, 99, 4]}, echo=True)
    decoded = tiny_loaded.tokenizer.decode([5, 17, 99, 4])
    assert ids.choices[0].text == decoded + _job_result(stack, ids.id)["text"]

    chat_kw = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    chat = stack.oai.chat.completions.create(**chat_kw, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        values = [t.logprob for t in item.top_logprobs]
        assert len(values) == 2 and values == sorted(values, reverse=True) and abs(values[0] - item.logprob) < 1e-4
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    chat_chunks = list(stack.oai.chat.completions.create(**chat_kw, temperature=0, logprobs=True, stream=True))
    streamed = [
        t.logprob for c in chat_chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert streamed == [t.logprob for t in content]
    r = httpx.post(stack.base + "/v1/chat/completions", json={**chat_kw, "top_logprobs": 2}, headers=stack.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_openai_penalties_logit_bias_and_min_tokens_reach_the_sampler(stack):
    kw = {"model": "builtin:tiny", "prompt": [5, 17, 99, 4], "max_tokens": 24, "temperature": 0}
    plain = _job_result(stack, stack.oai.completions.create(**kw).id)["token_ids"]
    banned = plain[0]
    biased = _job_result(stack, stack.oai.completions.create(**kw, logit_bias={str(banned): -100}).id)["token_ids"]
    assert banned not in biased
    penalised = stack.oai.completions.create(**kw, presence_penalty=-2.0, frequency_penalty=-1.0)
    assert len(set(_job_result(stack, penalised.id)["token_ids"])) < len(set(plain))  # it repeats itself
    held = stack.oai.completions.create(**kw, extra_body={"stop_token_ids": [banned], "min_tokens": 5})
    assert held.usage.completion_tokens >= 5


def test_structured_output_through_openai_and_tgi(stack):
    import jsonschema

    tags = {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}
    item = {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tags": tags}
    schema = {"type": "object", "properties": item, "required": ["id", "tags"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}}
    kw = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "an item"}], "max_tokens": 200}
    for seed in range(3):
        full = stack.oai.chat.completions.create(**kw, seed=seed, response_format=fmt)
        assert full.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(full.choices[0].message.content), schema)
        chunks = stack.oai.chat.completions.create(**kw, seed=seed, response_format=fmt, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    obj = stack.oai.completions.create(model="builtin:tiny", prompt="{", max_tokens=200, temperature=0,
                                       extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    for stream in (False, True):
        r = httpx.post(stack.base + "/v1/chat/completions", json={**kw, "response_format": bad, "stream": stream},
                       headers=stack.headers, timeout=30)  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    tgi = stack.tgi.generate("an item", max_new_tokens=200, grammar=Grammar(type="json", value=schema))
    jsonschema.validate(json.loads(tgi.generated_text), schema)
    tgi_re = stack.tgi.generate("code", max_new_tokens=20, grammar=Grammar(type="regex", value="[0-9]{3}"))
    assert tgi_re.generated_text.isdigit() and len(tgi_re.generated_text) == 3


def test_openai_n_and_prompt_lists_answer_every_choice(stack):
    kw = {"model": "builtin:tiny", "max_tokens": 8, "temperature": 1.0, "seed": 5, "prompt": ["a b", "c d e"], "n": 2}
    full = stack.oai.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert [c.text for c in stack.oai.completions.create(**kw).choices] == [c.text for c in full.choices]
    alone = [  # choice i of prompt p is that prompt alone with seed 5 + i
        stack.oai.completions.create(**{**kw, "prompt": p, "n": 1, "seed": 5 + i})
        for p in ("a b", "c d e")
        for i in (0, 1)
    ]
    assert [a.choices[0].text for a in alone] == [c.text for c in full.choices]
    assert full.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens  # once per prompt
    assert full.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    chunks = list(stack.oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in full.choices]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    ends = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(ends) == [0, 1, 2, 3]
    chat_kw = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "seed": 1}
    chat = stack.oai.chat.completions.create(**chat_kw, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) > 1
    streamed = list(stack.oai.chat.completions.create(**chat_kw, n=3, stream=True))
    for i, choice in enumerate(chat.choices):
        parts = [c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i]
        assert "".join(parts) == choice.message.content


def test_openai_chat_uses_the_chat_template_like_the_engine(stack, tiny_loaded):
    from engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV block?"}]
    full = stack.oai.chat.completions.create(model="builtin:tiny", messages=messages, max_tokens=16, temperature=0)
    want = Engine(EngineConfig(max_batch_weight=4096), loaded=tiny_loaded).generate(
        [GenerationRequest("c", messages=messages, params=SamplingParams(max_new_tokens=16))]
    )[0]
    assert full.choices[0].message.content == want.text
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == want.prompt_tokens
    stream = stack.oai.chat.completions.create(
        model="builtin:tiny", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want.text


def test_models_health_and_auth(stack):
    assert [m.id for m in stack.oai.models.list()] == ["builtin:tiny"]
    assert httpx.get(stack.base + "/health").json() == {"status": "ok", "workers": 1}  # no key needed
    bad = openai.OpenAI(base_url=stack.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.post(stack.base + "/generate", json={"inputs": "x"}).status_code == 401


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),  # named as the client sent it
        ({"prompt": "hi", "max_tokens": 100_000}, "max_tokens"),  # over max_total_tokens
        ({"prompt": "hi", "n": 200}, "n"),
        ({"prompt": ["a", "b"], "n": 100}, "n"),  # 200 choices
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids"),  # past the vocabulary: the worker says so
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"10000000": 1}}, "logit_bias"),  # past the vocabulary: the worker says so
        ({"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"prompt": "hi", "model": "gpt-4"}, "model"),
        ({"prompt": "hi", "bogus": 1}, "bogus"),
        ({"prompt": 42}, "prompt"),
    ],
)
def test_openai_bad_requests_are_400_naming_the_field(stack, body, param):
    r = httpx.post(stack.base + "/v1/completions", json=body, headers=stack.headers, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_bodies_are_4xx(stack):
    post = lambda data, **kw: httpx.post(  # noqa: E731
        stack.base + "/v1/chat/completions", content=data, headers=stack.headers, timeout=30, **kw
    )
    assert post(b"{not json").status_code == 400
    assert post(b"\xff\xfe\x00garbage").status_code == 400
    assert post(b"[" * 100_000 + b"]" * 100_000).status_code in (400, 413)
    assert post(b'{"messages": []}').json()["error"]["param"] == "messages"
    r = post(json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    assert post(b"x" * (5 * 2**20)).status_code == 413


def test_tgi_client_generate_and_stream(stack):
    full = stack.tgi.generate("The scheduler admits", max_new_tokens=12)
    assert full.details.generated_tokens == len(full.details.tokens) <= 12
    assert full.details.finish_reason in ("length", "eos_token")
    assert full.generated_text == "".join(t.text for t in full.details.tokens)
    streamed = list(stack.tgi.generate_stream("The scheduler admits", max_new_tokens=12))
    text = "".join(r.token.text for r in streamed if not r.token.special)
    assert text == full.generated_text == streamed[-1].generated_text
    with pytest.raises(ValidationError, match="max_new_tokens"):
        stack.tgi.generate("x", max_new_tokens=100_000)
    r = httpx.post(stack.base + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 3}},
                   headers=stack.headers, timeout=30)  # fmt: skip
    assert r.status_code == 200 and set(r.json()) == {"generated_text"}
    prefilled = stack.tgi.generate("The scheduler admits", max_new_tokens=3, decoder_input_details=True)
    prefill = prefilled.details.prefill
    assert len(prefill) > 1 and prefill[0].logprob is None and all(t.logprob <= 0 for t in prefill[1:])
    detailed = stack.tgi.generate("The scheduler admits", max_new_tokens=6, top_n_tokens=2)
    assert all(t.logprob is not None and t.logprob <= 0 for t in detailed.details.tokens)
    assert [len(top) for top in detailed.details.top_tokens] == [2] * len(detailed.details.tokens)
    assert all(r.token.logprob is not None for r in streamed if not r.token.special)
    best = stack.tgi.generate("The scheduler admits", max_new_tokens=8, do_sample=True, best_of=3)
    seqs = [best.details, *best.details.best_of_sequences]
    assert len(seqs) == 3 and len({s.seed for s in seqs}) == 3  # each sample has a seed of its own
    score = [sum(t.logprob for t in s.tokens) for s in seqs]
    assert score[0] == max(score)  # the likeliest sample is the answer
    with pytest.raises(ValidationError, match="best_of"):
        stack.tgi.generate("x", max_new_tokens=4, best_of=2)  # greedy: nothing to choose from
    info = httpx.get(stack.base + "/info", headers=stack.headers).json()
    assert info["model_id"] == "builtin:tiny" and info["max_batch_total_tokens"] == 8192 and info["workers"] == 1


def _cancelled_jobs(url: str) -> list[str]:
    r = redis.Redis.from_url(url, decode_responses=True)
    return [k for k in r.scan_iter("weightq:job:*") if r.hget(k, "state") == "cancelled"]


def test_a_client_that_disconnects_cancels_its_job_and_frees_its_blocks(stack):
    body = {"prompt": "The scheduler admits", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", stack.base + "/v1/completions", json=body, headers=stack.headers, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        job_id = json.loads(first[5:])["id"].removeprefix("cmpl-")
        for _ in range(5):
            next(lines)
    r = redis.Redis.from_url(stack.url, decode_responses=True)
    deadline = time.monotonic() + 60
    while r.hget(job_key(job_id), "state") != "cancelled":
        assert time.monotonic() < deadline, r.hgetall(job_key(job_id))
        time.sleep(0.05)
    # Non-streaming: the client gives up after a second; its job goes too.
    before = len(_cancelled_jobs(stack.url))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.base + "/v1/completions", json={**body, "stream": False}, headers=stack.headers, timeout=1.0)
    deadline = time.monotonic() + 60
    while len(_cancelled_jobs(stack.url)) == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stack.stats(lambda s: s["running"] == 0 and s["kv_blocks_used"] == 0)  # the blocks come back


def test_metrics_cover_the_workers_engines(stack):
    stack.oai.completions.create(model="builtin:tiny", prompt="hello", max_tokens=4)
    stack.stats(lambda s: s.get("finished", 0) > 0)
    text = httpx.get(stack.base + "/metrics", headers=stack.headers, timeout=30).text
    for name in (
        'weightq_requests_running{worker="gw@test"}',
        'weightq_batch_weight_budget{worker="gw@test"} 8192.0',
        'weightq_kv_blocks_used{worker="gw@test"}',
        'weightq_decode_tokens_total{worker="gw@test"}',
        'weightq_time_to_first_token_seconds_bucket{le="+Inf",worker="gw@test"}',
        'weightq_time_per_output_token_seconds_count{worker="gw@test"}',
        'weightq_requests_finished_total{reason="length",worker="gw@test"}',
        'weightq_http_requests_total{route="/v1/completions",status="200"}',
        "weightq_dead_letters 0.0",
    ):
        assert name in text, name


def test_a_client_resumes_its_stream_on_a_restarted_gateway(stack, redis_url, tmp_path):
    first = GatewayProcess(redis_url, tmp_path, api_key=KEY).wait_ready()
    body = {"prompt": "The scheduler admits", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    seen, last_id, job_id = "", None, None
    with httpx.stream("POST", first.base + "/v1/completions", json=body, headers=stack.headers, timeout=30) as r:
        # Held: a loop over a temporary generator closes the connection at `break`, which is a client
        # going away (its job is cancelled, rightly) racing the restart this test is about.
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("id: "):
                last_id = line[4:]
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                job_id = chunk["id"].removeprefix("cmpl-")
                seen += chunk["choices"][0]["text"]
                if len(seen) > 20:
                    break
        first.stop()  # a restart (SIGTERM) while the client still listens: the job must go on
    assert last_id.startswith(job_id + "/")
    second = GatewayProcess(redis_url, tmp_path, api_key=KEY).wait_ready()
    try:
        headers = stack.headers | {"Last-Event-ID": last_id}
        rest, done = "", False
        with httpx.stream("POST", second.base + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert chunk["id"] == f"cmpl-{job_id}"  # the same job, not a new one
                    rest += chunk["choices"][0]["text"]
        assert done
        result = json.loads(redis.Redis.from_url(redis_url).hget(job_key(job_id), "result"))
        assert result["usage"]["completion_tokens"] == 400 and seen + rest == result["text"]
        bad = httpx.post(second.base + "/v1/completions", json=body, headers=stack.headers | {"Last-Event-ID": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
    finally:
        second.stop()


def test_per_key_limits_answer_429_with_retry_after(stack, redis_url, tmp_path):
    keys = "key-a,key-b"
    limited = GatewayProcess(redis_url, tmp_path, api_key=keys, max_concurrent_per_client=2).wait_ready()
    try:
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        a = {"Authorization": "Bearer key-a"}
        with httpx.Client(base_url=limited.base, timeout=30) as http:
            streams = [http.stream("POST", "/v1/completions", json=body, headers=a) for _ in range(2)]
            responses = [s.__enter__() for s in streams]
            assert [r.status_code for r in responses] == [200, 200]
            third = http.post("/v1/completions", json=body, headers=a)
            assert third.status_code == 429 and third.headers["Retry-After"] == "1"
            assert third.json()["error"]["type"] == "rate_limit_error"
            other = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                              headers={"Authorization": "Bearer key-b"})  # fmt: skip
            assert other.status_code == 200  # another key has its own allowance
            for s in streams:
                s.__exit__(None, None, None)
    finally:
        limited.stop()
    # one request back per 100 s: the third of three is refused however slowly a loaded machine sends them
    rated = GatewayProcess(redis_url, tmp_path, rate_limit_per_s=0.01, rate_burst=2).wait_ready()  # by address
    try:
        one = {"prompt": "x", "max_tokens": 1}
        codes = [httpx.post(rated.base + "/v1/completions", json=one, timeout=60).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
    finally:
        rated.stop()


def test_over_long_requests_are_a_400_naming_the_field_the_client_sent(stack):
    limit = stack.stats()["max_total_tokens"]
    post = lambda path, body: httpx.post(stack.base + path, json=body, headers=stack.headers, timeout=60)  # noqa: E731
    # what the gateway can check without a tokenizer is refused there, before any job exists
    r = post("/v1/completions", {"prompt": "hi", "max_tokens": limit})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert f"max_total_tokens {limit}" in r.json()["error"]["message"]
    r = post("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": limit}})
    assert r.status_code == 400 and r.json()["field"] == "parameters.max_new_tokens", r.text
    # a prompt that leaves too little room is refused by the worker: still a 400 naming max_tokens,
    # and one warning line in the worker's log, not an error with a traceback
    tracebacks = stack.worker_log().count("Traceback")
    prompt = [10 + i % 1000 for i in range(limit - 10)]  # token ids the tiny model knows
    r = post("/v1/completions", {"prompt": prompt, "max_tokens": 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = post("/v1/completions", {"prompt": prompt, "max_tokens": 20, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    deadline = time.monotonic() + 60  # the task logs its refusal after the error entry is written
    while stack.worker_log().count("refused: max_new_tokens") < 2:
        assert time.monotonic() < deadline, stack.worker_log()[-3000:]
        time.sleep(0.2)
    log = stack.worker_log()
    assert "refused: max_new_tokens" in log and log.count("Traceback") == tracebacks, log[-3000:]
