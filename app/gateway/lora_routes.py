"""Loading and unloading LoRA adapters at run time, as vLLM's server does (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`), but for the whole pool: the request writes the pool's wish (LORA_ADAPTERS),
every worker follows within a second (`AdapterSync`), and the answer comes once a live worker
serves the adapter (or stops serving it), or with the reason a worker gave.

What every worker loads is the operator's act, as vLLM keeps these endpoints off unless
VLLM_ALLOW_RUNTIME_LORA_UPDATING is set: only OPERATOR_KEY passes the guard here (403 for a tenant's
API key, for no key, and for everyone while OPERATOR_KEY is unset), and a `lora_path` must be a
directory inside LORA_ROOT or a hub id LORA_HUB_IDS allows (`ServedSettings.adapter_source`; 403
otherwise, 400 for neither a path nor a hub id). Each worker checks the source again before it loads,
as anything that can write Redis can write LORA_ADAPTERS."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from weightq.settings import AdapterSourceError
from weightq.tasks.contract import LORA_ADAPTERS, LORA_ERRORS
from weightq.tasks.limits import ID_PATTERN

from .core import Gateway
from .errors import HTTPError
from .guard import NOT_OPERATOR, operator_keys

WAIT_S = 30.0  # how long a load or unload waits for the workers to follow
POLL_S = 0.2  # how often it looks meanwhile (the workers follow within a second)


def register(app: FastAPI, gw: Gateway) -> None:
    if set(operator_keys(gw.settings.gateway.operator_key)) & {*gw.keys, gw.metrics_key}:
        # a tenant (or Prometheus) holding the operator's key could load adapters for every tenant
        raise ValueError("OPERATOR_KEY: a key of it is also an API_KEY or the METRICS_KEY; give the operator its own")

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> PlainTextResponse:
        _operator(request)
        body = await gw.intake.body(request)
        name, path = _name(body), body.get("lora_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise HTTPError(400, "lora_path: must be the adapter's directory or hub id", "lora_path")
        try:
            gw.settings.served.adapter_source(path)  # early: each worker checks it again on its own disk
        except AdapterSourceError as e:
            kind = "permission_error" if e.status == 403 else "invalid_request_error"
            raise HTTPError(e.status, f"lora_path: {e}", "lora_path", kind) from None
        if name in gw.adapters():
            raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        workers = gw.workers()
        if workers and not any(w.lora for w in workers.values()):
            raise HTTPError(400, "no live worker serves LoRA adapters (start them with ENABLE_LORA=1)", "lora_name")
        r = gw.client.redis
        await asyncio.to_thread(lambda: (r.hdel(LORA_ERRORS, name), r.hset(LORA_ADAPTERS, name, path)))
        if not workers:
            return PlainTextResponse(f"LoRA adapter '{name}' will be loaded by the workers as they start.")
        loop = asyncio.get_running_loop()
        end = loop.time() + WAIT_S
        while loop.time() < end:
            if name in gw.adapters():
                return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
            why = await asyncio.to_thread(r.hget, LORA_ERRORS, name)
            if why is not None:
                await asyncio.to_thread(r.hdel, LORA_ADAPTERS, name)  # the pool does not keep wanting it
                raise HTTPError(400, f"LoRA adapter '{name}' could not be loaded: {why.decode()}", "lora_path")
            await asyncio.sleep(POLL_S)
        raise HTTPError(504, f"LoRA adapter '{name}': no worker has loaded it within {WAIT_S:.0f} s", None, "timeout")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> PlainTextResponse:
        _operator(request)
        body = await gw.intake.body(request)
        name = _name(body)
        r = gw.client.redis
        wanted = await asyncio.to_thread(r.hget, LORA_ADAPTERS, name)
        if name not in gw.adapters() and not wanted:
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found")
        await asyncio.to_thread(r.hset, LORA_ADAPTERS, name, "")
        loop = asyncio.get_running_loop()
        end = loop.time() + WAIT_S
        while name in gw.adapters() and loop.time() < end:
            await asyncio.sleep(POLL_S)
        if name in gw.adapters():
            raise HTTPError(
                504, f"LoRA adapter '{name}': a worker still serves it after {WAIT_S:.0f} s", None, "timeout"
            )
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _name(body: object) -> str:
    name = body.get("lora_name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not ID_PATTERN.match(name):
        raise HTTPError(
            400, "lora_name: must be 1-128 characters of letters, digits, '.', '_', ':' or '-'", "lora_name"
        )
    return name


def _operator(request: Request) -> None:
    """The guard let only the operator's key through (`Guard.check_operator`); refused here too should
    the routes ever be mounted without it."""
    if not getattr(request.state, "operator", False):
        raise HTTPError(403, NOT_OPERATOR, None, "permission_error")
