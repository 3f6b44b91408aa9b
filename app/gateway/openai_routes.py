"""OpenAI's routes (/v1/models, /v1/completions, /v1/chat/completions) on the gateway's jobs; the
request and response shapes are openai_api.py's."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from weightq.tasks.contract import EntryType, outcome
from weightq.tasks.limits import Door
from weightq.tasks.request import JobRequest

from . import openai_api, streams
from .core import Gateway
from .errors import HTTPError
from .streams import sse


def token_chunks(writer: openai_api.ChunkWriter, index: int, entry_id: str, f: dict) -> list[str]:
    if "lp" in f:  # every token has a chunk, its text empty while a character is incomplete
        return [sse(writer.delta(f.get("text", ""), json.loads(f["lp"]), index), entry_id)]
    return [sse(writer.delta_json(text, index), entry_id)] if (text := f.get("text")) else []


def error_chunk(f: dict) -> dict:
    return {"error": {"message": f.get("message", "error"), "type": "server_error", "param": f.get("field")}}


def register(app: FastAPI, gw: Gateway) -> None:
    @app.get("/v1/models")
    def models() -> dict:
        """The base model and the LoRA adapters live workers hold (their `parent`: the base), as vLLM lists them."""
        base = {"id": gw.model, "object": "model", "created": 0, "owned_by": "weightq"}
        base |= {"root": gw.model, "parent": None}
        adapters = sorted(gw.adapters())  # as of now: an unload is seen at once
        return {"object": "list", "data": [base, *({**base, "id": a, "root": a, "parent": gw.model} for a in adapters)]}

    async def completions(request: Request, chat: bool) -> Response:
        body = await gw.intake.body(request)
        asked = openai_api.chat_jobs if chat else openai_api.completion_jobs
        door, prompt = (Door.CHAT, "messages") if chat else (Door.COMPLETIONS, "prompt")
        streaming = isinstance(body, dict) and bool(body.get("stream"))  # (a body not an object: parse says so)
        async with gw.intake.turn(request, streaming):
            jobs = await gw.intake.parse(request, lambda: asked(body, gw.model), door, prompt, streaming)
            if len(jobs) > 1:
                ids = await submit_several(request, body, jobs)
            else:
                job_id, last_id, owner = await gw.start(request, jobs[0], streaming)
        if len(jobs) > 1:
            return await several(request, body, jobs, ids, chat)
        model = jobs[0].adapter or gw.model  # a response names the adapter it ran with
        if not body.get("stream"):
            result = await gw.result(request, job_id)
            echo = openai_api.echoes(body, [job.prompt for job in jobs])
            return JSONResponse(openai_api.completion_response(job_id, model, result, chat=chat, echo=echo))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        writer = openai_api.ChunkWriter(job_id, model, chat=chat, resumed=last_id != "0-0")

        def chunks(entry_id: str, f: dict) -> list[str]:
            kind = f.get("type")
            if kind == EntryType.TOKEN:
                return token_chunks(writer, 0, entry_id, f)
            if kind == EntryType.END:
                result = outcome(f)
                out = [sse(writer.finish(result), entry_id)]
                if include_usage:
                    out.append(sse(writer.usage(result)))
                return [*out, sse("[DONE]")]
            if kind == EntryType.ERROR:
                return [sse(error_chunk(f), entry_id), sse("[DONE]")]
            return []

        return await streams.stream(gw, job_id, chunks, last_id, owner=owner)

    async def submit_several(request: Request, body: dict, jobs: list[JobRequest]) -> list[str]:
        if body.get("stream") and request.headers.get("last-event-id"):
            raise HTTPError(400, "Last-Event-ID resumes a single-choice stream", "Last-Event-ID")
        gw.intake.hold(request, len(jobs))
        return await gw.submit_all(jobs)  # one group commit

    async def several(request: Request, body: dict, jobs: list[JobRequest], ids: list[str], chat: bool) -> Response:
        """Several choices (a list of prompts, or n > 1): one job each, answered together."""
        n = body.get("n") or 1
        model = jobs[0].adapter or gw.model
        if not body.get("stream"):
            results = await gw.results(request, ids)
            echo = openai_api.echoes(body, [job.prompt for job in jobs])
            return JSONResponse(openai_api.completion_response(ids[0], model, results, chat=chat, n=n, echo=echo))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        writer = openai_api.ChunkWriter(ids[0], model, chat=chat)
        results: dict[int, dict] = {}

        def chunks(i: int, entry_id: str, f: dict) -> list[str]:
            kind = f.get("type")
            if kind == EntryType.TOKEN:
                return token_chunks(writer, i, entry_id, f)
            if kind == EntryType.END:
                results[i] = outcome(f)
                return [sse(writer.finish(results[i], i), entry_id)]
            if kind == EntryType.ERROR:
                return [sse(error_chunk(f), entry_id)]
            return []

        def tail() -> list[str]:
            done = [results[i] for i in sorted(results)]
            return ([sse(writer.usage(done, n))] if include_usage and len(done) == len(ids) else []) + [sse("[DONE]")]

        return await streams.stream_many(gw, ids, chunks, tail)

    @app.post("/v1/completions")
    async def completion(request: Request) -> Response:
        return await completions(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completion(request: Request) -> Response:
        return await completions(request, chat=True)
