"""Hugging Face text-generation-inference's request and response shapes, mapped onto weightq jobs and
back (the routes are tgi_routes.py's)."""

from __future__ import annotations

from tasks.schema import RequestError, field_name

PARAMETERS = {
    "do_sample", "max_new_tokens", "repetition_penalty", "frequency_penalty", "return_full_text", "stop", "seed",
    "temperature", "top_k", "top_p", "truncate", "typical_p", "best_of", "watermark", "details",
    "decoder_input_details", "top_n_tokens", "grammar", "adapter_id",
}  # fmt: skip
FINISH = {"eos": "eos_token", "stop": "stop_sequence", "length": "length", "cancelled": "length"}


CLIENT_FIELDS = {  # job field -> what a client sent
    name: f"parameters.{name}" for name in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
} | {"prompt": "inputs", "repetition_penalty": "parameters.repetition_penalty"}


def _refuse_unless(params: dict, name: str, allowed: tuple) -> None:
    if params.get(name) not in allowed:
        raise RequestError(f"parameters.{name}", f"not supported by weightq (allowed: {', '.join(map(repr, allowed))})")


def job_request(body: object) -> tuple[dict, dict]:
    """(job request, the TGI parameters) of a /generate body."""
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
        ("frequency_penalty", (None, 0, 0.0)),
        ("truncate", (None,)),
        ("typical_p", (None,)),
        ("best_of", (None, 1)),
        ("watermark", (None, False)),
        ("decoder_input_details", (None, False)),
        ("top_n_tokens", (None, 0)),
        ("grammar", (None,)),
        ("adapter_id", (None,)),
    ):
        _refuse_unless(params, name, allowed)
    job: dict = {"prompt": inputs}
    sample = params.get("do_sample") or any(params.get(k) is not None for k in ("temperature", "top_k", "top_p"))
    if sample:
        job["temperature"] = 1.0 if params.get("temperature") is None else params["temperature"]
    for name in ("max_new_tokens", "repetition_penalty", "seed", "top_k", "top_p"):
        if params.get(name) is not None:
            job[name] = params[name]
    if params.get("stop"):
        job["stop"] = params["stop"]
    job.setdefault("max_new_tokens", 100)  # TGI's default
    return job, params


def details(result: dict, tokens: list[dict], seed: int | None) -> dict:
    return {
        "finish_reason": FINISH.get(result.get("finish_reason", "length"), "length"),
        "generated_tokens": result["usage"]["completion_tokens"],
        "seed": seed,
        "prefill": [],
        "tokens": tokens,
    }


def token(fields: dict, special: bool = False) -> dict:
    return {"id": int(fields.get("id", 0)), "text": fields.get("text", ""), "logprob": None, "special": special}
