"""The job request (tasks/request.py): checked once, field by field, against the one table of limits and
defaults (tasks/limits.py); its JSON goes over the wire and comes back equal."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from weightq.batcher import DEFAULT_PRIORITY as BATCHER_DEFAULT
from weightq.batcher import TOP_PRIORITY
from weightq.tasks.limits import (
    DEFAULT_PRIORITY,
    DEFAULTS,
    LOCAL_TENANT,
    MAX_LOGPROBS,
    MAX_PRIORITY,
    MIN_PRIORITY,
    Door,
    broker_priority,
)
from weightq.tasks.request import FIELDS, Guided, JobRequest, Message, RequestError, parse_request


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # an integer too large for a float
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"top_k": -3}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 33}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"max_new_tokens": 64, "min_tokens": 65}, "min_tokens"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"guided": {"json_object": True}, "ignore_eos": True}, "guided"),
        ({"guided": {"json_schema": "not json"}}, "guided"),
        ({"guided": {"regex": ""}}, "guided"),
        ({"guided": {"grammar": "x"}}, "guided"),
        ({"priority": MAX_PRIORITY + 1}, "priority"),
        ({"priority": "9"}, "priority"),
        ({"request_id": "a b"}, "request_id"),
        ({"temperatur": 0.5}, "temperatur"),
        ({"prompt_token_ids": [1]}, "prompt"),  # two prompts
    ],
)
def test_each_field_is_refused_by_name(extra, field):
    with pytest.raises(RequestError) as e:
        parse_request({"prompt": "hi", **extra})
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_building_in_python_checks_the_same_and_normalises_json_shapes():
    job = JobRequest(
        messages=[{"role": "user", "content": "hi", "name": "ann"}],
        stop="\n",
        logit_bias={"7": 2},
        temperature=1,
        guided={"json_schema": {"type": "object"}},
    )
    assert job.messages == (Message("user", "hi"),) and job.stop == ("\n",) and job.logit_bias == ((7, 2.0),)
    assert job.temperature == 1.0 and isinstance(job.temperature, float)
    assert job.guided == Guided("json_schema", '{"type": "object"}')
    with pytest.raises(RequestError, match=r"^top_p"):
        JobRequest(prompt="x", top_p=2.0)
    # a changed copy is checked again
    assert dataclasses.replace(job, priority=9).priority == 9
    with pytest.raises(RequestError, match=r"^priority"):
        dataclasses.replace(job, priority=-1)


def test_each_door_has_its_defaults_and_an_explicit_value_wins():
    assert set(DEFAULTS) == set(Door)
    for door, defaults in DEFAULTS.items():
        job = parse_request({"prompt": "x"}, door)
        assert (job.max_new_tokens, job.temperature) == (defaults.max_new_tokens, defaults.temperature), door
        assert parse_request({"prompt": "x", "max_new_tokens": 3, "temperature": 0}, door).max_new_tokens == 3
    assert DEFAULTS[Door.COMPLETIONS].max_new_tokens == 16  # OpenAI's legacy completions
    assert DEFAULTS[Door.TGI].max_new_tokens == 100  # TGI's
    assert parse_request({"prompt": "x", "temperature": None}, Door.CHAT).temperature == 1.0  # null: unset


def test_chat_runs_to_the_context_limit_and_null_asks_for_it_at_any_door():
    chat = parse_request({"messages": [{"role": "user", "content": "x"}]}, Door.CHAT, max_total_tokens=64)
    assert chat.max_new_tokens is None and DEFAULTS[Door.CHAT].max_new_tokens is None  # as OpenAI's chat API
    assert parse_request(chat.to_json()).max_new_tokens is None  # the wire keeps it (the worker parses as a job)
    assert parse_request({"prompt": "x", "max_new_tokens": None}, Door.COMPLETIONS).max_new_tokens is None
    assert parse_request({"prompt": "x"}).max_new_tokens == 64  # absent: the door's default
    assert parse_request({"prompt": "x", "max_new_tokens": None, "min_tokens": 500}).min_tokens == 500


def test_one_priority_scale():
    assert (MIN_PRIORITY, DEFAULT_PRIORITY, MAX_PRIORITY) == (0, 5, 9)
    assert (BATCHER_DEFAULT, TOP_PRIORITY) == (DEFAULT_PRIORITY, MAX_PRIORITY)  # the batcher's mirror
    assert JobRequest(prompt="x").priority == DEFAULT_PRIORITY
    assert [broker_priority(p) for p in (9, 5, 0)] == [0, 4, 9]  # kombu takes message priority 0 first


def test_room_for_a_prompt_within_the_serving_limit():
    assert parse_request({"prompt": "x", "max_new_tokens": 63}, max_total_tokens=64).max_new_tokens == 63
    with pytest.raises(RequestError, match=r"^max_new_tokens: 64 leaves no room .* max_total_tokens 64"):
        parse_request({"prompt": "x", "max_new_tokens": 64}, max_total_tokens=64)
    with pytest.raises(RequestError, match=r"^max_new_tokens"):  # the door's default counts too
        parse_request({"prompt": "x"}, Door.TGI, max_total_tokens=64)


def test_the_tenant_the_gateway_sets_is_the_one_the_batcher_shares_by():
    from weightq.worker.to_engine import engine_request

    job = parse_request({"prompt": "x", "tenant": "key-abc"})
    assert parse_request(job.to_json()).tenant == "key-abc"  # the worker reads whose job it is
    req = engine_request("j", job)
    assert (req.tenant, req.cache_salt) == ("key-abc", "key-abc")  # fair share, and its own prefix cache
    shared = engine_request("j", job, shared_prefix_cache=True)
    assert (shared.tenant, shared.cache_salt) == ("key-abc", "")
    assert engine_request("j", parse_request({"prompt": "x"})).tenant == LOCAL_TENANT
    for bad in ("", "a b", "x" * 129, 7):
        with pytest.raises(RequestError) as e:
            parse_request({"prompt": "x", "tenant": bad})
        assert e.value.field == "tenant"


finite = st.floats(allow_nan=False, allow_infinity=False)
prompts = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=30)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8)}),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": st.text(max_size=10)}),
                min_size=1,
                max_size=3,
            )
        }
    ),
)
options = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(1, 10**6),
        "temperature": st.floats(0, 100),
        "top_k": st.integers(0, 10**6),
        "top_p": st.floats(0, 1, exclude_min=True),
        "presence_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(st.integers(0, 2**31 - 1).map(str), st.floats(-100, 100), max_size=3),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3) | st.text(min_size=1, max_size=5),
        "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=3),
        "ignore_eos": st.booleans(),
        "logprobs": st.integers(0, MAX_LOGPROBS),
        "prompt_logprobs": st.integers(0, MAX_LOGPROBS),
        "priority": st.integers(MIN_PRIORITY, MAX_PRIORITY),
        "request_id": st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
        "tenant": st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
        "guided": st.sampled_from([{"json_object": True}, {"regex": "[a-z]+"}, {"json_schema": {"type": "array"}}]),
    },
)


@settings(max_examples=300, deadline=None)
@given(prompts, options, st.sampled_from(list(Door)))
def test_the_wire_form_parses_back_to_the_same_request(prompt, extra, door):
    try:
        job = parse_request({**prompt, **extra}, door)
    except RequestError as e:  # only the rules that join two fields
        assert e.field in ("min_tokens", "guided"), e
        return
    wire = json.loads(json.dumps(job.to_json()))  # what a Celery message carries
    assert set(wire) <= FIELDS and wire["priority"] == job.priority and wire["max_new_tokens"] == job.max_new_tokens
    assert parse_request(wire) == job  # whatever the door: its defaults travel in the message
