"""Structured output: every output of the random tiny model, constrained by a bounded JSON schema and
given more tokens than the schema can use, finishes, parses and validates, streamed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.engine.sampling.grammar import available

pytestmark = pytest.mark.skipif(not available(), reason="xgrammar is not installed (make installs it)")

INT = {"type": "integer", "minimum": 0, "maximum": 9}
# fmt: off
SCHEMAS = [
    {"type": "object", "properties": {"a": INT}, "required": ["a"]},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"type": "string", "maxLength": 8},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "p": {"type": "object", "properties": {"x": INT, "y": {"type": "boolean"}}, "required": ["x", "y"]}
        },
        "required": ["p"],
    },
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    {"type": "null"},
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        },
        "required": ["ok", "tags"],
    },
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "string", "enum": ["x", "yy", "zzz"]},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "boolean"}]},
    {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 50}, "status": {"enum": ["open", "closed"]}},
        "required": ["id", "status"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "object", "properties": {"k": INT}, "required": ["k"]}, "maxItems": 2},
    {"type": "string", "minLength": 1, "maxLength": 3},
    {"type": "object", "properties": {"flag": {"type": "boolean"}}},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 5},
    {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "maxItems": 3},
            "b": {"type": "string", "maxLength": 5},
        },
        "required": ["a", "b"],
    },
    {"type": "integer", "minimum": -20, "maximum": 20},
]
# fmt: on


def test_twenty_bounded_schemas_always_finish_parse_and_validate(tiny_loaded):
    events = []
    engine = Engine(EngineConfig(check_invariants=True), sink=events.append, loaded=tiny_loaded)
    prompts = ["Answer in JSON:", "The scheduler", "x", "Once upon a time there was a batcher that"]
    reqs = [
        GenerationRequest(
            f"s{i}-{j}",
            prompt=prompt,
            params=SamplingParams(
                max_new_tokens=400, temperature=t, seed=i, guided=("json_schema", json.dumps(schema))
            ),
        )
        for i, schema in enumerate(SCHEMAS)
        for j, (prompt, t) in enumerate(zip(prompts, [0.0, 1.0, 1.0, 0.0], strict=True))
    ]
    results = engine.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        schema = SCHEMAS[int(req.id[1:].split("-")[0])]
        assert res.reason == "eos", (req.id, res.reason, res.text)
        jsonschema.validate(json.loads(res.text), schema)
        streamed = "".join(e.text for e in events if getattr(e, "index", None) is not None and e.request_id == req.id)
        assert streamed == res.text
        assert res.completion_tokens < 400
    assert engine.counters["overflow_steps"] == 0


def test_json_object_and_regex(tiny_loaded):
    engine = Engine(EngineConfig(), loaded=tiny_loaded)
    objects = engine.generate(
        [
            GenerationRequest(
                f"o{i}",
                prompt="JSON:",
                params=SamplingParams(max_new_tokens=200, temperature=1.0, seed=i, guided=("json_object", "")),
            )
            for i in range(8)
        ]
    )
    finished = [r for r in objects if r.reason == "eos"]
    assert finished, "no json_object output finished within 200 tokens"
    for r in finished:
        assert isinstance(json.loads(r.text), dict)
    pattern = r"(yes|no)-[0-9]{2,4}"
    dates = engine.generate(
        [
            GenerationRequest(
                f"r{i}",
                prompt="code:",
                params=SamplingParams(max_new_tokens=50, temperature=1.0, seed=i, guided=("regex", pattern)),
            )
            for i in range(6)
        ]
    )
    for r in dates:
        assert r.reason == "eos" and re.fullmatch(pattern, r.text), r.text


def test_a_schema_that_cannot_compile_is_refused_naming_the_field(tiny_loaded):
    engine = Engine(EngineConfig(), loaded=tiny_loaded)
    bad = SamplingParams(guided=("json_schema", json.dumps({"type": "no-such-type"})))
    res = engine.generate([GenerationRequest("bad", prompt="x", params=bad)])[0]
    assert res.reason == "error" and res.error.startswith("guided") and "no-such-type" in res.error


def test_a_grammar_left_without_any_token_ends_with_an_error_not_text_outside_it(tiny_loaded):
    """The engine's own guard (the contract refuses guided with min_tokens, so only a caller of the
    engine can ask this): a grammar that allows only the end, and min_tokens holding the end back,
    leave no token at all; the request fails, where argmax of an all -inf row emitted token 0."""
    engine = Engine(EngineConfig(grammar_compile_timeout_s=0), loaded=tiny_loaded)
    params = SamplingParams(max_new_tokens=8, min_tokens=2, guided=("regex", "a{0}"))
    res = engine.generate([GenerationRequest("dead", prompt="x", params=params)])[0]
    assert res.reason == "error" and res.error.startswith("guided") and res.text == "" and res.token_ids == ()
