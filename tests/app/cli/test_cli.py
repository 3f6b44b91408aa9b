"""The `weightq` command line."""

import json
import time

import pytest
from weightq.batcher.sim import POLICIES
from weightq.cli import main


def test_sim_json_has_every_policy_and_metric(capsys):
    assert main(["sim", "--json", "--requests", "60", "--budget", "8192"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["requests"] == 60 and doc["trace"]["budget"] == 8192
    assert set(doc["policies"]) == set(POLICIES)
    for name, m in doc["policies"].items():
        for key in (
            "output_tokens_per_s",
            "requests_per_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "tpot_p50_s",
            "tpot_p99_s",
            "peak_weight",
            "budget",
            "overflow_steps",
            "preempted_tokens",
            "generated_tokens",
        ):
            assert key in m, (name, key)
        assert m["peak_weight"] <= 8192  # every policy, optimistic too, preempts before a step would overflow
        assert m["overflow_steps"] == 0
        assert m["generated_tokens"] == doc["policies"]["static"]["generated_tokens"]


def test_sim_reads_a_jsonl_trace(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"input_len": 10, "output_len": 5}\n\n{"input_len": 20, "output_len": 30, '
        '"max_new_tokens": 40, "arrival_s": 0.5}\n'
    )
    assert main(["sim", "--json", "--trace", str(trace), "--policies", "weighted,tgi"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trace"]["requests"] == 2 and set(doc["policies"]) == {"weighted", "tgi"}
    assert doc["policies"]["weighted"]["generated_tokens"] == 35


def test_sim_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_len": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        main(["sim", "--trace", str(bad)])
    with pytest.raises(SystemExit, match="unknown policy nope"):
        main(["sim", "--policies", "nope"])
    with pytest.raises(SystemExit, match="below the weight of one max-length request"):
        main(["sim", "--budget", "100"])


def test_sim_table(capsys):
    assert main(["sim", "--requests", "30", "--rate", "5"]) == 0
    out = capsys.readouterr().out
    assert "weighted" in out and "out tok/s" in out


def test_generate_streams_text(capsys):
    assert main(["generate", "Hello", "--max-new-tokens", "5", "--device", "cpu", "--max-batch-weight", "4096"]) == 0
    out = capsys.readouterr().out
    assert ">>> Hello" in out and ("[length: 5 tokens" in out or "[eos" in out)


def test_up_with_flower_names_the_extra_when_flower_is_missing(monkeypatch):
    import importlib.util

    from weightq.cli.stack import require_flower

    require_flower()  # installed here (the dev extra)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flower" else real(name, *a))
    with pytest.raises(SystemExit, match=r"pip install 'weightq\[flower\]'"):
        require_flower()


def test_commands_that_run_an_engine_name_the_worker_extra_when_it_is_missing():
    """`pip install weightq` alone serves a web app; `weightq generate` / `worker` / `up` then say what
    to install, and so does importing the engine (as `celery -A weightq worker` does)."""
    import subprocess
    import sys

    hide = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
    for command in (["generate", "x"], ["worker"], ["up"], ["demo"]):
        code = hide + f"from weightq.cli import main; main({command!r})"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "pip install 'weightq[worker]'" in out.stderr, (command, out.stderr[-2000:])
        assert f"weightq {command[0]}: the engine needs torch, transformers" in out.stderr
    out = subprocess.run([sys.executable, "-c", hide + "import weightq.engine"], capture_output=True, text=True)
    assert "weightq's engine needs torch, which is not installed: pip install 'weightq[worker]'" in out.stderr


def test_generate_checks_its_request_as_the_contract_does(capsys):
    with pytest.raises(SystemExit, match=r"^weightq generate: top_p: must be a finite number"):
        main(["generate", "x", "--top-p", "0"])


def test_commands_pointed_at_a_redis_that_does_not_answer_say_so_at_once(tmp_path):
    """worker, batch and up exit 1 naming REDIS_URL and the URL (no broker retries); the gateway serves
    anyway, /ready answering 503, and says why on its output."""
    import os
    import signal
    import subprocess
    import sys

    import httpx
    from weightq.cli.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    env = os.environ | {"REDIS_URL": url, "WEIGHTQ_HOME": str(tmp_path), "RUNNER": "simulated", "REDIS_RETRY_S": "3600"}
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hello"}\n')
    for command in (["worker"], ["batch", str(src), "-o", str(tmp_path / "out.jsonl")], ["up", "--port", "0"]):
        out = subprocess.run([sys.executable, "-m", "weightq.cli", *command], env=env, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert out.returncode == 1, (command, out.stdout[-2000:], out.stderr[-2000:])
        assert f"cannot reach Redis at {url}" in out.stderr and "REDIS_URL names it" in out.stderr, out.stderr[-2000:]
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "weightq.cli", "gateway", "--port", str(port)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        while True:
            assert gateway.poll() is None, gateway.stdout.read()
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready.status_code == 503 and ready.json()["status"] == "redis unreachable"
    finally:
        gateway.send_signal(signal.SIGTERM)
        out, _ = gateway.communicate(timeout=60)
    assert f"weightq gateway: cannot reach Redis at {url}" in out and "Starting anyway" in out, out
    assert gateway.returncode == 0, out
