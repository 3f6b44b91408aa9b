"""OpenAI's completions and chat completions, mapped onto weightq jobs and back.

A body becomes job requests in the contract's field names (the routes parse them, once, with the
door's defaults: tasks/limits.py); anything OpenAI defines that weightq cannot honour is refused by
name rather than silently ignored.
"""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring_ascii

from weightq.tasks.limits import ID_PATTERN, MAX_LOGPROBS
from weightq.tasks.request import RequestError, field_name

# Accepted and ignored: they change nothing about the generation.
IGNORED = {"user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
# Extensions beyond OpenAI (as vLLM accepts them), passed through to the job.
EXTRAS = {"top_k", "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens"}
PASSED = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias")
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed"} | IGNORED | EXTRAS
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix", "presence_penalty",
                              "frequency_penalty", "logit_bias", "response_format"}  # fmt: skip
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty",
                        "frequency_penalty", "logit_bias", "response_format", "tools", "tool_choice"}  # fmt: skip
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
_MARK = "\x00weightq-text\x00"  # stands for a token's text in a chunk template


# job field -> what a client sent
MAX_CHOICES = 128  # choices per request: prompts x n
CLIENT_FIELDS = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt", "guided": "response_format"}


def _refuse_unless(body: dict, name: str, allowed: tuple) -> None:
    if name in body and body[name] not in allowed:
        raise RequestError(name, f"not supported by weightq (allowed: {', '.join(map(repr, allowed))})")


def _common(body: dict, fields: set[str], served_model: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        ours = CLIENT_FIELDS.get(unknown[0])  # weightq's own name, sent to the OpenAI door
        hint = f" (OpenAI's name for it: {ours})" if ours else ""
        raise RequestError(field_name(unknown[0]), f"unknown field{hint}")
    model = body.get("model")
    # another name is a LoRA adapter of the base model: the workers' heartbeats say which they hold
    # (client: check_servable), and the job runs with it
    if model is not None and model != served_model and (not isinstance(model, str) or not ID_PATTERN.match(model)):
        raise RequestError("model", f"model {str(model)[:64]!r} is not served here (serving {served_model!r})")
    choices(body)
    if not isinstance(body.get("stream", False), bool | None):
        raise RequestError("stream", "must be true or false")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}):
        raise RequestError("stream_options", "must be an object with include_usage")
    job: dict = {}
    for name in (*PASSED, *sorted(EXTRAS)):
        if body.get(name) is not None:
            job[name] = body[name]
    if (guided := _response_format(body.get("response_format"))) is not None:
        job["guided"] = guided
    if model is not None and model != served_model:
        job["adapter"] = model
    return job


def _response_format(fmt: object) -> dict | None:
    """OpenAI's response_format as the job's `guided` (structured output), or None for plain text."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError("response_format", "json_schema must be an object with a `schema` object")
        return {"json_schema": spec["schema"]}
    raise RequestError("response_format", "type must be text, json_object or json_schema")


def completion_job(body: dict, served_model: str) -> dict:
    job = _common(body, COMPLETION_FIELDS, served_model)
    if body.get("logprobs") is not None:
        job["logprobs"] = body["logprobs"]  # the top alternatives per token (the job schema bounds it)
    if body.get("echo") not in (None, False, True):
        raise RequestError("echo", "must be true or false")
    if body.get("echo"):  # the prompt's tokens (their texts, and logprobs when asked) come with the result
        if body.get("stream"):
            raise RequestError("echo", "is answered whole: ask without stream")
        job["prompt_logprobs"] = body.get("logprobs") or 0
    _refuse_unless(body, "best_of", (1, None))
    _refuse_unless(body, "suffix", (None,))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one (completion_jobs splits longer ones)
    if isinstance(prompt, str):
        job["prompt"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        job["prompt_token_ids"] = prompt
    else:
        raise RequestError("prompt", "must be a string, a list of token ids, or a list of those")
    return job | max_tokens(body, "max_tokens")


def echoes(body: dict, prompts: list[str | None]) -> list[str] | None:
    """With `echo: true`, each prompt's text as sent ("" for token ids: the result's tokens give it),
    of the choices' prompts (`n` choices per prompt)."""
    if not body.get("echo"):
        return None
    n = body.get("n") or 1
    return [prompt or "" for prompt in prompts[::n]]


def completion_jobs(body: dict, served_model: str) -> tuple[list[dict], int]:
    """A job per prompt of a list, and `n` (choice index = prompt index x n + i; the gateway makes
    the samples). Counts come first: a list of 300,000 prompts is refused before any is looked at."""
    n = choices(body)
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)
    prompts = prompt if several else [prompt]
    if len(prompts) * n > MAX_CHOICES:
        name = "n" if n > 1 else "prompt"
        raise RequestError(name, f"{len(prompts)} prompts x n={n} exceeds {MAX_CHOICES} choices per request")
    return [completion_job({**body, "prompt": p}, served_model) for p in prompts], n


def chat_jobs(body: dict, served_model: str) -> tuple[list[dict], int]:
    return [chat_job(body, served_model)], choices(body)


def choices(body: object) -> int:
    """A body's `n`: samples per prompt."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise RequestError("n", f"must be an integer between 1 and {MAX_CHOICES} (got {str(n)[:32]})")
    return n


def chat_job(body: dict, served_model: str) -> dict:
    job = _common(body, CHAT_FIELDS, served_model)
    if body.get("logprobs") not in (None, True, False):
        raise RequestError("logprobs", "must be true or false")
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise RequestError("top_logprobs", "needs logprobs: true")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS):
        # checked here, not by the contract: the job's `logprobs` would name the wrong field
        raise RequestError("top_logprobs", f"must be an integer between 0 and {MAX_LOGPROBS} (got {str(top)[:32]})")
    if body.get("logprobs"):
        job["logprobs"] = 0 if top is None else top
    _refuse_unless(body, "tools", (None, []))
    _refuse_unless(body, "tool_choice", (None, "none"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of messages")
    job["messages"] = [_message(i, m) for i, m in enumerate(messages)]
    return job | max_tokens(body, "max_completion_tokens", "max_tokens")


def max_tokens(body: dict, *names: str) -> dict:
    """The job's max_new_tokens from the first of `names` given; an explicit null is until the
    context limit (as vLLM reads it), none at all leaves the door's default."""
    for name in names:
        if body.get(name) is not None:
            return {"max_new_tokens": body[name]}
    return {"max_new_tokens": None} if any(name in body for name in names) else {}


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
def usage(result: dict | list[dict], n: int = 1) -> dict:
    """Summed over the choices; a prompt sampled `n` times counts its tokens once (as vLLM's does), and
    its cached tokens as its first sample found them (the others find the blocks it computed)."""
    results = result if isinstance(result, list) else [result]
    us = [r.get("usage", {}) for r in results]
    p = sum(u.get("prompt_tokens", 0) for u in us[::n])
    c = sum(u.get("completion_tokens", 0) for u in us)
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in us[::n])
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(lps: list[list], offset: int = 0) -> dict:
    """The completions API's shape; each top_logprobs map holds the chosen token too, as OpenAI's does."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, _, top_tokens, top_logprobs in lps:
        out["tokens"].append(token)
        out["token_logprobs"].append(logprob)
        out["text_offset"].append(offset)
        offset += len(token)
        if logprob is None:  # a prompt's first token (echo): nothing predicts it
            out["top_logprobs"].append(None)
            continue
        top: dict[str, float] = {token: logprob}
        for t, v in zip(top_tokens, top_logprobs, strict=True):  # tokens alike in text (e.g. partial
            top[t] = max(v, top.get(t, v))  # characters, "\ufffd") share one key: the likelier wins
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(lps: list[list]) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "surrogatepass"))}

    return {
        "content": [
            entry(token, logprob) | {"top_logprobs": [entry(t, v) for t, v in zip(tops, values, strict=True)]}
            for token, logprob, _, tops, values in lps
        ]
    }


def completion_response(
    job_id: str, model: str, result: dict | list[dict], *, chat: bool, n: int = 1, echo: list[str] | None = None
) -> dict:
    """The body for one result, or for several (choice i is results[i]; `n` choices per prompt).
    `echo`: each prompt's text to put first ("" for a prompt of token ids), with `echo: true`."""
    results = result if isinstance(result, list) else [result]
    return {
        "id": response_id(job_id, chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(i, r, chat, echo[i // n] if echo else None) for i, r in enumerate(results)],
        "usage": usage(results, n),
    }


def _choice(index: int, result: dict, chat: bool, echo: str | None = None) -> dict:
    finish = FINISH.get(result.get("finish_reason", "stop"), "stop")
    lps = result.get("logprobs")
    if chat:
        choice = {"index": index, "message": {"role": "assistant", "content": result["text"]}, "finish_reason": finish}
        choice["logprobs"] = chat_logprobs(lps) if lps is not None else None
        return choice
    text = result["text"]
    if echo is not None:  # the prompt first: as sent, or its tokens' texts for a prompt of token ids
        prompt_lps = result.get("prompt_logprobs", [])
        text = (echo or "".join(lp[0] for lp in prompt_lps)) + text
        lps = prompt_lps + (lps or []) if lps is not None else None
    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    if lps is not None:
        choice["logprobs"] = completion_logprobs(lps)
    return choice


def response_id(job_id: str, chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{job_id}"


class ChunkWriter:
    """Builds the streamed chunks of one response, in OpenAI's format (one or several choices)."""

    def __init__(self, job_id: str, model: str, *, chat: bool, resumed: bool = False) -> None:
        self.base = {
            "id": response_id(job_id, chat),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self.chat = chat
        self.resumed = resumed  # a resumed stream already had its first (role-bearing) chunk
        self.started: set[int] = set()  # choices whose first chunk went out
        self.offsets: dict[int, int] = {}  # text_offset of each choice's next token (completions' logprobs)
        self._templates: dict[int, tuple[str, str]] = {}  # a started choice's text chunk, around its text

    def delta(self, text: str, lp: list | None = None, index: int = 0) -> dict:
        """A chunk of text; with `lp` (a token entry's logprobs), that token's."""
        if self.chat:
            delta = {"content": text}
            if not self._started(index):
                delta = {"role": "assistant", "content": text}
            choice = {"index": index, "delta": delta, "finish_reason": None}
            if lp is not None:
                choice["logprobs"] = chat_logprobs([lp])
        else:
            choice = {"index": index, "text": text, "finish_reason": None, "logprobs": None}
            if lp is not None:
                offset = self.offsets.get(index, 0)
                choice["logprobs"] = completion_logprobs([lp], offset)
                self.offsets[index] = offset + len(lp[0])
        self.started.add(index)
        return self.base | {"choices": [choice]}

    def delta_json(self, text: str, index: int = 0) -> str:
        """delta()'s chunk without logprobs, as compact JSON: once the choice has started, from a template
        around the text (the same bytes json.dumps gives; building and encoding the dict is a large share
        of the gateway's time per streamed token)."""
        tpl = self._templates.get(index)
        if tpl is None:
            if not self._started(index):  # the first chunk differs (chat's role); every later one is alike
                return dumps(self.delta(text, index=index))
            head, mark, tail = dumps(self.delta(_MARK, index=index)).partition(encode_basestring_ascii(_MARK))
            assert mark, "the text's place in a chunk"
            tpl = self._templates[index] = (head, tail)
        return tpl[0] + encode_basestring_ascii(text) + tpl[1]

    def finish(self, result: dict, index: int = 0) -> dict:
        reason = FINISH.get(result.get("finish_reason", "stop"), "stop")
        if self.chat:
            choice = {"index": index, "delta": {} if self._started(index) else {"role": "assistant", "content": ""}}
        else:
            choice = {"index": index, "text": "", "logprobs": None}
        return self.base | {"choices": [choice | {"finish_reason": reason}]}

    def usage(self, result: dict | list[dict], n: int = 1) -> dict:
        return self.base | {"choices": [], "usage": usage(result, n)}

    def _started(self, index: int) -> bool:
        return self.resumed or index in self.started


def dumps(data: dict) -> str:
    """JSON as the streamed chunks carry it: compact, ASCII."""
    return json.dumps(data, separators=(",", ":"))
