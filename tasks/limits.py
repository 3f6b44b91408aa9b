"""The job contract's one table: every limit a request field is checked against, each front door's
defaults, and the priority scale. The web side and the worker read it from here alone.

What only a worker can check (the prompt's length in tokens against the model's context, the KV
budget, the vocabulary, whether a grammar compiles) is not here: the engine checks it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

# ----- priority: one scale, 0-9 ------------------------------------------------------------------
# A job's class: a higher class is taken from the broker first and admitted by the batcher first
# (arrival order within a class). A job that names none runs at DEFAULT_PRIORITY. Classes below it
# are background work: they may not take the last PRIORITY_HEADROOM of the KV budget while anything
# runs. The batcher keeps the same scale (batcher/request.py, which cannot import this; a test
# checks they agree). On Redis the message priority is the class inverted: broker_priority().
MIN_PRIORITY = 0
MAX_PRIORITY = 9
DEFAULT_PRIORITY = 5
# Offline work (`weightq batch`, OpenAI batch files, a client's submit_many of BULK_JOBS or more jobs)
# runs at this class unless it names one: background, so it fills what interactive work leaves and yields
# to it within a step; above the lowest classes, so a user can still put work beneath it.
BATCH_PRIORITY = 2
BULK_JOBS = 64


# The highest class a gateway caller may ask for (X-Priority) unless KEY_PRIORITIES grants its key
# more: the top classes jump every queue, so they are given, not taken (a setting: OPEN_MAX_PRIORITY).
OPEN_MAX_PRIORITY = 7


def broker_priority(priority: int) -> int:
    """The Celery message priority of a job of class `priority` on Redis, where kombu takes message
    priority 0 first and counts a message without one as 0: every message names it, class 9 as 0."""
    return MAX_PRIORITY - priority


# ----- limits -------------------------------------------------------------------------------------
MAX_PROMPT_CHARS = 1_000_000  # a prompt, or all of a chat's messages together
MAX_MESSAGES = 512
MAX_NEW_TOKENS = 1_000_000  # the contract's bound; a worker's max_total_tokens is the real one
MAX_STOP = 32  # stop strings
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024  # entries
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias|, as OpenAI allows
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows
MAX_GUIDED_CHARS = 65_536  # a schema (as JSON) or a regex
# Nesting of a JSON schema (objects and arrays in its JSON text; a property of an object is two levels):
# xgrammar's compile time grows steeply with it (a few hundred levels take seconds where a few dozen take ms).
MAX_GUIDED_DEPTH = 64
MAX_PROMPT_TOKEN_IDS = 1_000_000  # a prompt given as token ids (a worker's max_input_length is the real bound)
# What one HTTP request may ask for in all: its prompts' characters or token ids summed over its
# choices (prompts x n). Each choice is a job whose request is stored in Redis, written in full before
# a worker can refuse it: the bound caps what one request makes Redis hold.
MAX_REQUEST_PROMPT_UNITS = 4_000_000
# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): dividing float32 logits by 1e-45
# overflows to inf, which samples the least likely token. The engine keeps the same floor.
GREEDY_BELOW = 1e-5
TOKEN_ID_LIMIT = 2**31  # token ids are below this (the vocabulary, checked by the worker, is smaller)
ROLES = ("system", "user", "assistant", "tool")
GUIDED_KINDS = ("json_schema", "json_object", "regex")
ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # a job id chosen by its caller; also a tenant
# Whose job it is: the gateway sets its caller's (an id of its API key, gateway/guard.py); reading,
# resuming and cancelling a job there check it, and the prefix cache is salted by it. Jobs of a
# keyless gateway and of the Python client belong to this one.
LOCAL_TENANT = "local"


@dataclass(frozen=True, slots=True)
class Range:
    """The values a number field takes: [lo, hi], or (lo, hi] when `open_lo`."""

    lo: float
    hi: float
    open_lo: bool = False

    def __contains__(self, v: float) -> bool:
        return (self.lo < v if self.open_lo else self.lo <= v) and v <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.open_lo else '['}{self.lo}, {self.hi}]"


# Integer fields; min_tokens is also at most max_new_tokens.
INTEGERS = {
    "max_new_tokens": Range(1, MAX_NEW_TOKENS),
    "min_tokens": Range(0, MAX_NEW_TOKENS),
    "top_k": Range(0, 1_000_000),  # 0: off
    "seed": Range(0, 2**63 - 1),
    "logprobs": Range(0, MAX_LOGPROBS),
    "prompt_logprobs": Range(0, MAX_LOGPROBS),
    "priority": Range(MIN_PRIORITY, MAX_PRIORITY),
}
# Number fields (integers accepted, kept as floats); every value must also be finite.
NUMBERS = {
    "temperature": Range(0.0, 100.0),  # 0: greedy
    "top_p": Range(0.0, 1.0, open_lo=True),  # 1: off
    "repetition_penalty": Range(0.0, 100.0, open_lo=True),  # 1: off
    "presence_penalty": Range(-2.0, 2.0),  # OpenAI's, over the output so far
    "frequency_penalty": Range(-2.0, 2.0),
}


# ----- defaults per front door --------------------------------------------------------------------
class Door(StrEnum):
    """Where a job enters. Each door keeps the defaults its callers expect of the API they speak."""

    JOB = "job"  # weightq's own: Client.submit, send_task by name, batch files' job lines
    COMPLETIONS = "completions"  # OpenAI's /v1/completions (and its Batch API lines)
    CHAT = "chat"  # OpenAI's /v1/chat/completions (and its Batch API lines)
    TGI = "tgi"  # text-generation-inference's /generate, /generate_stream and /
    CLI = "cli"  # `weightq generate`


@dataclass(frozen=True, slots=True)
class Defaults:
    """What a door fills in for a field its caller left out (every other field has one default,
    JobRequest's). `max_new_tokens` None: until the context limit (the worker's max_total_tokens less
    the prompt's tokens), as OpenAI's chat API and vLLM do."""

    max_new_tokens: int | None
    temperature: float = 0.0


DEFAULTS = {
    # a paragraph: weightq's own default since its first client
    Door.JOB: Defaults(max_new_tokens=64),
    # OpenAI's legacy completions API defaults max_tokens to 16 and temperature to 1
    Door.COMPLETIONS: Defaults(max_new_tokens=16, temperature=1.0),
    # OpenAI's chat API has no max_tokens default: it runs to the context limit (vLLM does the same).
    # Predictive admission reserves the expected length, not the whole context; worst-case mode
    # reserves it all. Its temperature defaults to 1.
    Door.CHAT: Defaults(max_new_tokens=None, temperature=1.0),
    # TGI's max_new_tokens default; TGI is greedy unless asked to sample (tgi_api sets temperature 1 then)
    Door.TGI: Defaults(max_new_tokens=100),
    # a demo in the terminal: a few lines of text per prompt
    Door.CLI: Defaults(max_new_tokens=48),
}
