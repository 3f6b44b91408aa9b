"""Prefix affinity without a tokenizer: which worker a job should go to, from its prompt's text.

A job's *route key* hashes the start of its prompt (the first `prefix_chars` characters of the text,
of the chat's messages as role and content, or the first `prefix_chars // 4` token ids, about as many
tokens), with its tenant unless the prefix cache is shared (PREFIX_CACHE_SHARED): a tenant's cache
holds only its own prompts, so two tenants' identical prefixes share nothing on a worker. Prompts
that share their first characters are likely to share their first tokens (SGLang's router matches
text prefixes the same way).

The key picks a worker by rendezvous (highest-random-weight) hashing over the live workers: every
client finds the same worker for a key with nothing exchanged, the first job of a prefix as well as
the later ones, and a worker joining or leaving moves only the keys it wins or held (1/N of them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from .request import JobRequest

CHARS_PER_TOKEN = 4  # token ids in the key: about as many tokens as the text key's characters


def route_key(job: JobRequest, prefix_chars: int, shared_cache: bool = False) -> bytes:
    """The bytes that stand for the prompt's prefix (and its tenant unless the cache is shared)."""
    if job.prompt is not None:
        head = "t:" + job.prompt[:prefix_chars]
    elif job.prompt_token_ids is not None:
        head = "i:" + ",".join(map(str, job.prompt_token_ids[: max(1, prefix_chars // CHARS_PER_TOKEN)]))
    else:
        text = "".join(f"<{m.role}>{m.content}" for m in job.messages or ())
        head = "m:" + text[:prefix_chars]
    tenant = "" if shared_cache else job.tenant
    return f"{tenant}\x00{job.adapter}\x00{head}".encode()


def _weight(key: bytes, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + worker.encode(), digest_size=8).digest(), "big")


def rendezvous(key: bytes, workers: Iterable[str]) -> list[str]:
    """The workers in the key's order of preference: the first is the one it goes to."""
    return sorted(workers, key=lambda w: (_weight(key, w), w), reverse=True)
