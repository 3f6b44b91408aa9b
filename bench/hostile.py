"""What a costly request costs its neighbours, on the built-in tiny model in one run.

    python -m bench.hostile --json

- extras_ratio: what 24 streams asking for every per-row extra the contract allows (32 stop strings
  of 256 characters, a 1,024-entry logit_bias, repetition, frequency and presence penalties,
  min_tokens) cost 8 plain greedy streams beside them, against 24 plain streams of the same lengths:
  the engine's time per step (every stream's time per token), median of the ratios of alternating
  round pairs (issue 31: at most 1.2; 1.9-2.0 before the extras were vectorised), also from the
  step's time outside the forward alone (by_parts) and from the victims' own TPOT.
- grammar_compile_s: xgrammar's compile time of JSON schemas nested to the contract's depth limit
  (MAX_GUIDED_DEPTH) and past it, for the figures in tasks/limits.py.
- grammar_trial_s: a schema that compiles for minutes is refused by the trial process within its
  deadline (engine/sampling/grammar_trial.py), while another request's tokens keep coming.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import replace

from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, serving_threads

VICTIMS, NEIGHBOURS, NEW_TOKENS = 8, 24, 48


def costly_params(rng: random.Random, n: int) -> SamplingParams:
    stops = tuple("".join(rng.choice("qxzj") for _ in range(256)) for _ in range(32))  # never produced
    bias = tuple((i, rng.uniform(-0.5, 0.5)) for i in rng.sample(range(10, 1100), 1024))
    return SamplingParams(
        max_new_tokens=n,
        ignore_eos=True,
        stop=stops,
        logit_bias=tuple(sorted(bias)),
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        min_tokens=n // 2,
    )


def stack(rng: random.Random, costly: bool, tag: str) -> list[GenerationRequest]:
    prompt = lambda: [rng.randrange(10, 1100) for _ in range(rng.randint(32, 128))]  # noqa: E731
    plain = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    victims = [GenerationRequest(f"{tag}v{i}", prompt_token_ids=prompt(), params=plain) for i in range(VICTIMS)]
    others = [
        GenerationRequest(
            f"{tag}n{i}", prompt_token_ids=prompt(), params=costly_params(rng, NEW_TOKENS) if costly else plain
        )
        for i in range(NEIGHBOURS)
    ]
    return victims + others


def tpot_ms(results, prefix: str) -> float:
    mine = [r for r in results if r.request_id.startswith(prefix)]
    return 1000 * statistics.median((r.total_s - r.ttft_s) / max(1, r.completion_tokens - 1) for r in mine)


def extras(engine: Engine, rounds: int, seed: int) -> dict:
    """Both stacks in alternating rounds; each round's figure is the engine's step time per step
    (every stream's time per token: the stacks have the same lengths), and the ratio is the median
    of each round pair's ratio, so a machine that gets busier or quieter between pairs moves both
    sides. The step's time outside the forward (sampling, stops, detokenization: where the extras
    are) is reported apart: `extras_ratio_by_parts` adds its increase to the plain step."""
    rng = random.Random(seed)
    step: dict[str, list[float]] = {"plain": [], "costly": []}
    rest: dict[str, list[float]] = {"plain": [], "costly": []}
    wall: dict[str, list[float]] = {"plain": [], "costly": []}
    for r in range(rounds):
        for kind in ("plain", "costly") if r % 2 == 0 else ("costly", "plain"):
            tag = f"{kind}{r}-"
            before = dict(engine.counters)
            results = engine.generate(stack(rng, kind == "costly", tag))
            assert all(x.reason == "length" for x in results), [x.error for x in results if x.error]
            c = {k: engine.counters[k] - before[k] for k in ("steps", "step_s", "forward_s")}
            step[kind].append(1000 * c["step_s"] / c["steps"])
            rest[kind].append(1000 * (c["step_s"] - c["forward_s"]) / c["steps"])
            wall[kind].append(tpot_ms(results, tag + "v"))
    median = statistics.median
    plain_step, added = median(step["plain"]), median(rest["costly"]) - median(rest["plain"])
    return {
        "extras_ratio": round(median(c / p for c, p in zip(step["costly"], step["plain"], strict=True)), 3),
        "extras_ratio_by_parts": round((plain_step + added) / plain_step, 3),
        "extras_ratio_victims_tpot": round(
            median(c / p for c, p in zip(wall["costly"], wall["plain"], strict=True)), 3
        ),
        "step_ms": {k: _rounded(v) for k, v in step.items()},
        "outside_forward_ms": {k: _rounded(v) for k, v in rest.items()},
        "victim_tpot_ms": {k: _rounded(v) for k, v in wall.items()},
    }


def _rounded(xs: list[float]) -> list[float]:
    return [round(x, 2) for x in xs]


def nested_schema(levels: int) -> str:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


def grammar_compile(engine: Engine) -> dict:
    from weightq.engine.sampling.grammar_spec import xgrammar as _xgr

    xgr = _xgr()
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=engine.logits_width)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {}
    for levels in (16, 32, 64, 128):  # JSON nesting 2 x levels + 1: the contract stops at 64
        t0 = time.perf_counter()
        compiler.compile_json_schema(nested_schema(levels), any_whitespace=False)
        out[f"objects_{levels}"] = round(time.perf_counter() - t0, 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="as a worker: auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = EngineConfig(compile=args.compile, batcher=BatcherConfig(max_batch_weight=16384))
    engine = Engine(replace(config, torch_threads=serving_threads(config)))  # as a worker runs it
    engine.generate(stack(random.Random(1), True, "warm-"))
    result = {"compile": args.compile, **extras(engine, args.rounds, args.seed)}
    result["grammar_compile_s"] = grammar_compile(engine)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
