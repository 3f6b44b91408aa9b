"""Loading an adapter on every worker is the operator's act: only OPERATOR_KEY reaches the adapter routes
(403 for a tenant's key, for no key, and for everyone while it is unset), a run-time `lora_path` must lie
inside LORA_ROOT (symlinks and ".." resolved) or match LORA_HUB_IDS, each worker checks again what
LORA_ADAPTERS names, no refusal or load error echoes a path or a file's content, and a refused model
is answered with the name of the one served."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
import torch
from weightq.cli.processes import GatewayProcess
from weightq.client import Client
from weightq.client.batch import run_batch
from weightq.engine.lora import AdapterError, load_adapter
from weightq.engine.lora import adapter as engine_adapter
from weightq.gateway.openai_batch import OpenAIBatchLines
from weightq.settings import HUB_ID, AdapterSourceError, ServedSettings, Settings, adapter_is_local
from weightq.tasks.contract import LORA_ADAPTERS, LORA_ERRORS
from weightq.tasks.request import RequestError

from tests.engine.test_lora import make_adapter

KEY, OPERATOR = "tenant-key", "operator-key"
SECRET = "s3cr3t-token-in-a-file"  # what a refused or broken adapter's error must never repeat
SERVED = "tiny-served"


@pytest.fixture
def tree(tmp_path):
    """LORA_ROOT with a directory inside, a directory outside, and links out of the root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "inside").mkdir(parents=True)
    (outside / SECRET).mkdir(parents=True)
    (root / "link-out").symlink_to(outside / SECRET)
    return root, outside / SECRET


def refused(served: ServedSettings, spec: str) -> AdapterSourceError:
    with pytest.raises(AdapterSourceError) as e:
        served.adapter_source(spec)
    return e.value


def test_a_local_lora_path_must_resolve_inside_lora_root(tree):
    root, outside = tree
    served = ServedSettings(lora_root=str(root))
    assert served.adapter_source(str(root / "inside")) == os.path.realpath(root / "inside")
    for spec in (str(outside), str(root / "link-out"), f"{root}/inside/../../outside/{SECRET}", str(root) + "-twin"):
        e = refused(served, spec)
        assert e.status == 403 and str(e) == "outside LORA_ROOT"  # no path echoed, resolved or given
    for spec in ("./inside", "~/inside", "../outside"):  # relative: each process would resolve it elsewhere
        e = refused(served, spec)
        assert e.status == 400 and "must be an absolute path inside LORA_ROOT" in str(e) and spec not in str(e)
    e = refused(served, "myorg/adapter")
    assert e.status == 403 and "LORA_HUB_IDS is not set" in str(e)


def test_hub_ids_must_match_lora_hub_ids_and_nothing_loads_with_neither_set(tree):
    served = ServedSettings(lora_hub_ids="myorg/*, other/exact")
    assert served.adapter_source("myorg/style") == "myorg/style"
    assert served.adapter_source("other/exact") == "other/exact"
    for spec in ("evil/style", "MYORG/style", "other/exact2", "style"):
        e = refused(served, spec)
        assert e.status == 403 and "not allowed by LORA_HUB_IDS" in str(e)
    for spec in ("a/b/c", "myorg/..", "bad id", "x" * 5000):
        assert refused(served, spec).status == 400
    e = refused(served, str(tree[0] / "inside"))
    assert e.status == 403 and "LORA_ROOT is not set" in str(e)
    e = refused(ServedSettings(), "myorg/style")
    assert e.status == 403 and "LORA_ROOT" in str(e) and "LORA_HUB_IDS" in str(e)
    with pytest.raises(ValueError, match="LORA_ROOT='adapters': Value error, must be an absolute directory"):
        _ = Settings(lora_root="adapters").served


def test_the_gateway_and_the_engine_tell_a_directory_from_a_hub_id_alike():
    """One rule, stated in two places the layering keeps apart (the web side never imports the engine)."""
    assert HUB_ID.pattern == engine_adapter.HUB_ID.pattern
    for spec in ("/abs/dir", "~/dir", "./dir", "../dir", ".hidden", "org/name", "name", "dir/sub/deeper", "x y"):
        assert adapter_is_local(spec) == engine_adapter.is_local(spec), spec


def test_an_adapters_load_errors_name_the_problem_never_its_content_or_path(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "peft_type": "LORA", "' + SECRET + '": oops}')
    bad_value = tmp_path / "bad-value"
    bad_value.mkdir()
    (bad_value / "adapter_config.json").write_text(json.dumps({"r": SECRET, "peft_type": "LORA"}))
    bad_type = tmp_path / "bad-type"
    bad_type.mkdir()
    (bad_type / "adapter_config.json").write_text(json.dumps({"peft_type": f"x {SECRET}"}))
    bad_weights = tmp_path / "bad-weights"
    bad_weights.mkdir()
    (bad_weights / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    header = json.dumps({SECRET: {"dtype": "F32", "shape": [1], "data_offsets": [0, 99]}}).encode()
    (bad_weights / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    expected = {
        broken: "adapter_config.json is not valid JSON",
        bad_value: "adapter_config.json's r must be a positive int",
        bad_type: "peft_type a str is not served",
        bad_weights: "adapter_model.safetensors cannot be read as weights",
        tmp_path / "missing": "its path is not a directory",
    }
    for path, why in expected.items():
        with pytest.raises(AdapterError) as e:
            load_adapter("x", str(path), {}, device=torch.device("cpu"), dtype=torch.float32, allow_download=False)
        message = str(e.value)
        assert why in message and SECRET not in message and str(tmp_path) not in message, message


@pytest.mark.service  # real Redis, a worker process and gateway processes
def test_only_the_operator_loads_adapters_from_allowed_sources(service, tiny_path, tmp_path, tree):
    root, outside = tree
    good = make_adapter(tiny_path, root / "inside" / "good", 4, 21)
    make_adapter(tiny_path, outside, 4, 22)  # a real adapter, outside the root: reachable only by a link
    broken = root / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ' + SECRET + "}")
    allowed = {"lora_root": str(root), "lora_hub_ids": "myorg/*", "served_model_name": SERVED}
    worker = service.worker("w1@test", enable_lora=1, compile="off", **allowed)
    limits = {"rate_limit_per_s": 0, "max_concurrent_per_client": 0}
    gateway = GatewayProcess(service.url, tmp_path, api_key=KEY, operator_key=f"other,{OPERATOR}", **allowed, **limits)
    closed = GatewayProcess(service.url, tmp_path, api_key=KEY, **allowed, **limits)  # OPERATOR_KEY unset
    as_key = lambda key: {"Authorization": f"Bearer {key}"}  # noqa: E731

    def post(path: str, body: dict, key: str | None = OPERATOR, base: str = gateway.base) -> httpx.Response:
        return httpx.post(base + path, json=body, headers=as_key(key) if key else {}, timeout=60)

    try:
        worker.wait_ready()
        gateway.wait_ready()
        closed.wait_ready()
        load = {"lora_name": "good", "lora_path": good}
        for route, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "good"})):
            for key in (KEY, None, "wrong"):  # a tenant's key, no key, a wrong one: not the operator
                r = post(route, body, key)
                assert r.status_code == 403 and "OPERATOR_KEY" in r.json()["error"]["message"], (route, key)
            for key in (OPERATOR, KEY, None):
                r = post(route, body, key, closed.base)
                assert r.status_code == 403 and "is off" in r.json()["error"]["message"]
                assert "OPERATOR_KEY" in r.json()["error"]["message"]
        assert httpx.get(gateway.base + "/v1/models", headers=as_key(OPERATOR)).status_code == 401  # these routes only

        for spec in (str(outside), str(root / "link-out"), f"{root}/inside/../../outside/{SECRET}"):
            r = post("/v1/load_lora_adapter", {"lora_name": "out", "lora_path": spec})
            error = r.json()["error"]
            assert r.status_code == 403 and error["param"] == "lora_path", spec
            assert "outside LORA_ROOT" in error["message"] and SECRET not in r.text and str(tmp_path) not in r.text
        r = post("/v1/load_lora_adapter", {"lora_name": "hub", "lora_path": "evil/adapter"})
        assert r.status_code == 403 and "not allowed by LORA_HUB_IDS" in r.json()["error"]["message"]

        r = post("/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(broken)})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "w1@test" in message and "adapter_config.json is not valid JSON" in message
        assert SECRET not in r.text and str(tmp_path) not in r.text

        # Anything that can write Redis can write the pool's wish: the worker checks it again.
        service.client.redis.hset(LORA_ADAPTERS, "sneaky", str(root / "link-out"))
        deadline = time.monotonic() + 60
        while (why := service.client.redis.hget(LORA_ERRORS, "sneaky")) is None:
            assert time.monotonic() < deadline, "the worker never answered the entry"
            time.sleep(0.2)
        why = why.decode()
        assert "w1@test" in why and "outside LORA_ROOT" in why and SECRET not in why and str(tmp_path) not in why
        assert "sneaky" not in worker.wait_stats(lambda s: True).get("adapters", [])

        ok = post("/v1/load_lora_adapter", load)
        assert ok.status_code == 200 and "added successfully" in ok.text
        assert post("/v1/unload_lora_adapter", {"lora_name": "good"}, KEY).status_code == 403
        gone = post("/v1/unload_lora_adapter", {"lora_name": "good"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
    finally:
        gateway.stop()
        closed.stop()


@pytest.mark.service
def test_a_refused_model_is_answered_with_the_served_ones_name_at_every_door(service, tiny_path, tmp_path):
    ada = make_adapter(tiny_path, tmp_path / "ada", 4, 23)
    worker = service.worker(lora_modules=f"ada={ada}", compile="off", served_model_name=SERVED)
    gateway = GatewayProcess(
        service.url, tmp_path, api_key=KEY, served_model_name=SERVED, rate_limit_per_s=0, max_concurrent_per_client=0
    )
    want = f"'nope' is not served here (serving '{SERVED}'; LoRA adapters: ada)"
    try:
        worker.wait_ready()
        gateway.wait_ready()
        worker.wait_stats(lambda s: s.get("adapters") == ["ada"])
        auth = {"Authorization": f"Bearer {KEY}"}
        for route, body in (
            ("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = httpx.post(gateway.base + route, json=body, headers=auth, timeout=60)
            assert r.status_code == 400 and want in r.json()["error"]["message"], r.text
        tgi = {"inputs": "hi", "parameters": {"adapter_id": "nope", "max_new_tokens": 2}}
        r = httpx.post(gateway.base + "/generate", json=tgi, headers=auth, timeout=60)
        assert r.status_code == 400 and want in r.json()["error"], r.text
        r = httpx.post(gateway.base + "/v1/completions", json={"model": "no pe", "prompt": "hi"}, headers=auth)
        assert r.status_code == 400 and f"(serving '{SERVED}')" in r.json()["error"]["message"]

        client = Client(service.url, settings=Settings(redis_url=service.url, served_model_name=SERVED))
        with pytest.raises(RequestError) as e:
            client.submit(prompt="hi", adapter="nope")
        assert e.value.field == "model" and want in str(e.value)
        lines = tmp_path / "in.jsonl"
        body = {"model": "nope", "prompt": "hi", "max_tokens": 2}
        lines.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}))
        run_batch(lines, tmp_path / "out.jsonl", client, progress=False, formats=[OpenAIBatchLines(SERVED)])
        line = json.loads((tmp_path / "out.jsonl").read_text())  # the batch says it in its own words
        message = (line["error"] or line["response"]["body"]["error"])["message"]
        assert "'nope' is not served here" in message and f"'{SERVED}'" in message and "ada" in message
    finally:
        gateway.stop()


def test_an_operator_key_that_is_also_a_tenants_or_the_metrics_key_is_refused_at_start(redis_url):
    from weightq.gateway import create_app

    for shared in (dict(api_key=f"{KEY},{OPERATOR}"), dict(metrics_key=OPERATOR)):
        with pytest.raises(ValueError) as e:
            create_app(Settings(redis_url=redis_url, operator_key=f"other,{OPERATOR}", **shared))
        assert "OPERATOR_KEY" in str(e.value) and OPERATOR not in str(e.value)  # the key is never echoed
    assert create_app(Settings(redis_url=redis_url, api_key=KEY, metrics_key="prom", operator_key=OPERATOR))
