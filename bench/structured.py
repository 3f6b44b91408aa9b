"""Structured output's cost: the same requests with a bounded JSON schema and without, in one run.

    python -m bench.structured --json

Workload: bench.engine's prompts (16-256 random token ids), greedy, each request constrained by one
of a few bounded JSON schemas (so every output finishes by itself). The plain side runs the same
prompts with `ignore_eos` and max_new_tokens set to the length each constrained output had, so both
sides produce the same number of tokens. Rounds alternate constrained / plain on one in-process
engine; figures are medians. Reported: output tokens/s of each side and their ratio (target >= 0.8),
the outputs that parsed and validated, and grammar compile time (first use of each schema).

n = 8: 32 of the prompts, each sampled 8 times (temperature 1, seeds seed + i, as the gateway fans
`n` out into jobs) on an engine whose prefix cache lets the samples share the prompt's KV blocks, vs
the same 256 requests on an engine with the cache off (8 separate requests per prompt, each
prefilling it); each side starts with an empty cache. Reported per side: prompt tokens prefilled and
output tokens/s (medians), and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

from .engine import workload

BUDGET = 65536
SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                      "ok": {"type": "boolean"}}, "required": ["id", "ok"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
     "required": ["name", "tags"]},
    {"type": "array", "items": {"type": "integer", "minimum": -99, "maximum": 99}, "maxItems": 8},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                      "temp": {"type": "integer", "minimum": -40, "maximum": 50},
                                      "sky": {"enum": ["clear", "cloudy", "rain"]}},
     "required": ["city", "temp", "sky"]},
]  # fmt: skip


def constrained(work, tag: str) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"{tag}{i}",
            prompt_token_ids=ids,
            params=SamplingParams(max_new_tokens=512, guided=("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)]))),
        )
        for i, (ids, _) in enumerate(work)
    ]


def plain(work, lengths: list[int], tag: str) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"{tag}{i}", prompt_token_ids=ids, params=SamplingParams(max_new_tokens=n, ignore_eos=True))
        for i, ((ids, _), n) in enumerate(zip(work, lengths, strict=True))
    ]


def timed(engine: Engine, reqs: list[GenerationRequest]) -> tuple[float, list]:
    engine.reset_prefix_cache()  # every side starts cold: no prompt blocks left from the side before
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    dt = time.perf_counter() - t0
    return sum(r.completion_tokens for r in out) / dt, out


def samples(work, tag: str, n: int = 8) -> list[GenerationRequest]:
    """n samples of each prompt: seeds seed + i (here 1000 k + i), as the gateway fans `n` out."""
    return [
        GenerationRequest(
            f"{tag}{k}-{i}",
            prompt_token_ids=ids,
            params=SamplingParams(max_new_tokens=m, temperature=1.0, seed=1000 * k + i, ignore_eos=True),
        )
        for k, (ids, m) in enumerate(work)
        for i in range(n)
    ]


def n_sharing(shared: Engine, work, rounds: int) -> dict:
    """n = 8 samples of each prompt sharing its blocks vs as separate requests (cache off)."""
    separate = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=BUDGET, prefix_cache=False)))
    timed(separate, samples(work[:2], "warm"))
    side: dict[str, dict[str, list[float]]] = {
        "n8": {"tok_s": [], "prefill": []},
        "separate": {"tok_s": [], "prefill": []},
    }
    for k in range(rounds):
        for name, engine in (("n8", shared), ("separate", separate)):
            before = engine.counters["prefill_tokens"]
            tok_s, _ = timed(engine, samples(work, f"{name}{k}-"))
            side[name]["tok_s"].append(tok_s)
            side[name]["prefill"].append(engine.counters["prefill_tokens"] - before)
    med = {name: {key: statistics.median(v) for key, v in d.items()} for name, d in side.items()}
    return {
        "prompts": len(work),
        "samples_each": 8,
        "n8_prompt_tokens_prefilled": int(med["n8"]["prefill"]),
        "separate_prompt_tokens_prefilled": int(med["separate"]["prefill"]),
        "prefill_ratio": round(med["n8"]["prefill"] / med["separate"]["prefill"], 3),
        "n8_tok_s": round(med["n8"]["tok_s"], 1),
        "separate_tok_s": round(med["separate"]["tok_s"], 1),
        "tok_s_ratio": round(med["n8"]["tok_s"] / med["separate"]["tok_s"], 3),
    }


def valid(results) -> int:
    import jsonschema

    ok = 0
    for i, r in enumerate(results):
        try:
            jsonschema.validate(json.loads(r.text), SCHEMAS[i % len(SCHEMAS)])
            ok += r.reason == "eos"
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = workload(args.n, args.seed)
    engine = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=BUDGET)))
    t0 = time.perf_counter()
    for schema in SCHEMAS:
        engine.grammars.compiled(("json_schema", json.dumps(schema)))
    compile_s = time.perf_counter() - t0
    _, first = timed(engine, constrained(work, "warm-"))  # warm-up; fixes the lengths
    lengths = [max(1, r.completion_tokens) for r in first]
    rows: list[dict] = []
    for k in range(args.rounds):
        guided_tok_s, out = timed(engine, constrained(work, f"g{k}-"))
        plain_tok_s, _ = timed(engine, plain(work, lengths, f"p{k}-"))
        rows.append({"guided_tok_s": guided_tok_s, "plain_tok_s": plain_tok_s, "valid": valid(out)})
    med = {key: statistics.median(r[key] for r in rows) for key in ("guided_tok_s", "plain_tok_s")}
    report = {
        "bench": "structured",
        "requests": args.n,
        "rounds": args.rounds,
        "schemas": len(SCHEMAS),
        "output_tokens": sum(lengths),
        "guided_tok_s": round(med["guided_tok_s"], 1),
        "plain_tok_s": round(med["plain_tok_s"], 1),
        "ratio": round(med["guided_tok_s"] / med["plain_tok_s"], 3),
        "target_ratio": 0.8,
        "valid_outputs": min(r["valid"] for r in rows),
        "compile_s_all_schemas": round(compile_s, 4),
        "n_sharing": n_sharing(engine, work[:32], args.rounds),
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
