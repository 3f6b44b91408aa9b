"""OpenAI's Batch API files for `weightq batch`: input lines
`{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}`
become jobs, and each outcome is an OpenAI batch output line
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}` whose body is what
the gateway would answer for the same body (openai_api.py maps both ways).

A body's `model` must be the served name, as at the gateway: SERVED_MODEL_NAME aliases the model for
files written for another one. Other top-level fields of a line (a `metadata` object, a category) are
carried to its output line as they were (app/client/batch_lines.py: carried).
"""

from __future__ import annotations

from weightq.client.batch_lines import carried, columns
from weightq.tasks.limits import Door
from weightq.tasks.request import JobRequest, RequestError, parse_request

from . import openai_api

URLS = {"/v1/completions": False, "/v1/chat/completions": True}  # url -> chat
KNOWN = ("custom_id", "method", "url", "body")  # an input line's own fields
OUTPUT = ("id", "custom_id", "response", "error")  # an output line's


class OpenAIBatchLines:
    def __init__(self, served_model: str) -> None:
        self.model = served_model

    def matches(self, obj: object) -> bool:
        return isinstance(obj, dict) and "custom_id" in obj and "body" in obj

    def line_id(self, obj: dict, n: int) -> str:
        return str(obj["custom_id"])

    def request(self, obj: dict, priority: int | None) -> JobRequest:
        carried(obj, KNOWN, OUTPUT, KNOWN)  # a column named like the output's, or a near miss: refused
        if obj.get("method", "POST") != "POST":
            raise RequestError("method", f"must be POST (got {str(obj.get('method'))[:32]!r})")
        url = obj.get("url")
        if url not in URLS:
            raise RequestError("url", f"must be one of {', '.join(URLS)} (got {str(url)[:64]!r})")
        body = obj["body"]
        if isinstance(body, dict) and body.get("stream"):
            raise RequestError("stream", "a batch request cannot stream")
        if isinstance(body, dict) and body.get("n") not in (None, 1):
            raise RequestError("n", "a batch line takes n = 1 (write one line per sample)")
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
            raise RequestError("prompt", "a batch line takes one prompt (write one line per prompt)")
        chat = URLS[url]
        job = openai_api.chat_job(body, self.model) if chat else openai_api.completion_job(body, self.model)
        if priority is not None:
            job["priority"] = priority
        return parse_request(job, Door.CHAT if chat else Door.COMPLETIONS)

    def done(self, line_id: str, obj: dict, job_id: str, result: dict) -> dict:
        chat = URLS[obj["url"]]
        prompt = None if chat else openai_api.completion_job(obj["body"], self.model).get("prompt")
        echo = None if chat else openai_api.echoes(obj["body"], [prompt])
        body = openai_api.completion_response(job_id, self.model, result, chat=chat, echo=echo)
        return self._line(line_id, obj, job_id, 200, body)

    def failed(self, line_id: str, obj: dict | None, job_id: str | None, message: str, field: str | None) -> dict:
        if obj is None or job_id is None:  # not a request at all: OpenAI's line-level error
            error = {"code": "invalid_request", "message": message}
            own = columns(obj, KNOWN, OUTPUT, KNOWN)
            return {"id": f"batch_req_{line_id}", "custom_id": line_id, **own, "response": None, "error": error}
        # as the gateway answers: named as the client sent it; a refusal naming no field is the server's
        name = openai_api.CLIENT_FIELDS.get(field, field) or None if field else None
        error = {"message": message, "type": "invalid_request_error", "param": name, "code": None}
        return self._line(line_id, obj, job_id, 400 if name else 500, {"error": error})

    @staticmethod
    def _line(line_id: str, obj: dict, job_id: str, status: int, body: dict) -> dict:
        return {
            "id": f"batch_req_{job_id}",
            "custom_id": line_id,
            **columns(obj, KNOWN, OUTPUT, KNOWN),
            "response": {"status_code": status, "request_id": job_id, "body": body},
            "error": None,
        }
