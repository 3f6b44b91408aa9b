"""OpenAI's completions and chat completions, mapped onto weightq jobs and back.

Requests become `weightq.generate` job requests (tasks/schema.py checks them further); anything
OpenAI defines that weightq cannot honour is refused by name rather than silently ignored.
"""

from __future__ import annotations

import time

from tasks.schema import RequestError, field_name

# Accepted and ignored: they change nothing about the generation.
IGNORED = {"user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
# Extensions beyond OpenAI (as vLLM accepts them), passed through to the job.
EXTRAS = {"top_k", "repetition_penalty", "ignore_eos", "stop_token_ids"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed"} | IGNORED | EXTRAS
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix", "presence_penalty",
                              "frequency_penalty", "logit_bias"}  # fmt: skip
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty",
                        "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice"}  # fmt: skip
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


CLIENT_FIELDS = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}  # job field -> what a client sent


def _refuse_unless(body: dict, name: str, allowed: tuple) -> None:
    if name in body and body[name] not in allowed:
        raise RequestError(name, f"not supported by weightq (allowed: {', '.join(map(repr, allowed))})")


def _common(body: dict, fields: set[str], served_model: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise RequestError(field_name(unknown[0]), "unknown field")
    model = body.get("model")
    if model is not None and model != served_model:
        raise RequestError("model", f"model {model!r} is not served here (serving {served_model!r})")
    _refuse_unless(body, "n", (1, None))
    _refuse_unless(body, "presence_penalty", (0, 0.0, None))
    _refuse_unless(body, "frequency_penalty", (0, 0.0, None))
    _refuse_unless(body, "logit_bias", ({}, None))
    if not isinstance(body.get("stream", False), bool | None):
        raise RequestError("stream", "must be true or false")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}):
        raise RequestError("stream_options", "must be an object with include_usage")
    job: dict = {"temperature": 1.0}  # OpenAI's default; 0 is greedy
    for name in ("temperature", "top_p", "seed", "stop", *sorted(EXTRAS)):
        if body.get(name) is not None:
            job[name] = body[name]
    return job


def completion_job(body: dict, served_model: str) -> dict:
    job = _common(body, COMPLETION_FIELDS, served_model)
    _refuse_unless(body, "echo", (False, None))
    _refuse_unless(body, "logprobs", (None,))
    _refuse_unless(body, "best_of", (1, None))
    _refuse_unless(body, "suffix", (None,))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        job["prompt"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        job["prompt_token_ids"] = prompt
    else:
        raise RequestError("prompt", "must be a string or a list of token ids (one prompt per request)")
    job["max_new_tokens"] = body.get("max_tokens") if body.get("max_tokens") is not None else 16
    return job


def chat_job(body: dict, served_model: str) -> dict:
    job = _common(body, CHAT_FIELDS, served_model)
    _refuse_unless(body, "logprobs", (False, None))
    _refuse_unless(body, "top_logprobs", (None,))
    _refuse_unless(body, "tools", (None, []))
    _refuse_unless(body, "tool_choice", (None, "none"))
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError("response_format", "only {'type': 'text'} is supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of messages")
    job["messages"] = [_message(i, m) for i, m in enumerate(messages)]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        job["max_new_tokens"] = limit
    return job


def _message(i: int, m: object) -> object:
    """Text content parts are joined; anything else (images, audio) is refused by name."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), list):
        return m  # the job schema checks role and content
    texts = []
    for j, part in enumerate(m["content"]):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"messages[{i}].content[{j}]", "only text parts are supported")
        texts.append(part["text"])
    return {**m, "content": "".join(texts)}


# ----- responses ------------------------------------------------------------------------------------
def usage(result: dict) -> dict:
    u = result.get("usage", {})
    p, c = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_response(job_id: str, model: str, result: dict, *, chat: bool) -> dict:
    finish = FINISH.get(result.get("finish_reason", "stop"), "stop")
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]}, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": result["text"], "finish_reason": finish, "logprobs": None}
    return {
        "id": response_id(job_id, chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(result),
    }


def response_id(job_id: str, chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{job_id}"


class ChunkWriter:
    """Builds the streamed chunks of one response, in OpenAI's format."""

    def __init__(self, job_id: str, model: str, *, chat: bool, resumed: bool = False) -> None:
        self.base = {
            "id": response_id(job_id, chat),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self.chat = chat
        self.started = resumed  # a resumed stream already had its first (role-bearing) chunk

    def delta(self, text: str) -> dict:
        if self.chat:
            delta = {"content": text}
            if not self.started:
                delta = {"role": "assistant", "content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
        self.started = True
        return self.base | {"choices": [choice]}

    def finish(self, result: dict) -> dict:
        reason = FINISH.get(result.get("finish_reason", "stop"), "stop")
        if self.chat:
            choice = {"index": 0, "delta": {} if self.started else {"role": "assistant", "content": ""}}
        else:
            choice = {"index": 0, "text": "", "logprobs": None}
        return self.base | {"choices": [choice | {"finish_reason": reason}]}

    def usage(self, result: dict) -> dict:
        return self.base | {"choices": [], "usage": usage(result)}
