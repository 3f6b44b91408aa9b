"""The job request: one typed, frozen object, checked field by field when it is built; every refusal is
a RequestError naming the field and its limit (tasks/limits.py holds every limit and each door's
defaults).

A job's request is parsed and checked once where it enters: the Python client, the gateway's routes,
batch files and `weightq generate` call `parse_request` (or build a JobRequest) and pass the typed
object on, never re-checking it. On the wire it is `JobRequest.to_json()`, a JSON object that the
worker's task parses once more, because anyone who can reach Redis may send one by name. Nothing in
it needs the model: what only a worker knows (the prompt in tokens, the vocabulary, the KV budget,
whether a grammar compiles) the engine checks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .fields import Guided, Message, RequestError, check_utf8, field_name, parse_messages
from .limits import (
    DEFAULT_PRIORITY,
    DEFAULTS,
    GREEDY_BELOW,
    ID_PATTERN,
    INTEGERS,
    LOCAL_TENANT,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    NUMBERS,
    TOKEN_ID_LIMIT,
    Door,
)

OPTIONAL = {"seed", "logprobs", "prompt_logprobs", "max_new_tokens"}  # integer fields that may be None


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One generation job. Built from JSON (`parse_request`) or in Python, it accepts what JSON gives
    (lists, objects, a string for `stop`) and keeps tuples, `Message`s and a `Guided`; a value that
    breaks the contract raises RequestError naming the field. Frozen: `dataclasses.replace` makes a
    checked copy (another seed, another priority)."""

    # the prompt: exactly one of
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None  # a chat, rendered with the model's chat template
    # length; None: until the context limit (the worker's max_total_tokens less the prompt's tokens)
    max_new_tokens: int | None = DEFAULTS[Door.JOB].max_new_tokens
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many tokens are out
    # sampling: temperature 0 is greedy; top_k 0 and top_p 1 are off; a seed makes a run reproducible
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by token id
    seed: int | None = None
    # stopping
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # ids that end the job when sampled (finish reason "stop")
    ignore_eos: bool = False
    # outputs
    logprobs: int | None = None  # each token's log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    guided: Guided | None = None  # structured output
    # scheduling and identity
    priority: int = DEFAULT_PRIORITY  # its class on the scale of tasks/limits.py
    request_id: str | None = None  # the job id; None: the client draws one
    tenant: str = LOCAL_TENANT  # whose job it is (the gateway sets its caller's; tasks/limits.py)
    # unix seconds: a job that has not started by then ends with a "deadline" error and never runs late
    # (the client's `expires`, Celery's word, sets it; a submission that cannot start in time is refused)
    deadline: float | None = None
    adapter: str = ""  # the LoRA adapter it runs with (a request's `model` naming one); "": the base model

    def __post_init__(self) -> None:
        self._check_prompt()
        self._check_numbers()
        self._check_logit_bias()
        self._check_stops()
        self._check_guided()
        if self.request_id is not None and (
            not isinstance(self.request_id, str) or not ID_PATTERN.match(self.request_id)
        ):
            raise RequestError("request_id", "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
        if not isinstance(self.adapter, str) or (self.adapter and not ID_PATTERN.match(self.adapter)):
            raise RequestError("adapter", "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
        if not isinstance(self.tenant, str) or not ID_PATTERN.match(self.tenant):
            raise RequestError("tenant", "must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
        if self.deadline is not None:
            d = self.deadline
            if not isinstance(d, int | float) or isinstance(d, bool) or not math.isfinite(d) or d <= 0:
                raise RequestError("deadline", f"must be a time in unix seconds (got {str(d)[:32]})")
            self._set("deadline", float(d))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # normalising a field of the frozen object being built

    def _check_prompt(self) -> None:
        given = [v for v in (self.prompt, self.prompt_token_ids, self.messages) if v is not None]
        if len(given) != 1:
            raise RequestError("prompt", "give exactly one of prompt, prompt_token_ids or messages")
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise RequestError("prompt", f"must be a string (got {type(self.prompt).__name__})")
            if len(self.prompt) > MAX_PROMPT_CHARS:
                raise RequestError("prompt", f"{len(self.prompt)} characters exceeds {MAX_PROMPT_CHARS}")
            check_utf8("prompt", self.prompt)
        if self.prompt_token_ids is not None:
            ids = self.prompt_token_ids
            if not isinstance(ids, list | tuple) or not ids:
                raise RequestError("prompt_token_ids", "must be a non-empty list of integers")
            if len(ids) > MAX_PROMPT_TOKEN_IDS:  # the size first, before any work per id
                raise RequestError("prompt_token_ids", f"{len(ids)} token ids exceeds {MAX_PROMPT_TOKEN_IDS}")
            if not all(_is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in ids):
                raise RequestError("prompt_token_ids", "every entry must be an integer in [0, 2**31)")
            self._set("prompt_token_ids", tuple(ids))
        if self.messages is not None:
            self._set("messages", parse_messages(self.messages))

    def _check_numbers(self) -> None:
        for name, allowed in INTEGERS.items():
            v = getattr(self, name)
            if v is None and name in OPTIONAL:
                continue
            if not _is_int(v):
                raise RequestError(name, f"must be an integer (got {type(v).__name__})")
            if v not in allowed:
                raise RequestError(name, f"must be between {allowed.lo} and {allowed.hi} (got {v})")
        if self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens:
            raise RequestError(
                "min_tokens", f"must be at most max_new_tokens {self.max_new_tokens} (got {self.min_tokens})"
            )
        for name, allowed in NUMBERS.items():
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise RequestError(name, f"must be a number (got {type(v).__name__})")
            x = _float(v)
            if not math.isfinite(x) or x not in allowed:
                raise RequestError(name, f"must be a finite number in {allowed} (got {x})")
            self._set(name, x)
        if self.temperature < GREEDY_BELOW:
            self._set("temperature", 0.0)  # greedy, as vLLM: 1/1e-45 overflows float32 logits
        if not isinstance(self.ignore_eos, bool):
            raise RequestError("ignore_eos", "must be true or false")

    def _check_logit_bias(self) -> None:
        """OpenAI's map of token id (a string in JSON) to a bias in [-100, 100]; kept as pairs by id."""
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        if not isinstance(bias, Mapping | list | tuple) or len(bias) > MAX_LOGIT_BIAS:
            raise RequestError("logit_bias", f"must be an object of at most {MAX_LOGIT_BIAS} token ids to numbers")
        out = []
        for pair in pairs:
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise RequestError("logit_bias", "must be an object of token ids to numbers")
            key, value = pair
            # isdigit() alone admits "²" and other digits int() refuses
            tok = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 else key
            if not _is_int(tok) or not 0 <= tok < TOKEN_ID_LIMIT:
                raise RequestError("logit_bias", f"keys must be token ids (got {str(key)[:32]!r})")
            if not isinstance(value, int | float) or isinstance(value, bool) or not abs(value) <= MAX_LOGIT_BIAS_VALUE:
                raise RequestError("logit_bias", f"values must be numbers in [-100, 100] (got {str(value)[:32]})")
            out.append((tok, float(value)))
        self._set("logit_bias", tuple(sorted(out)))

    def _check_stops(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or len(stop) > MAX_STOP:
            raise RequestError("stop", f"must be a string or a list of at most {MAX_STOP} strings")
        if not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in stop):
            raise RequestError("stop", f"every stop sequence must be a string of 1 to {MAX_STOP_CHARS} characters")
        for s in stop:
            check_utf8("stop", s)
        self._set("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        if not all(_is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in ids):
            raise RequestError("stop_token_ids", "every entry must be an integer in [0, 2**31)")
        self._set("stop_token_ids", tuple(ids))

    def _check_guided(self) -> None:
        if self.guided is None:
            return
        guided = self.guided if isinstance(self.guided, Guided) else Guided.from_json(self.guided)
        guided.check()
        if self.ignore_eos or self.min_tokens:
            raise RequestError("guided", "cannot be combined with ignore_eos or min_tokens (the grammar ends it)")
        self._set("guided", guided)

    def check_room(self, max_total_tokens: int) -> None:
        """Refuse what every worker would refuse without a tokenizer: more new tokens than a serving
        limit of `max_total_tokens` (prompt + output) leaves room for, a prompt being at least one token,
        and a prompt of token ids that leaves no room for one new token."""
        if max_total_tokens and self.max_new_tokens is not None and self.max_new_tokens > max_total_tokens - 1:
            raise RequestError(
                "max_new_tokens",
                f"{self.max_new_tokens} leaves no room for a prompt within max_total_tokens {max_total_tokens} "
                f"(at most {max_total_tokens - 1})",
            )
        if max_total_tokens and self.prompt_token_ids is not None and len(self.prompt_token_ids) >= max_total_tokens:
            raise RequestError(
                "prompt_token_ids",
                f"{len(self.prompt_token_ids)} tokens leave no room for output within max_total_tokens "
                f"{max_total_tokens} (at most {max_total_tokens - 1})",
            )

    def with_seed(self, seed: int) -> JobRequest:
        """This checked request with another seed (sample i of n): only the seed is checked again, so
        n samples of a long prompt cost one prompt check, not n."""
        allowed = INTEGERS["seed"]
        if not _is_int(seed) or seed not in allowed:
            raise RequestError("seed", f"must be an integer in [{allowed.lo}, {allowed.hi}] (got {str(seed)[:32]})")
        copy = object.__new__(JobRequest)
        for f in fields(self):
            object.__setattr__(copy, f.name, seed if f.name == "seed" else getattr(self, f.name))
        return copy

    def to_json(self) -> dict[str, Any]:
        """The request as the task takes it: the fields that differ from their defaults, and always
        max_new_tokens and priority (the door's default travels; the broker and recovery read the class)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v == f.default and f.name not in ("max_new_tokens", "priority"):
                continue
            if f.name == "messages":
                v = [{"role": m.role, "content": m.content} for m in v]
            elif f.name == "logit_bias":
                v = {str(tok): bias for tok, bias in v}
            elif f.name == "guided":
                v = v.to_json()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out


FIELDS = frozenset(f.name for f in fields(JobRequest))


def parse_request(data: object, door: Door = Door.JOB, *, max_total_tokens: int = 0) -> JobRequest:
    """The checked request of a JSON object; raises RequestError naming the first bad field. A null
    field counts as unset, but for max_new_tokens, where null means until the context limit (as vLLM
    reads it; to_json() writes it so); `door` fills in its defaults (tasks/limits.py: DEFAULTS);
    `max_total_tokens`, when known (the gateway reads it from the workers' heartbeats), refuses a
    max_new_tokens that leaves no room for a prompt."""
    if not isinstance(data, Mapping):
        raise RequestError("request", f"must be a JSON object (got {type(data).__name__})")
    unknown = sorted((str(k) for k in data if k not in FIELDS), key=str)
    if unknown:
        raise RequestError(field_name(unknown[0]), f"unknown field; accepted: {', '.join(sorted(FIELDS))}")
    values = {k: v for k, v in data.items() if v is not None or k == "max_new_tokens"}
    defaults = DEFAULTS[door]
    values.setdefault("max_new_tokens", defaults.max_new_tokens)
    values.setdefault("temperature", defaults.temperature)
    job = JobRequest(**values)
    job.check_room(max_total_tokens)
    return job


def _float(v: float) -> float:
    try:
        return float(v)
    except OverflowError:  # an integer of hundreds of digits
        return math.inf


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
