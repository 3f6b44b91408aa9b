"""The JSON contract of a generation job: what `weightq.generate` accepts, checked field by field.

Every refusal names the field and the limit. Token-level limits (prompt length in tokens, the
KV budget) are checked by the worker's engine, which knows the model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from weightq.engine import SamplingParams
from weightq.engine.grammar import guided_spec
from weightq.engine.params import DEFAULT_PRIORITY, GUIDED_KINDS, MAX_LOGPROBS

MAX_PROMPT_CHARS = 1_000_000
MAX_STOP = 32
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_NEW_TOKENS = 1_000_000
MAX_MESSAGES = 512
MAX_LOGIT_BIAS = 1024  # entries
MAX_GUIDED_CHARS = 65_536  # a schema or regex, as JSON
ROLES = ("system", "user", "assistant", "tool")
ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
FIELDS = {
    "prompt",
    "prompt_token_ids",
    "messages",
    "request_id",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "guided",
    "priority",
}
MAX_PRIORITY = 9


class RequestError(ValueError):
    """A job request that breaks the contract; `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field

    def __reduce__(self):  # survives pickling and Celery's exception round trip
        return (RequestError, (self.field, str(self).split(": ", 1)[-1]))


def field_name(name: str) -> str:
    """How an unknown field is named in an error: as sent, or quoted when it is blank or unprintable."""
    return name if name.strip() and name.isprintable() and len(name) <= 64 else repr(name[:64])


@dataclass(frozen=True, slots=True)
class JobSpec:
    request_id: str | None
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    messages: list[dict[str, str]] | None = None
    priority: int = DEFAULT_PRIORITY


def broker_priority(request: dict) -> int:
    """The Celery message priority of a request's job on Redis, where kombu takes priority 0 first
    and counts a message without one as 0: every message names it, the most urgent class as 0."""
    return MAX_PRIORITY - request.get("priority", DEFAULT_PRIORITY)


def _int(d: dict, name: str, default: int, lo: int, hi: int) -> int:
    v = d.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise RequestError(name, f"must be an integer (got {type(v).__name__})")
    if not lo <= v <= hi:
        raise RequestError(name, f"must be between {lo} and {hi} (got {v})")
    return v


def _float(d: dict, name: str, default: float, lo: float, hi: float, *, open_lo: bool = False) -> float:
    v = d.get(name, default)
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise RequestError(name, f"must be a number (got {type(v).__name__})")
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (open_lo and v == lo):
        bound = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise RequestError(name, f"must be a finite number in {bound} (got {v})")
    return v


def parse_request(data: object) -> JobSpec:
    """Validate a request dict; raises RequestError naming the first bad field."""
    if not isinstance(data, dict):
        raise RequestError("request", f"must be a JSON object (got {type(data).__name__})")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise RequestError(field_name(unknown[0]), f"unknown field; accepted: {', '.join(sorted(FIELDS))}")
    prompt, ids, messages = data.get("prompt"), data.get("prompt_token_ids"), data.get("messages")
    if sum(x is not None for x in (prompt, ids, messages)) != 1:
        raise RequestError("prompt", "give exactly one of prompt, prompt_token_ids or messages")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise RequestError("prompt", f"must be a string (got {type(prompt).__name__})")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError("prompt", f"{len(prompt)} characters exceeds {MAX_PROMPT_CHARS}")
        _utf8("prompt", prompt)
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise RequestError("prompt_token_ids", "must be a non-empty list of integers")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise RequestError("prompt_token_ids", "every entry must be a non-negative integer")
    if messages is not None:
        messages = _messages(messages)
    rid = data.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not ID_PATTERN.match(rid)):
        raise RequestError("request_id", "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    stop = data.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP:
        raise RequestError("stop", f"must be a string or a list of at most {MAX_STOP} strings")
    if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS for s in stop):
        raise RequestError("stop", f"every stop sequence must be a string of 1 to {MAX_STOP_CHARS} characters")
    for s in stop:
        _utf8("stop", s)
    stop_ids = data.get("stop_token_ids", [])
    if not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**31 for t in stop_ids):
        raise RequestError("stop_token_ids", "every entry must be an integer in [0, 2**31)")
    seed = data.get("seed")
    if seed is not None:
        seed = _int(data, "seed", 0, 0, 2**63 - 1)
    ignore_eos = data.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError("ignore_eos", "must be true or false")
    max_new_tokens = _int(data, "max_new_tokens", 64, 1, MAX_NEW_TOKENS)
    logprobs, prompt_logprobs = data.get("logprobs"), data.get("prompt_logprobs")
    if logprobs is not None:
        logprobs = _int(data, "logprobs", 0, 0, MAX_LOGPROBS)
    if prompt_logprobs is not None:
        prompt_logprobs = _int(data, "prompt_logprobs", 0, 0, MAX_LOGPROBS)
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=_float(data, "temperature", 0.0, 0.0, 100.0),
        top_k=_int(data, "top_k", 0, 0, 1_000_000),
        top_p=_float(data, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        repetition_penalty=_float(data, "repetition_penalty", 1.0, 0.0, 100.0, open_lo=True),
        seed=seed,
        stop=tuple(stop),
        ignore_eos=ignore_eos,
        stop_token_ids=tuple(stop_ids),
        presence_penalty=_float(data, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_float(data, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(data.get("logit_bias")),
        min_tokens=_int(data, "min_tokens", 0, 0, max_new_tokens),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        guided=_guided(data.get("guided")),
    )
    if params.guided is not None and (params.ignore_eos or params.min_tokens):
        raise RequestError("guided", "cannot be combined with ignore_eos or min_tokens (the grammar ends it)")
    priority = _int(data, "priority", DEFAULT_PRIORITY, 0, MAX_PRIORITY)
    return JobSpec(rid, prompt, list(ids) if ids is not None else None, params, messages, priority)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a string in JSON) to a bias in [-100, 100]."""
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS} token ids to numbers")
    out = []
    for key, value in bias.items():
        tok = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isdigit() and len(key) <= 10:
            tok = int(key)
        if tok is None or not 0 <= tok < 2**31:
            raise RequestError("logit_bias", f"keys must be token ids (got {str(key)[:32]!r})")
        if not isinstance(value, int | float) or isinstance(value, bool) or not -100 <= value <= 100:
            raise RequestError("logit_bias", f"values must be numbers in [-100, 100] (got {str(value)[:32]})")
        out.append((tok, float(value)))
    return tuple(sorted(out))


def _guided(guided: object) -> tuple[str, str] | None:
    """{"json_schema": schema}, {"json_object": true} or {"regex": pattern}: structured output."""
    if guided is None:
        return None
    if not isinstance(guided, dict) or len(guided) != 1 or next(iter(guided)) not in GUIDED_KINDS:
        raise RequestError("guided", f"must be an object with one of {', '.join(GUIDED_KINDS)}")
    kind, value = next(iter(guided.items()))
    if kind == "json_object" and value is not True:
        raise RequestError("guided", "json_object must be true")
    if kind == "json_schema" and not isinstance(value, dict | str):
        raise RequestError("guided", "json_schema must be a JSON schema (an object, or its JSON text)")
    if kind == "regex" and (not isinstance(value, str) or not value):
        raise RequestError("guided", "regex must be a non-empty string")
    spec = guided_spec(kind, value)
    if len(spec[1]) > MAX_GUIDED_CHARS:
        raise RequestError("guided", f"{len(spec[1])} characters exceeds {MAX_GUIDED_CHARS}")
    if isinstance(value, str):
        _utf8("guided", value)
    return spec


def _utf8(name: str, text: str) -> None:
    """JSON may carry lone surrogates (\\ud800) that no UTF-8 encoder accepts: Redis writes and the
    tokenizer would fail on them later, far from the request. Refuse them here, by field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(name, f"not valid Unicode text (a lone surrogate at character {e.start})") from None


def _messages(messages: object) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise RequestError("messages", f"must be a list of 1 to {MAX_MESSAGES} messages")
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise RequestError(f"messages[{i}]", "must be an object with role and content (and optionally name)")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role", f"must be one of {', '.join(ROLES)} (got {role!r})")
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content", f"must be a string (got {type(content).__name__})")
        _utf8(f"messages[{i}].content", content)
        total += len(content)
        if total > MAX_PROMPT_CHARS:
            raise RequestError("messages", f"more than {MAX_PROMPT_CHARS} characters in all")
        out.append({"role": role, "content": content})
    return out
