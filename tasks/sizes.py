"""A whole request's size, checked before any of its jobs is parsed or stored: a request of many
choices (OpenAI's `n`, a list of prompts) is refused by its total, with no work per item."""

from __future__ import annotations

from collections.abc import Mapping

from .limits import MAX_MESSAGES, MAX_REQUEST_PROMPT_UNITS
from .request import JobRequest, RequestError

CHARS_PER_TOKEN = 4  # a prompt's tokens, estimated on the web side (no tokenizer there)
UNBOUNDED_NEW_TOKENS = 512  # what a job that names no max_new_tokens is charged for, in a fair order


def prompt_units(job: Mapping) -> int:
    """The size of a job request's prompt (a JSON object, before it is parsed): characters, token ids,
    or the characters of a chat's messages; what MAX_REQUEST_PROMPT_UNITS counts, with no work per item."""
    for name in ("prompt", "prompt_token_ids"):
        if isinstance(value := job.get(name), str | list | tuple):
            return len(value)
    messages = job.get("messages")
    if not isinstance(messages, list | tuple):
        return 0
    texts = (m.get("content") for m in messages[: MAX_MESSAGES + 1] if isinstance(m, Mapping))  # more: refused
    return sum(len(t) for t in texts if isinstance(t, str))


def check_request_size(jobs: list[Mapping], n: int = 1, field: str = "prompt") -> None:
    """Refuse, before any job is parsed or stored, a request whose choices (each job `n` times) ask
    for more prompt than MAX_REQUEST_PROMPT_UNITS in all (`field`: what the caller's API calls the
    prompt)."""
    total = n * sum(prompt_units(job) for job in jobs)
    if total > MAX_REQUEST_PROMPT_UNITS:
        raise RequestError(
            field,
            f"{len(jobs) * n} choices ask for {total} prompt characters or token ids in all, "
            f"more than {MAX_REQUEST_PROMPT_UNITS} per request",
        )


def job_weight(job: JobRequest) -> int:
    """A job's weight in the batcher's units, estimated without a tokenizer: its prompt's tokens
    (token ids counted, text at CHARS_PER_TOKEN characters a token) plus its new tokens. Fair staging
    charges a tenant this much per job (tasks/queue_scripts.py: STAGE)."""
    if job.prompt_token_ids is not None:
        prompt = len(job.prompt_token_ids)
    elif job.messages is not None:
        prompt = sum(len(m.content) // CHARS_PER_TOKEN + 4 for m in job.messages)
    else:
        prompt = len(job.prompt or "") // CHARS_PER_TOKEN
    new = job.max_new_tokens if job.max_new_tokens is not None else UNBOUNDED_NEW_TOKENS
    return max(1, prompt + 1 + new)
