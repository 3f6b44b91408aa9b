"""The kinds of input line a batch file may hold, which of a line's fields are its request, and the
columns a line carries through to its output.

A user's file has columns besides the request (a `metadata` object, a category, a source), and a data
tool keeps them: every top-level field that is not the request's is copied to the line's output as
it was. A request setting must never end up there instead of in the job, so three kinds of field are
not carried: weightq's own request fields (`FIELDS`), the names other APIs give the same settings
(`ALIASES`: OpenAI's `max_tokens` and `model`, TGI's `do_sample`), each honoured as the gateway's doors
read it or refused naming what to use, and a near miss of either (a typo of `max_new_tokens` must not
run a job with the default length and carry the typo along).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from weightq.tasks.request import FIELDS, JobRequest, RequestError, parse_request


class LineFormat(Protocol):
    """One kind of input line: how to know it, name it, turn it into a job request, and write its outcome."""

    def matches(self, obj: object) -> bool: ...

    def line_id(self, obj: dict, n: int) -> str: ...

    def request(self, obj: dict, priority: int | None) -> JobRequest:
        """The line's job request, parsed (once) with the door's defaults and `priority` for a line
        that names none (None: the contract's default); raises RequestError naming the field."""
        ...

    def done(self, line_id: str, obj: dict, job_id: str, result: dict) -> dict: ...

    def failed(self, line_id: str, obj: dict | None, job_id: str | None, message: str, field: str | None) -> dict: ...


@dataclass(frozen=True, slots=True)
class Alias:
    """Another API's name for a request setting. `to`: weightq's field it sets (with `read` turning
    the value into weightq's, None where it changes nothing); "" for a setting weightq does not have,
    refused unless its value is null or one of `inert` (values that ask for nothing), with `use` saying
    what to write instead."""

    api: str
    to: str = ""
    read: Callable[[Any], Any] | None = lambda v: v
    inert: tuple = ()
    use: str = ""


def _response_format(fmt: object) -> dict | None:
    """OpenAI's response_format as `guided`, as the gateway's OpenAI door reads it."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
    if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        return {"json_schema": spec["schema"]}
    raise RequestError("response_format", "must be {type: text | json_object | json_schema (with a schema)}")


def _grammar(grammar: object) -> dict:
    """TGI's grammar as `guided`, as the gateway's TGI door reads it."""
    kind = grammar.get("type") if isinstance(grammar, dict) else None
    if kind not in ("json", "regex") or "value" not in grammar:
        raise RequestError("grammar", "must be {type: json | regex, value: ...}")
    return {"regex" if kind == "regex" else "json_schema": grammar["value"]}


def _short(value: object) -> str:
    return repr(value)[:32]


def _flag(name: str, when_true: object) -> Callable[[Any], Any]:
    def read(v: object) -> object:
        if not isinstance(v, bool):
            raise RequestError(name, f"must be true or false (got {str(v)[:32]})")
        return when_true if v else None

    return read


ONE_SAMPLE = "a batch line is one sample: write one line per sample (each with a `seed` of its own)"
WHOLE = "a batch line's outcome is written whole, not streamed"
UNSUPPORTED = "not supported by weightq"

# name -> how it is read. The gateway's OpenAI and TGI doors (`openai_api.COMPLETION_FIELDS`,
# `CHAT_FIELDS`, `tgi_api.PARAMETERS`) accept these; a test checks that every name they accept is a
# request field, an alias here, or carried (CARRIED).
ALIASES: dict[str, Alias] = {
    "max_tokens": Alias("OpenAI", "max_new_tokens"),
    "max_completion_tokens": Alias("OpenAI", "max_new_tokens"),
    "model": Alias("OpenAI", "adapter", None),  # the served model or a LoRA adapter: JobLines.model
    "top_logprobs": Alias("OpenAI", "logprobs"),
    "response_format": Alias("OpenAI", "guided", lambda v: None if v is None else _response_format(v)),
    "echo": Alias("OpenAI", "prompt_logprobs", _flag("echo", 0)),
    "n": Alias("OpenAI", inert=(1,), use=ONE_SAMPLE),
    "best_of": Alias("OpenAI and TGI", inert=(1,), use=ONE_SAMPLE),
    "stream": Alias("OpenAI and TGI", inert=(False,), use=WHOLE),
    "stream_options": Alias("OpenAI", use=WHOLE),
    "suffix": Alias("OpenAI", use=UNSUPPORTED),
    "tools": Alias("OpenAI", inert=([],), use="tool calls are " + UNSUPPORTED),
    "tool_choice": Alias("OpenAI", inert=("none",), use="tool calls are " + UNSUPPORTED),
    "parallel_tool_calls": Alias("OpenAI", inert=(False,), use="tool calls are " + UNSUPPORTED),
    "service_tier": Alias("OpenAI", use="use `priority` (0-9; a batch runs at 2 unless a line or --priority says)"),
    "inputs": Alias("TGI", "prompt"),
    "parameters": Alias("TGI", use="give TGI's parameters at the top level of the line (max_new_tokens, seed, ...)"),
    "do_sample": Alias("TGI", "temperature", None),  # JobLines.request: TGI samples at 1.0 unless told
    "top_n_tokens": Alias("TGI", "logprobs"),
    "decoder_input_details": Alias("TGI", "prompt_logprobs", _flag("decoder_input_details", 0)),
    "adapter_id": Alias("TGI", "adapter"),
    "grammar": Alias("TGI", "guided", lambda v: None if v is None else _grammar(v)),
    "typical_p": Alias("TGI", use=UNSUPPORTED),
    "truncate": Alias("TGI", use=UNSUPPORTED),
    "watermark": Alias("TGI", inert=(False,), use=UNSUPPORTED),
    "return_full_text": Alias("TGI", inert=(False,), use="the result holds the generated text only"),
}  # fmt: skip
# Accepted by those doors and changing nothing about a generation: a batch line's columns like any other.
CARRIED = frozenset({"metadata", "user", "store", "details"})
SETTINGS = FIELDS | ALIASES.keys()  # every name a line's request may be given under
# A column one edit away from one of these is refused as a typo. `inputs` is exempt: "input" is a
# common column of evaluation sets.
NEAR_MISSES = SETTINGS - {"inputs"}


def carried(obj: dict | None, known: Collection[str], output: Collection[str], fields: Collection[str] = ()) -> dict:
    """The line's own columns: its top-level fields that are not `known` (the format's), in order.
    Raises RequestError for one that the output writes itself (`output`), that names a request setting
    (the format takes its request elsewhere, as OpenAI's lines in `body`), or that is a near miss of
    one or of `fields`."""
    if obj is None:
        return {}
    extra = {k: v for k, v in obj.items() if k not in known}
    for name in extra:
        if name in output:
            raise RequestError(name, "is a field of the output line; rename the column (it would be lost)")
        if name in SETTINGS:
            raise RequestError(name, "is a request setting, not a column: this line format takes its request elsewhere "
                               "(OpenAI batch lines: in `body`)")  # fmt: skip
        near = difflib.get_close_matches(name, {*fields, *NEAR_MISSES}, n=1, cutoff=0.85)
        if near:
            raise RequestError(name, f"unknown field; did you mean {near[0]!r}? (other columns are carried as is)")
    return extra


def columns(obj: dict | None, known: Collection[str], output: Collection[str], fields: Collection[str] = ()) -> dict:
    """`carried` for an outcome: none when the columns are what the line was refused for."""
    try:
        return carried(obj, known, output, fields)
    except RequestError:
        return {}


class JobLines:
    """weightq's own lines: a job request (its fields, or their names under OpenAI's or TGI's API) with
    an optional "id" and any columns of the user's own; out, {"id", <the columns>, "result"} or {"id",
    <the columns>, "error"}. `served_model`: the name the workers serve, which a line's `model` may
    give for the base model ("": unknown, so every `model` names a LoRA adapter)."""

    OUTPUT = ("id", "result", "error")
    KNOWN = frozenset({*SETTINGS, "id"})

    def __init__(self, served_model: str = "") -> None:
        self.served_model = served_model

    def matches(self, obj: object) -> bool:
        return True

    def line_id(self, obj: dict, n: int) -> str:
        return str(obj.get("id", f"line-{n}"))

    def request(self, obj: dict, priority: int | None) -> JobRequest:
        carried(obj, self.KNOWN, self.OUTPUT)  # refuses a near miss before anything runs
        given = self.given(obj)
        req = {field: value for field, (_, value) in given.items()}
        if priority is not None:
            req.setdefault("priority", priority)
        try:
            return parse_request(req)
        except RequestError as e:  # named as the line names it, as the gateway names a client's field
            name = given.get(e.field, (e.field,))[0]
            if name == e.field:
                raise
            raise RequestError(name, str(e).split(": ", 1)[-1]) from None

    def given(self, obj: dict) -> dict[str, tuple[str, Any]]:
        """The line's request: weightq's field -> (the name the line gives it under, its value in
        weightq's terms). Raises RequestError for a setting weightq does not have, or one given under
        two names with different values."""
        given: dict[str, tuple[str, Any]] = {}  # weightq field -> (the name it was given as, its value)

        def put(field: str, name: str, value: Any) -> None:
            if field in given and given[field][1] != value:
                was, v = given[field]
                raise RequestError(
                    name, f"sets {field}, as {was!r} does, to another value ({_short(value)} vs {_short(v)}): give one"
                )
            given[field] = (name, value)

        for name, value in obj.items():
            if name in FIELDS:
                put(name, name, value)
        for name, value in obj.items():
            alias = ALIASES.get(name)
            if alias is None or (value is None and alias.to != "max_new_tokens"):  # null: unset, as the doors read it
                continue
            if not alias.to:
                if value not in alias.inert:
                    raise RequestError(name, f"{alias.api}'s {name}={str(value)[:32]} cannot be honoured: {alias.use}")
            elif name == "model":
                put("adapter", name, self.model(value))
            elif name == "do_sample":
                if not isinstance(value, bool):
                    raise RequestError(name, f"must be true or false (got {str(value)[:32]})")
                if value and "temperature" not in given:
                    put("temperature", name, 1.0)  # TGI samples at temperature 1 unless told
            elif name == "top_logprobs" and isinstance(obj.get("logprobs"), bool):
                continue  # OpenAI chat's pair, read below
            elif (value := alias.read(value)) is not None or alias.to == "max_new_tokens":
                put(alias.to, name, value)
        self.chat_logprobs(obj, given, put)
        return given

    def model(self, name: object) -> str:
        """The adapter a line's `model` names: "" for the served model; the gateway checks the
        adapters (BatchRun: refused naming what is served)."""
        if not isinstance(name, str):
            raise RequestError("model", f"must be a string (got {type(name).__name__})")
        return "" if name == self.served_model else name

    @staticmethod
    def chat_logprobs(obj: dict, given: dict, put: Callable[[str, str, Any], None]) -> None:
        """OpenAI chat's `logprobs: true` (with `top_logprobs: k` alternatives) as weightq's integer."""
        flag = obj.get("logprobs")
        if not isinstance(flag, bool):
            return
        del given["logprobs"]
        top = obj.get("top_logprobs")
        if not flag and top is not None:
            raise RequestError("top_logprobs", "needs logprobs: true")
        if flag:
            put("logprobs", "logprobs", 0 if top is None else top)

    def done(self, line_id: str, obj: dict, job_id: str, result: dict) -> dict:
        return {"id": line_id, **columns(obj, self.KNOWN, self.OUTPUT), "result": result}

    def failed(self, line_id: str, obj: dict | None, job_id: str | None, message: str, field: str | None) -> dict:
        error = {"message": message, "field": field}
        return {"id": line_id, **columns(obj, self.KNOWN, self.OUTPUT), "error": error}
