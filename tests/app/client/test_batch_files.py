"""Batch files as a data tool (issue 40): a line's own columns reach its output, a near miss of a
request field is refused by name, failed lines run again on a rerun (unless --keep-failed) leaving one
record per line, --ordered writes input order, and a rerun against another input or priority is named.
A real Redis and worker (the simulated device: the outputs do not matter here, the lines do)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from weightq.client.batch import BatchChanged, run_batch
from weightq.gateway.openai_batch import OpenAIBatchLines

pytestmark = pytest.mark.service  # real Redis servers and worker processes

FAST = dict(runner="simulated", sim_step_cost="0.001,0,0")


def write(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_lines_own_columns_are_carried_and_a_near_miss_is_refused(service, tmp_path):
    service.worker(**FAST).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, [
        {"id": "a", "prompt": "x", "max_new_tokens": 3, "metadata": {"row": 1, "tags": ["t"]}, "category": "news"},
        {"id": "typo", "prompt": "x", "max_new_token": 3},
        {"id": "clash", "prompt": "x", "result": "mine"},
        {"custom_id": "o1", "method": "POST", "url": "/v1/completions", "source": "crm",
         "body": {"model": "builtin:tiny", "prompt": "x", "max_tokens": 3}},
    ])  # fmt: skip
    summary, _ = run_batch(src, out, service.client, progress=False, formats=[OpenAIBatchLines("builtin:tiny")])
    by_id = {r.get("custom_id", r.get("id")): r for r in records(out)}
    assert by_id["a"]["metadata"] == {"row": 1, "tags": ["t"]} and by_id["a"]["category"] == "news"
    assert by_id["a"]["result"]["usage"]["completion_tokens"] == 3
    assert by_id["typo"]["error"]["field"] == "max_new_token" and "max_new_tokens" in by_id["typo"]["error"]["message"]
    assert by_id["clash"]["error"]["field"] == "result"
    assert by_id["o1"]["source"] == "crm" and by_id["o1"]["response"]["status_code"] == 200
    assert summary["failed"] == 2


def test_failed_lines_run_again_on_a_rerun_leaving_one_record_each(service, tmp_path):
    service.worker(**FAST).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, [{"id": f"q{i}", "prompt": f"p{i}", "max_new_tokens": 2} for i in range(6)])
    # an earlier run: q0 done, q1 failed (a worker lost, say)
    write(out, [{"id": "q0", "result": {"text": "earlier"}}, {"id": "q1", "error": {"message": "lost", "field": None}}])
    kept, _ = run_batch(src, out, service.client, progress=False, keep_failed=True)
    assert kept["skipped"] == 2 and kept["retried"] == 0
    summary, _ = run_batch(src, out, service.client, progress=False)
    assert summary["skipped"] == 5 and summary["retried"] == 1 and summary["completed"] == 1
    final = records(out)
    assert sorted(r["id"] for r in final) == [f"q{i}" for i in range(6)]  # one record per line
    assert {r["id"]: r for r in final}["q1"]["result"]["usage"]["completion_tokens"] == 2
    assert {r["id"]: r for r in final}["q0"]["result"] == {"text": "earlier"}


def test_ordered_output_is_in_input_order(service, tmp_path):
    service.worker(**FAST).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # long lines first: they end last, so completion order is not input order
    write(src, [{"id": f"q{i}", "prompt": "p", "max_new_tokens": 60 - 10 * i, "ignore_eos": True} for i in range(6)])
    run_batch(src, out, service.client, progress=False, ordered=True)
    assert [r["id"] for r in records(out)] == [f"q{i}" for i in range(6)]


def test_a_rerun_against_another_input_or_priority_is_named_not_resumed(service, tmp_path):
    service.worker(**FAST).wait_ready()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, [{"id": "a", "prompt": "x", "max_new_tokens": 2}])
    run_batch(src, out, service.client, progress=False)
    with pytest.raises(BatchChanged, match="--priority"):
        run_batch(src, out, service.client, progress=False, priority=7)
    write(src, [{"id": "a", "prompt": "x", "max_new_tokens": 2}, {"id": "b", "prompt": "y", "max_new_tokens": 2}])
    with pytest.raises(BatchChanged, match="input file"):
        run_batch(src, out, service.client, progress=False)
    summary, _ = run_batch(src, out, service.client, progress=False, force=True)
    assert summary["skipped"] == 1 and summary["completed"] == 1
