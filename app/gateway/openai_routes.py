"""OpenAI's routes (/v1/models, /v1/completions, /v1/chat/completions) on the gateway's jobs; the
request and response shapes are openai_api.py's."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tasks.contract import EntryType, outcome

from . import openai_api
from .core import Gateway, sse


def register(app: FastAPI, gw: Gateway) -> None:
    @app.get("/v1/models")
    def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": gw.model, "object": "model", "created": 0, "owned_by": "weightq"}],
        }

    async def completions(request: Request, chat: bool) -> Response:
        body = await gw.body(request)
        job = openai_api.chat_job(body, gw.model) if chat else openai_api.completion_job(body, gw.model)
        gw.serving.check(job, "max_tokens")
        job_id, last_id = await gw.start(request, job, bool(body.get("stream")))
        if not body.get("stream"):
            result = await gw.result(request, job_id)
            return JSONResponse(openai_api.completion_response(job_id, gw.model, result, chat=chat))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        writer = openai_api.ChunkWriter(job_id, gw.model, chat=chat, resumed=last_id != "0-0")

        def chunks(entry_id: str, f: dict) -> list[str]:
            kind = f.get("type")
            if kind == EntryType.TOKEN:
                return [sse(writer.delta(f.get("text", "")), entry_id)] if f.get("text") else []
            if kind == EntryType.END:
                result = outcome(f)
                out = [sse(writer.finish(result), entry_id)]
                if include_usage:
                    out.append(sse(writer.usage(result)))
                return [*out, sse("[DONE]")]
            if kind == EntryType.ERROR:
                err = {"error": {"message": f.get("message", "error"), "type": "server_error", "param": f.get("field")}}
                return [sse(err, entry_id), sse("[DONE]")]
            return []

        return await gw.stream(job_id, chunks, last_id)

    @app.post("/v1/completions")
    async def completion(request: Request) -> Response:
        return await completions(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completion(request: Request) -> Response:
        return await completions(request, chat=True)
