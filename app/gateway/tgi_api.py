"""Hugging Face text-generation-inference's request and response shapes, mapped onto weightq jobs and
back (the routes are tgi_routes.py's)."""

from __future__ import annotations

import json
import random

from weightq.tasks.limits import MAX_LOGPROBS
from weightq.tasks.request import RequestError, field_name

PARAMETERS = {
    "do_sample", "max_new_tokens", "repetition_penalty", "frequency_penalty", "return_full_text", "stop", "seed",
    "temperature", "top_k", "top_p", "truncate", "typical_p", "best_of", "watermark", "details",
    "decoder_input_details", "top_n_tokens", "grammar", "adapter_id",
}  # fmt: skip
MAX_BEST_OF = 16
FINISH = {"eos": "eos_token", "stop": "stop_sequence", "length": "length", "cancelled": "length"}


CLIENT_FIELDS = {  # job field -> what a client sent
    name: f"parameters.{name}" for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
} | {
    "prompt": "inputs",
    "repetition_penalty": "parameters.repetition_penalty",
    "frequency_penalty": "parameters.frequency_penalty",
    "logprobs": "parameters.top_n_tokens",
    "prompt_logprobs": "parameters.decoder_input_details",
    "guided": "parameters.grammar",
    "adapter": "parameters.adapter_id",
}


def _refuse_unless(params: dict, name: str, allowed: tuple) -> None:
    if params.get(name) not in allowed:
        raise RequestError(f"parameters.{name}", f"not supported by weightq (allowed: {', '.join(map(repr, allowed))})")


def job_request(body: object, stream: bool = False) -> tuple[dict, dict]:
    """(job request in the contract's names, the TGI parameters) of a /generate body; the route parses
    it with TGI's defaults (tasks/limits.py). Token log-probabilities are asked for whenever TGI would
    show them: in details, and in every streamed token."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - {"inputs", "parameters", "stream"})
    if unknown:
        raise RequestError(field_name(unknown[0]), "unknown field")
    inputs = body.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise RequestError("inputs", "must be a non-empty string")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError("parameters", "must be an object")
    unknown = sorted(set(params) - PARAMETERS)
    if unknown:
        raise RequestError(f"parameters.{field_name(unknown[0])}", "unknown parameter")
    for name, allowed in (
        ("truncate", (None,)),
        ("typical_p", (None,)),
        ("watermark", (None, False)),
    ):
        _refuse_unless(params, name, allowed)
    job: dict = {"prompt": inputs}
    sample = params.get("do_sample") or any(params.get(k) is not None for k in ("temperature", "top_k", "top_p"))
    if sample:
        job["temperature"] = 1.0 if params.get("temperature") is None else params["temperature"]
    for name in ("max_new_tokens", "repetition_penalty", "frequency_penalty", "seed", "top_k", "top_p"):
        if params.get(name) is not None:
            job[name] = params[name]
    grammar = params.get("grammar")
    if grammar is not None:  # TGI's {type: json, value: schema} or {type: regex, value: pattern}
        kind = grammar.get("type") if isinstance(grammar, dict) else None
        if kind not in ("json", "regex") or "value" not in grammar:
            raise RequestError("parameters.grammar", "must be {type: json | regex, value: ...}")
        job["guided"] = {"regex" if kind == "regex" else "json_schema": grammar["value"]}
    best_of = params.get("best_of")
    if best_of is not None:
        if not isinstance(best_of, int) or isinstance(best_of, bool) or not 1 <= best_of <= MAX_BEST_OF:
            raise RequestError("parameters.best_of", f"must be an integer between 1 and {MAX_BEST_OF}")
        if best_of > 1 and not sample:
            raise RequestError("parameters.best_of", "needs sampling (do_sample, or a temperature, top_k or top_p)")
        if best_of > 1 and stream:
            raise RequestError("parameters.best_of", "cannot be used with streaming")
        if best_of > 1 and params.get("seed") is not None:  # as TGI: each sample gets a seed of its own
            raise RequestError("parameters.seed", "must not be set when best_of > 1")
    top_n = params.get("top_n_tokens")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or not 0 <= top_n <= MAX_LOGPROBS):
        raise RequestError(
            "parameters.top_n_tokens", f"must be an integer between 0 and {MAX_LOGPROBS} (got {str(top_n)[:32]})"
        )
    if stream or params.get("details") or top_n or (best_of or 1) > 1:  # best_of ranks by logprob
        job["logprobs"] = top_n or 0
    if params.get("decoder_input_details"):  # the prompt's tokens with their logprobs, in details.prefill
        if stream:
            raise RequestError("parameters.decoder_input_details", "is not available when streaming (as in TGI)")
        job["prompt_logprobs"] = 0
    if params.get("stop"):
        job["stop"] = params["stop"]
    if params.get("adapter_id") is not None:  # TGI's multi-LoRA: the adapter's name (README: LoRA)
        job["adapter"] = params["adapter_id"]
    return job, params


def best_of_jobs(job: dict, best_of: int) -> tuple[list[dict], int]:
    """The job and its number of samples (the gateway makes them: sample i draws with seed + i), each
    with a seed of its own (reported in its details) when there are several."""
    if best_of == 1:
        return [job], 1
    return [{**job, "seed": random.getrandbits(62)}], best_of


def details(result: dict, tokens: list[dict], seed: int | None, top: list[list[dict]] | None = None) -> dict:
    prefill = [
        {"id": i, "text": lp[0], "logprob": lp[1]}
        for i, lp in zip(result.get("prompt_token_ids", []), result.get("prompt_logprobs", []), strict=True)
    ]
    out = {
        "finish_reason": FINISH.get(result.get("finish_reason", "length"), "length"),
        "generated_tokens": result["usage"]["completion_tokens"],
        "seed": seed,
        "prefill": prefill,
        "tokens": tokens,
    }
    if top:
        out["top_tokens"] = top
    return out


def token(fields: dict, special: bool = False) -> dict:
    lp = json.loads(fields["lp"]) if "lp" in fields else None
    logprob = lp[1] if lp is not None else None
    return {"id": int(fields.get("id", 0)), "text": fields.get("text", ""), "logprob": logprob, "special": special}


def top_tokens(fields: dict) -> list[dict]:
    """TGI's top_n_tokens alternatives of a token entry, best first."""
    if "lp" not in fields:
        return []
    _, _, ids, texts, values = json.loads(fields["lp"])
    return [{"id": i, "text": t, "logprob": v, "special": False} for i, t, v in zip(ids, texts, values, strict=True)]
