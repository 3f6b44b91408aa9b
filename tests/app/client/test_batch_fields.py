"""Which fields of a batch line are its request: weightq's own, the names OpenAI's and TGI's doors give
the same settings (honoured as the gateway reads them, or refused naming what to use), and the columns
carried to the output. Two lines with one id are refused before anything runs. No Redis needed."""

from __future__ import annotations

import json

import pytest
from weightq.client.batch import DuplicateIds, line_formats, scan_input
from weightq.client.batch_lines import ALIASES, CARRIED, SETTINGS, JobLines
from weightq.gateway import openai_api, tgi_api
from weightq.gateway.openai_batch import OpenAIBatchLines
from weightq.tasks.request import FIELDS, RequestError

LINES = JobLines("base-model")


def request(**line):
    return LINES.request({"prompt": "x", **line}, None)


def refusal(**line) -> RequestError:
    with pytest.raises(RequestError) as e:
        request(**line)
    return e.value


def test_every_name_the_gateways_doors_accept_is_a_field_an_alias_or_carried():
    accepted = openai_api.COMPLETION_FIELDS | openai_api.CHAT_FIELDS | tgi_api.PARAMETERS | {"inputs", "parameters"}
    assert sorted(accepted - FIELDS - ALIASES.keys() - CARRIED) == []
    assert not CARRIED & SETTINGS  # a carried column is never also read as a setting


@pytest.mark.parametrize(
    ("line", "field", "value"),
    [
        ({"max_tokens": 5}, "max_new_tokens", 5),
        ({"max_completion_tokens": 7}, "max_new_tokens", 7),
        ({"max_tokens": None}, "max_new_tokens", None),  # null: until the context limit, as the OpenAI door
        ({"model": "support"}, "adapter", "support"),
        ({"model": "base-model"}, "adapter", ""),  # the served model: the base
        ({"adapter_id": "support"}, "adapter", "support"),
        ({"stop": ["\n"], "seed": 3, "top_p": 0.5}, "stop", ("\n",)),
        ({"logprobs": True, "top_logprobs": 3}, "logprobs", 3),  # OpenAI chat's pair
        ({"logprobs": True}, "logprobs", 0),
        ({"top_n_tokens": 2}, "logprobs", 2),
        ({"echo": True}, "prompt_logprobs", 0),
        ({"do_sample": True}, "temperature", 1.0),  # TGI samples at 1 unless told
        ({"do_sample": True, "temperature": 0.5}, "temperature", 0.5),
        ({"response_format": {"type": "json_object"}}, "guided", "json_object"),
        ({"grammar": {"type": "regex", "value": "[a-z]+"}}, "guided", "regex"),
        ({"n": 1, "best_of": 1, "stream": False}, "max_new_tokens", 64),  # ask for nothing: accepted
    ],
)
def test_other_apis_names_set_weightqs_fields(line, field, value):
    req = request(**line)
    got = getattr(req, field)
    assert (got.kind if field == "guided" else got) == value
    if "seed" in line:
        assert req.seed == 3 and req.top_p == 0.5


def test_inputs_is_tgis_prompt():
    assert LINES.request({"inputs": "hello", "max_tokens": 2}, None).prompt == "hello"


@pytest.mark.parametrize(
    ("line", "field", "says"),
    [
        ({"n": 3}, "n", "one line per sample"),
        ({"best_of": 2}, "best_of", "one line per sample"),
        ({"stream": True}, "stream", "written whole"),
        ({"typical_p": 0.9}, "typical_p", "not supported"),
        ({"service_tier": "flex"}, "service_tier", "`priority`"),
        ({"parameters": {"max_new_tokens": 3}}, "parameters", "top level"),
        ({"tools": [{"type": "function"}]}, "tools", "not supported"),
        ({"max_tokens": -1}, "max_tokens", "must be between"),  # named as the line names it
        ({"top_n_tokens": 99}, "top_n_tokens", "must be between"),
        ({"max_tokens": 5, "max_new_tokens": 6}, "max_tokens", "another value (5 vs 6)"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "another value"),
        ({"model": "base-model", "adapter": "support"}, "model", "adapter"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ({"max_token": 5}, "max_token", "did you mean 'max_tokens'"),
        ({"models": "x"}, "models", "did you mean 'model'"),
        ({"result": "mine"}, "result", "field of the output line"),
    ],
)
def test_a_setting_weightq_cannot_honour_or_a_conflict_is_refused_by_name(line, field, says):
    e = refusal(**line)
    assert e.field == field and says in str(e), str(e)


def test_same_setting_under_two_names_with_one_value_is_fine():
    assert request(max_tokens=5, max_new_tokens=5, max_completion_tokens=5).max_new_tokens == 5
    assert request(model="support", adapter="support").adapter == "support"


def test_columns_are_carried_and_request_fields_are_not():
    line = {"id": "a", "prompt": "x", "max_tokens": 5, "model": "base-model", "metadata": {"k": [1]}, "user": "u7",
            "category": "news", "input": "an eval set's column"}  # fmt: skip
    record = LINES.done("a", line, "job", {"text": "t"})
    assert record == {"id": "a", "metadata": {"k": [1]}, "user": "u7", "category": "news",
                      "input": "an eval set's column", "result": {"text": "t"}}  # fmt: skip


def test_an_openai_line_takes_its_settings_in_body_never_as_columns():
    fmt = OpenAIBatchLines("base-model")
    body = {"model": "base-model", "prompt": "x", "max_tokens": 3}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body, "max_tokens": 9}
    with pytest.raises(RequestError) as e:
        fmt.request(line, None)
    assert e.value.field == "max_tokens" and "`body`" in str(e.value)
    del line["max_tokens"]
    assert fmt.request(line | {"metadata": {"row": 1}}, None).max_new_tokens == 3


def test_duplicate_ids_are_refused_naming_the_id_and_both_lines(tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [{"id": "a", "prompt": "x"}, {"prompt": "y"}, {"id": "a", "prompt": "z"}, "",
             {"custom_id": "line-2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "w"}}]  # fmt: skip
    src.write_text("".join((json.dumps(x) if x else "") + "\n" for x in lines))
    formats = line_formats([OpenAIBatchLines("m")], "m")
    with pytest.raises(DuplicateIds) as e:
        scan_input(src, formats)
    message = str(e.value)
    assert "id 'a' is on line 1 and line 3" in message  # weightq's ids
    assert "id 'line-2' is on line 2 and line 5" in message  # a default id and an OpenAI custom_id
    assert "Nothing was submitted" in message
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "x"}) + "\n" for i in range(4)) + "{torn")
    scan = scan_input(src, formats)
    assert scan.ids == ["q0", "q1", "q2", "q3", "line-5"] and scan.lines == 5
