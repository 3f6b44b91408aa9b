"""The OpenAI and TGI request fields apps send, through the real clients: logprobs (streamed and not,
echo, TGI details), penalties, logit bias and min_tokens, structured output, n and lists of prompts."""

from __future__ import annotations

import json

import httpx
import pytest
import redis
from text_generation.types import Grammar
from weightq.tasks.contract import job_key
from weightq.tasks.limits import OPEN_MAX_PRIORITY

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def _job_result(stack, response_id: str) -> dict:
    job_id = response_id.split("-", 1)[1]
    return json.loads(redis.Redis.from_url(stack.url).hget(job_key(job_id), "result"))


def _request_of(stack, response_id: str) -> dict:
    job_id = response_id.split("-", 1)[1]
    return json.loads(redis.Redis.from_url(stack.url).hget(job_key(job_id), "request"))


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


def test_openai_usage_reports_prompt_tokens_found_in_the_prefix_cache(stack):
    prompt = " ".join(f"word{i}" for i in range(60))  # well over one 16-token block
    kw = {"model": "builtin:tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = stack.oai.completions.create(**kw)
    again = stack.oai.completions.create(**kw)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0


def test_x_priority_sets_the_job_class_and_is_checked(stack):
    kw = {"model": "builtin:tiny", "prompt": "now", "max_tokens": 2}
    done = stack.oai.completions.create(**kw, extra_headers={"X-Priority": "6"})
    assert _request_of(stack, done.id)["priority"] == 6
    # the top classes are granted per key (KEY_PRIORITIES), not taken: this key has no entry
    capped = stack.oai.completions.create(**kw, extra_headers={"X-Priority": "9"})
    assert _request_of(stack, capped.id)["priority"] == OPEN_MAX_PRIORITY == 7
    assert _request_of(stack, stack.oai.completions.create(**kw).id)["priority"] == 5  # the default class, named
    bad = httpx.post(stack.base + "/v1/completions", json=kw, headers={**stack.headers, "X-Priority": "12"}, timeout=30)
    assert bad.status_code == 400 and "X-Priority" in bad.text
