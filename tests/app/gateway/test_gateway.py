"""The HTTP gateway driven by the clients people already use: `openai` and HF's `text_generation`.

One Redis, one worker and one gateway (with an API key) serve the whole module.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import redis
from text_generation.errors import ValidationError
from weightq.cli.processes import GatewayProcess
from weightq.tasks.contract import job_key

pytestmark = pytest.mark.service  # real Redis servers and worker processes


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


def test_openai_chat_uses_the_chat_template_like_the_engine(stack, tiny_loaded):
    from weightq.batcher import BatcherConfig
    from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV block?"}]
    full = stack.oai.chat.completions.create(model="builtin:tiny", messages=messages, max_tokens=16, temperature=0)
    want = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=4096)), loaded=tiny_loaded).generate(
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
    assert info["max_concurrent_requests"] == 32  # the worker's task threads (CONCURRENCY=32 there)


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


def test_metrics_each_series_once_and_streams_unbuffered_by_proxies(stack):
    body = {"model": "builtin:tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", stack.base + "/v1/completions", json=body, headers=stack.headers, timeout=30) as r:
        assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"  # nginx: no buffer
        r.read()
    stack.stats(lambda s: s.get("metrics", {}).get("job_ttft", {}).get("sum", 0) > 0)
    get = lambda path: httpx.get(stack.base + path, headers=stack.headers, timeout=30)  # noqa: E731
    own, cluster = get("/metrics").text, get("/metrics/cluster").text
    assert 'weightq_http_requests_total{route="/v1/completions",status="200"}' in own
    assert "worker=" not in own  # each gateway exports only its own: scraping two never counts a worker twice
    for name in (
        'weightq_requests_running{worker="gw@test"}',
        'weightq_batch_weight_budget{worker="gw@test"} 8192.0',
        'weightq_kv_blocks_used{worker="gw@test"}',
        'weightq_decode_tokens_total{worker="gw@test"}',
        'weightq_time_to_first_token_seconds_bucket{le="+Inf",worker="gw@test"}',
        'weightq_job_time_to_first_token_seconds_count{worker="gw@test"}',
        'weightq_job_latency_seconds_count{worker="gw@test"}',
        'weightq_request_latency_seconds_count{worker="gw@test"}',
        'weightq_time_per_output_token_seconds_count{worker="gw@test"}',
        'weightq_requests_finished_total{reason="length",worker="gw@test"}',
        'weightq_queue_depth{priority="5",queue="weightq"} 0.0',
        "weightq_dead_letters 0.0",
    ):
        assert name in cluster, name
    assert get("/metrics/cluster").status_code == 200 and httpx.get(stack.base + "/metrics").status_code == 401


def test_trusted_proxies_name_the_client_for_per_address_limits(stack, redis_url, tmp_path):
    limited = dict(rate_limit_per_s=0.001, rate_burst=1)  # one request per address, then 429

    def post(gw: GatewayProcess, ip: str) -> int:
        xff = {"X-Forwarded-For": f"203.0.113.7, {ip}"}  # as a proxy appends the address it saw
        return httpx.post(gw.base + "/v1/completions", json={"prompt": 42}, headers=xff).status_code

    behind = GatewayProcess(redis_url, tmp_path, trusted_proxies="127.0.0.0/8", **limited).wait_ready()
    direct = GatewayProcess(redis_url, tmp_path, trusted_proxies="none", **limited).wait_ready()
    try:
        assert [post(behind, "198.51.100.1"), post(behind, "198.51.100.2"), post(behind, "198.51.100.1")] == [
            400, 400, 429,  # two clients behind the proxy, each its own budget
        ]  # fmt: skip
        assert [post(direct, "198.51.100.1"), post(direct, "198.51.100.2")] == [400, 429]  # the header is ignored
    finally:
        behind.stop()
        direct.stop()


def test_a_client_resumes_its_stream_on_a_restarted_gateway(stack, redis_url, tmp_path):
    first = GatewayProcess(redis_url, tmp_path, api_key=stack.key).wait_ready()
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
    second = GatewayProcess(redis_url, tmp_path, api_key=stack.key).wait_ready()
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
