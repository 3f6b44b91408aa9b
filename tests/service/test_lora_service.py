"""LoRA adapters through the whole stack: a worker started with LORA_MODULES advertises them in its
heartbeat, the gateway lists them under /v1/models (parent: the base) and runs a request whose `model`
names one with it, the Python client too; a name no worker holds is refused before it is queued."""

from __future__ import annotations

import httpx
import openai
from weightq.cli.processes import GatewayProcess
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from weightq.tasks.request import RequestError

from tests.engine.test_lora import make_adapter

KEY = "lora-key"


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
            EngineConfig(model=str(tiny_path), compile="off", max_batch_weight=8192, lora_modules=f"ada={ada}")
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
            assert e.body["param"] == "model" and "LoRA adapters: ada" in e.body["message"]

        job = service.client.submit(prompt_token_ids=ids, adapter="ada", max_new_tokens=12, ignore_eos=True)
        assert job.result(timeout=60)["text"] == want["ada"].text
        try:
            service.client.submit(prompt="hi", adapter="nope")
            raise AssertionError("an adapter no worker holds was accepted")
        except RequestError as e:
            assert e.field == "model"
    finally:
        gateway.stop()
