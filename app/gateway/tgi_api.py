"""Hugging Face text-generation-inference's routes (/generate, /generate_stream, /info, and the `/` that
the `text_generation` client posts to), mapped onto weightq jobs and back."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tasks.schema import RequestError, field_name

from .http_errors import JobError

if TYPE_CHECKING:
    from .gateway import Gateway

PARAMETERS = {
    "do_sample", "max_new_tokens", "repetition_penalty", "frequency_penalty", "return_full_text", "stop", "seed",
    "temperature", "top_k", "top_p", "truncate", "typical_p", "best_of", "watermark", "details",
    "decoder_input_details", "top_n_tokens", "grammar", "adapter_id",
}  # fmt: skip
FINISH = {"eos": "eos_token", "stop": "stop_sequence", "length": "length", "cancelled": "length"}


def error_type(status: int) -> str:
    return {400: "validation", 413: "validation", 422: "validation", 429: "overloaded", 503: "overloaded"}.get(
        status, "generation"
    )


def _refuse_unless(params: dict, name: str, allowed: tuple) -> None:
    if params.get(name) not in allowed:
        raise RequestError(f"parameters.{name}", f"not supported by weightq (allowed: {', '.join(map(repr, allowed))})")


def job_request(body: object) -> tuple[dict, dict]:
    """(job request, the TGI parameters) of a /generate body."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - {"inputs", "parameters", "stream"})
    if unknown:
        raise RequestError(field_name(unknown[0]), "unknown field")
    inputs = body.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise RequestError("inputs", "must be a non-empty string")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError("parameters", "must be an object")
    unknown = sorted(set(params) - PARAMETERS)
    if unknown:
        raise RequestError(f"parameters.{field_name(unknown[0])}", "unknown parameter")
    for name, allowed in (
        ("frequency_penalty", (None, 0, 0.0)),
        ("truncate", (None,)),
        ("typical_p", (None,)),
        ("best_of", (None, 1)),
        ("watermark", (None, False)),
        ("decoder_input_details", (None, False)),
        ("top_n_tokens", (None, 0)),
        ("grammar", (None,)),
        ("adapter_id", (None,)),
    ):
        _refuse_unless(params, name, allowed)
    job: dict = {"prompt": inputs}
    sample = params.get("do_sample") or any(params.get(k) is not None for k in ("temperature", "top_k", "top_p"))
    if sample:
        job["temperature"] = 1.0 if params.get("temperature") is None else params["temperature"]
    for name in ("max_new_tokens", "repetition_penalty", "seed", "top_k", "top_p"):
        if params.get(name) is not None:
            job[name] = params[name]
    if params.get("stop"):
        job["stop"] = params["stop"]
    job.setdefault("max_new_tokens", 100)  # TGI's default
    return job, params


def details(result: dict, tokens: list[dict], seed: int | None) -> dict:
    return {
        "finish_reason": FINISH.get(result.get("finish_reason", "length"), "length"),
        "generated_tokens": result["usage"]["completion_tokens"],
        "seed": seed,
        "prefill": [],
        "tokens": tokens,
    }


def token(fields: dict, special: bool = False) -> dict:
    return {"id": int(fields.get("id", 0)), "text": fields.get("text", ""), "logprob": None, "special": special}


def routes(app: FastAPI, gw: Gateway, sse) -> None:
    async def generate(request: Request, body: dict, *, as_list: bool) -> Response:
        job, params = job_request(body)
        job_id = await gw.submit(job)
        tokens: list[dict] = []

        async def collect() -> dict:
            async for _, f in gw.events(job_id):
                if f.get("type") == "token":
                    tokens.append(token(f))
                elif f.get("type") == "end":
                    return json.loads(f["result"])
                elif f.get("type") == "error":
                    raise JobError(f)
            raise RuntimeError("stream ended without a result")

        result = await gw.wait(request, job_id, collect())
        if result.get("finish_reason") == "eos" and tokens:
            tokens[-1]["special"] = True
        text = result["text"]
        if params.get("return_full_text"):
            text = job["prompt"] + text
        out: dict = {"generated_text": text}
        if params.get("details") or as_list:
            out["details"] = details(result, tokens, params.get("seed"))
        return JSONResponse([out] if as_list else out)

    async def generate_stream(request: Request, body: dict) -> Response:
        job, params = job_request(body)
        job_id, last_id = await gw.start(request, job, True)
        want_details = bool(params.get("details"))
        prefix = job["prompt"] if params.get("return_full_text") else ""

        def chunks(entry_id: str, f: dict) -> list[str]:
            kind = f.get("type")
            if kind == "token":
                return [sse({"token": token(f), "generated_text": None, "details": None}, entry_id)]
            if kind == "end":
                # TGI sends the last token with the full text; our end entry carries no token, so a last
                # event repeats nothing: it has an empty special token, the text and the details.
                result = json.loads(f["result"])
                last = {"id": 0, "text": "", "logprob": None, "special": True}
                d = details(result, [], params.get("seed")) if want_details else None
                if d is not None:
                    d = {k: d[k] for k in ("finish_reason", "generated_tokens", "seed")}
                return [sse({"token": last, "generated_text": prefix + result["text"], "details": d}, entry_id)]
            if kind == "error":
                return [sse({"error": f.get("message", "error"), "error_type": "generation"}, entry_id)]
            return []

        return await gw.stream(job_id, chunks, last_id)

    @app.post("/generate")
    async def generate_route(request: Request) -> Response:
        return await generate(request, await gw.body(request), as_list=False)

    @app.post("/generate_stream")
    async def generate_stream_route(request: Request) -> Response:
        return await generate_stream(request, await gw.body(request))

    @app.post("/")
    async def compat_route(request: Request) -> Response:
        """Where the `text_generation` client posts: streaming or not by the body's `stream` flag."""
        body = await gw.body(request)
        if isinstance(body, dict) and body.get("stream"):
            return await generate_stream(request, body)
        return await generate(request, body, as_list=True)

    @app.get("/info")
    def info() -> dict:
        workers = gw.workers()
        any_worker = next(iter(workers.values()), {})
        s = gw.settings
        return {
            "model_id": gw.model,
            "model_dtype": s.dtype,
            "model_device_type": s.device,
            "max_input_tokens": any_worker.get("max_input_length", s.max_input_length or None),
            "max_total_tokens": any_worker.get("max_total_tokens", s.max_total_tokens or None),
            "max_batch_total_tokens": any_worker.get("max_batch_weight"),
            "max_concurrent_requests": s.concurrency * max(1, len(workers)),
            "workers": len(workers),
            "router": "weightq",
            "version": gw.version,
        }
