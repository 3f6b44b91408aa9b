"""Hugging Face text-generation-inference's routes (/generate, /generate_stream, /info, and the `/` that
the `text_generation` client posts to) on the gateway's jobs; the shapes are tgi_api.py's."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from weightq.tasks.contract import EntryType, outcome, part_id, token_parts
from weightq.tasks.limits import Door

from . import streams
from .core import Gateway
from .streams import sse
from .tgi_api import best_of_jobs, details, job_request, token, top_tokens


def register(app: FastAPI, gw: Gateway) -> None:
    async def generate(request: Request, body: dict, *, as_list: bool) -> Response:
        job, params = job_request(body)
        async with gw.intake.turn(request):
            samples = await gw.intake.parse(request, lambda: best_of_jobs(job, params.get("best_of") or 1), Door.TGI)
            gw.intake.hold(request, len(samples))
            ids = await gw.submit_all(samples)  # one group commit
        collected: list[tuple[dict, list[dict], list[list[dict]]]] = []

        async def collect(job_id: str) -> tuple[dict, list[dict], list[list[dict]]]:
            tokens: list[dict] = []
            tops: list[list[dict]] = []
            async for _, f in gw.events(job_id):
                if f.get("type") == EntryType.TOKEN:
                    for part in token_parts(f):
                        tokens.append(token(part))
                        tops.append(top_tokens(part))
                elif (result := outcome(f)) is not None:  # raises JobFailed on an error entry
                    if result.get("finish_reason") == "eos" and tokens:
                        tokens[-1]["special"] = True
                    return result, tokens, tops
            raise RuntimeError("stream ended without a result")

        try:
            for item in await asyncio.gather(*(gw.wait(request, j, collect(j)) for j in ids)):
                collected.append(item)
        except BaseException:
            for job_id in ids:
                gw.cancel_soon(job_id)
            raise
        # best_of: the sample whose tokens are likeliest under the model (TGI's choice), the others listed
        best = max(range(len(collected)), key=lambda i: sum(t["logprob"] or 0.0 for t in collected[i][1]))
        prefix = job["prompt"] if params.get("return_full_text") else ""
        top_n = bool(params.get("top_n_tokens"))

        def sequence_details(i: int) -> dict:
            result, tokens, tops = collected[i]
            return details(result, tokens, samples[i].seed, tops if top_n else None)

        out: dict = {"generated_text": prefix + collected[best][0]["text"]}
        if params.get("details") or as_list:
            out["details"] = sequence_details(best)
            if len(collected) > 1:
                others = [i for i in range(len(collected)) if i != best]
                out["details"]["best_of_sequences"] = [
                    {"generated_text": prefix + collected[i][0]["text"], **sequence_details(i)} for i in others
                ]
        return JSONResponse([out] if as_list else out)

    async def generate_stream(request: Request, body: dict) -> Response:
        job, params = job_request(body, stream=True)
        async with gw.intake.turn(request, streaming=True):
            (parsed,) = await gw.intake.parse(request, lambda: ([job], 1), Door.TGI, streaming=True)
            job_id, last_id, owner = await gw.start(request, parsed, True)
        want_details = bool(params.get("details"))
        prefix = job["prompt"] if params.get("return_full_text") else ""

        def chunks(entry_id: str, f: dict) -> list[str]:
            kind = f.get("type")
            if kind == EntryType.TOKEN:  # TGI streams an event per token: one each, with the entry's id
                events = []
                for part in token_parts(f):
                    event = {"token": token(part), "generated_text": None, "details": None}
                    if params.get("top_n_tokens"):
                        event["top_tokens"] = top_tokens(part)
                    events.append(sse(event, part_id(entry_id, part, f)))
                return events
            if kind == EntryType.END:
                # TGI sends the last token with the full text; our end entry carries no token, so a last
                # event repeats nothing: it has an empty special token, the text and the details.
                result = outcome(f)
                last = {"id": 0, "text": "", "logprob": None, "special": True}
                d = details(result, [], params.get("seed")) if want_details else None
                if d is not None:
                    d = {k: d[k] for k in ("finish_reason", "generated_tokens", "seed")}
                return [sse({"token": last, "generated_text": prefix + result["text"], "details": d}, entry_id)]
            if kind == EntryType.ERROR:
                return [sse({"error": f.get("message", "error"), "error_type": "generation"}, entry_id)]
            return []

        return await streams.stream(gw, job_id, chunks, last_id, owner=owner)

    @app.post("/generate")
    async def generate_route(request: Request) -> Response:
        return await generate(request, await gw.intake.body(request), as_list=False)

    @app.post("/generate_stream")
    async def generate_stream_route(request: Request) -> Response:
        return await generate_stream(request, await gw.intake.body(request))

    @app.post("/")
    async def compat_route(request: Request) -> Response:
        """Where the `text_generation` client posts: streaming or not by the body's `stream` flag."""
        body = await gw.intake.body(request)
        if isinstance(body, dict) and body.get("stream"):
            return await generate_stream(request, body)
        return await generate(request, body, as_list=True)

    @app.get("/info")
    def info() -> dict:
        workers = gw.workers()
        any_worker = next(iter(workers.values()), None)
        s = gw.settings
        threads = s.worker.concurrency
        return {
            "model_id": gw.model,
            "model_dtype": s.served.dtype,
            "model_device_type": s.served.device,
            "max_input_tokens": any_worker.max_input_length if any_worker else s.served.max_input_length or None,
            "max_total_tokens": any_worker.max_total_tokens if any_worker else s.served.max_total_tokens or None,
            "max_batch_total_tokens": any_worker.max_batch_weight if any_worker else None,
            # each worker's task threads as its pool runs them (heartbeat), else CONCURRENCY
            "max_concurrent_requests": sum(int(w.stats.get("threads") or threads) for w in workers.values()) or threads,
            "workers": len(workers),
            "router": "weightq",
            "version": gw.version,
        }
