"""LoRA adapters through the whole stack: a worker started with LORA_MODULES advertises them in its
heartbeat, the gateway lists them under /v1/models (parent: the base) and runs a request whose `model`
names one with it, the Python client too; a name no worker holds is refused before it is queued."""

from __future__ import annotations

import httpx
import openai
import pytest
from weightq.batcher import BatcherConfig
from weightq.cli.processes import GatewayProcess
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.tasks.request import RequestError

from tests.engine.test_lora import make_adapter

pytestmark = pytest.mark.service  # real Redis servers and worker processes

KEY = "lora-key"
OPERATOR = "lora-operator"  # OPERATOR_KEY: loads and unloads adapters at run time (test_adapter_operator.py)


def test_adapters_are_listed_served_by_name_and_unknown_ones_refused(service, tiny_path, tmp_path):
    ada = make_adapter(tiny_path, tmp_path / "ada", 8, 11)
    worker = service.worker(lora_modules=f"ada={ada}", compile="off")
    gateway = GatewayProcess(service.url, tmp_path, api_key=KEY, rate_limit_per_s=0, max_concurrent_per_client=0)
    try:
        worker.wait_ready()
        gateway.wait_ready()
        worker.wait_stats(lambda s: s.get("adapters") == ["ada"])
        models = httpx.get(gateway.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("builtin:tiny", None), ("ada", "builtin:tiny")]

        ids = [11, 220, 305, 17, 42, 990, 7]
        local = Engine(
            EngineConfig(
                model=str(tiny_path),
                compile="off",
                lora_modules=f"ada={ada}",
                batcher=BatcherConfig(max_batch_weight=8192),
            )
        )
        want = {
            name: local.generate([GenerationRequest(name or "b", prompt_token_ids=ids, adapter=name,
                                                    params=SamplingParams(max_new_tokens=12, ignore_eos=True))])[0]
            for name in ("", "ada")
        }  # fmt: skip
        assert want["ada"].token_ids != want[""].token_ids
        oai = openai.OpenAI(base_url=gateway.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        for model, name in (("ada", "ada"), ("builtin:tiny", "")):
            out = oai.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})  # fmt: skip
            assert out.model == model and out.choices[0].text == want[name].text
        stream = oai.completions.create(model="ada", prompt=ids, max_tokens=12, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert "".join(c.choices[0].text for c in stream if c.choices) == want["ada"].text

        try:
            oai.completions.create(model="nope", prompt="hi", max_tokens=4)
            raise AssertionError("an adapter no worker holds was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "model"
            assert "(serving 'builtin:tiny'; LoRA adapters: ada)" in e.body["message"]  # what is served

        text = local.generate(
            [GenerationRequest("t", prompt="LoRA says", adapter="ada", params=SamplingParams(max_new_tokens=8))]
        )[0]
        body = {"inputs": "LoRA says", "parameters": {"adapter_id": "ada", "max_new_tokens": 8}}
        tgi = httpx.post(gateway.base + "/generate", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)
        assert tgi.status_code == 200 and tgi.json()["generated_text"] == text.text  # TGI's multi-LoRA parameter

        job = service.client.submit(prompt_token_ids=ids, adapter="ada", max_new_tokens=12, ignore_eos=True)
        assert job.result(timeout=60)["text"] == want["ada"].text
        try:
            service.client.submit(prompt="hi", adapter="nope")
            raise AssertionError("an adapter no worker holds was accepted")
        except RequestError as e:
            assert e.field == "model" and "(serving 'builtin:tiny'; LoRA adapters: ada)" in str(e)
    finally:
        gateway.stop()


def test_adapters_load_and_unload_at_run_time_for_the_whole_pool(service, tiny_path, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, with the operator's key and from
    LORA_ROOT: every live worker follows, and one started later loads what was loaded before it."""
    bob = make_adapter(tiny_path, tmp_path / "bob", 4, 12)
    root = {"lora_root": str(tmp_path)}
    first = service.worker("w1@test", enable_lora=1, compile="off", **root)
    gateway = GatewayProcess(
        service.url, tmp_path, api_key=KEY, operator_key=OPERATOR, rate_limit_per_s=0, max_concurrent_per_client=0,
        **root,
    )  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY}"}
    operator = {"Authorization": f"Bearer {OPERATOR}"}
    try:
        first.wait_ready()
        gateway.wait_ready()
        post = lambda path, body, key=operator: httpx.post(gateway.base + path, json=body, headers=key, timeout=60)  # noqa: E731
        for key in ({}, auth):  # no key, a tenant's key: not the operator's act
            assert post("/v1/load_lora_adapter", {"lora_name": "bob", "lora_path": str(bob)}, key).status_code == 403
        bad = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and "w1@test" in bad.json()["error"]["message"]
        ok = post("/v1/load_lora_adapter", {"lora_name": "bob", "lora_path": str(bob)})
        assert ok.status_code == 200 and "added successfully" in ok.text
        again = post("/v1/load_lora_adapter", {"lora_name": "bob", "lora_path": str(bob)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        second = service.worker("w2@test", enable_lora=1, compile="off", **root)  # started later: loads bob too
        second.wait_ready()
        second.wait_stats(lambda s: s.get("adapters") == ["bob"])

        oai = openai.OpenAI(base_url=gateway.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        ids = [5, 99, 610, 23]
        local = Engine(
            EngineConfig(
                model=str(tiny_path),
                compile="off",
                lora_modules=f"bob={bob}",
                batcher=BatcherConfig(max_batch_weight=8192),
            )
        )
        params = SamplingParams(max_new_tokens=10, ignore_eos=True)
        want = local.generate([GenerationRequest("b", prompt_token_ids=ids, adapter="bob", params=params)])[0]
        for _ in range(4):  # both workers serve it
            out = oai.completions.create(
                model="bob", prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.choices[0].text == want.text

        gone = post("/v1/unload_lora_adapter", {"lora_name": "bob"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
        assert post("/v1/unload_lora_adapter", {"lora_name": "bob"}).status_code == 404
        models = httpx.get(gateway.base + "/v1/models", headers=auth).json()["data"]
        assert [m["id"] for m in models] == ["builtin:tiny"]
        try:
            oai.completions.create(model="bob", prompt=ids, max_tokens=4)
            raise AssertionError("an unloaded adapter was served")
        except openai.BadRequestError as e:
            assert e.body["param"] == "model"
    finally:
        gateway.stop()
