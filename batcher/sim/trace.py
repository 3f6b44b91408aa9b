"""Request traces: ShareGPT-like synthetic lengths, or a JSONL file."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from ..request import DEFAULT_PRIORITY


@dataclass(frozen=True, slots=True)
class TraceRequest:
    input_len: int
    output_len: int  # the true length: the request stops (EOS) after this many tokens
    max_new_tokens: int
    arrival_s: float = 0.0
    # prefix caching: the first prefix_len input tokens are the same for every request of the group
    # (a system prompt); the rest of the input is the request's own
    prefix_group: str = ""
    prefix_len: int = 0
    priority: int = DEFAULT_PRIORITY  # its class, 0-9 (higher admitted first)
    tenant: str = ""  # who sent it (fairness within a class: batcher/fairness.py)


def sharegpt_like(
    n: int = 2000,
    *,
    seed: int = 0,
    max_new_tokens: int = 1024,
    rate: float | None = None,
    max_input: int = 1024,
    max_total: int = 2048,
) -> list[TraceRequest]:
    """Heavy-tailed lengths like ShareGPT (mean ~215 prompt, ~200 output tokens), filtered as vLLM's
    serving benchmark does: prompt >= 4, output >= 4, prompt <= 1024, prompt + output <= 2048.
    Arrivals are Poisson at `rate` requests/s, or all at t=0 when rate is None."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t = 0.0
    while len(out) < n:
        prompt = int(rng.lognormvariate(math.log(140), 1.05))
        output = int(rng.lognormvariate(math.log(105), 1.15))
        if prompt < 4 or output < 4 or prompt > max_input or prompt + output > max_total:
            continue
        if rate:
            t += rng.expovariate(rate)
        out.append(TraceRequest(prompt, output, max_new_tokens, t))
    return out


def mixed_priority(
    n: int = 2000, *, share: float = 0.2, seed: int = 0, rate: float = 6.0, max_new_tokens: int = 1024
) -> list[TraceRequest]:
    """The preset mixed trace: ShareGPT-like lengths arriving at `rate` (the default keeps the default
    budget and cost model busy but not overloaded: past capacity the backlog ages into the top class
    and waits are FIFO again), a `share` of them interactive (priority 9), the rest background work
    (priority 0)."""
    rng = random.Random(seed + 1)
    base = sharegpt_like(n, seed=seed, max_new_tokens=max_new_tokens, rate=rate)
    return [replace(r, priority=9 if rng.random() < share else 0) for r in base]


def two_tenants(
    flood: int = 1000, *, light_rate: float = 1.0, light: int = 60, seed: int = 0, max_new_tokens: int = 1024
) -> list[TraceRequest]:
    """The preset multi-tenant trace: tenant "batch" submits `flood` ShareGPT-like requests at t=0 (a
    10,000-line batch file, scaled), tenant "app" one request every 1/light_rate seconds, all in one class."""
    heavy = sharegpt_like(flood, seed=seed, max_new_tokens=max_new_tokens)
    rng = random.Random(seed + 7)
    lights = sharegpt_like(light, seed=seed + 3, max_new_tokens=max_new_tokens)
    return [replace(r, tenant="batch") for r in heavy] + [
        replace(r, tenant="app", arrival_s=i / light_rate + rng.random() * 0.01) for i, r in enumerate(lights)
    ]


def load_trace(path: str | Path, max_new_tokens: int = 1024) -> list[TraceRequest]:
    """JSONL lines {"input_len": int, "output_len": int} with optional "max_new_tokens", "arrival_s",
    "prefix_group" + "prefix_len" (input tokens shared by the group's requests: prefix caching),
    "priority" (0-9, default 5 as a job's) and "tenant"."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                req = TraceRequest(
                    int(d["input_len"]),
                    int(d["output_len"]),
                    int(d.get("max_new_tokens", max_new_tokens)),
                    float(d.get("arrival_s", 0.0)),
                    str(d.get("prefix_group", "")),
                    int(d.get("prefix_len", 0)),
                    int(d.get("priority", DEFAULT_PRIORITY)),
                    str(d.get("tenant", "")),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad trace line ({e!r}): {line.strip()[:200]}") from e
            if req.input_len < 1 or req.output_len < 1 or req.max_new_tokens < 1 or req.arrival_s < 0:
                raise ValueError(f"{path}:{lineno}: lengths must be >= 1 and arrival_s >= 0")
            if not 0 <= req.prefix_len <= req.input_len:
                raise ValueError(f"{path}:{lineno}: prefix_len must be in [0, input_len]")
            out.append(req)
    out.sort(key=lambda r: r.arrival_s)
    return out
