"""Multi-LoRA throughput: the same requests on the base model alone and spread over 8 adapters mixed
in the same steps, in one run.

    python -m bench.lora --json        # [--requests 64] [--adapters 8] [--rank 16] [--rounds 3]

Workload: bench.engine's (64 requests, prompts 16-256 random token ids, 8-128 new tokens, greedy, EOS
ignored). Adapters: PEFT LoRA of the built-in tiny model, rank --rank on every attention and MLP
projection (B non-zero). Engines (the default compile setting, KV for the whole workload at once):
- base: an engine without adapters (what a deployment without LoRA runs), every request on the base;
- base_lora_engine: the engine with the adapters loaded, every request on the base (the cost of the
  wrapped layers alone);
- mixed: the engine with the adapters, request i on adapter i mod --adapters.
Rounds alternate the three after one untimed round each; output tokens/s are medians. --vllm: the same
figure for vLLM's CPU build (`enable_lora`, eager) on the same model, adapters and requests, in the peer
venv (bench/peer_lora_vllm.py). Reported: each
tok/s, mixed_vs_base (the issue's figure, target >= 0.7) and mixed_vs_base_lora_engine; greedy_equal:
whether each mixed request's tokens equal the same engine's run of that request alone (batching never
changes an adapter's output); the slots allocated, each one's weight and bytes, and the weight they took
from the budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from weightq.batcher import BatcherConfig
from weightq.engine import Engine, EngineConfig
from weightq.engine.model import builtin_path

from .engine import requests, workload

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(root: Path, n: int, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(n):
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_pretrained(builtin_path("tiny"))
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                init_lora_weights=False))  # fmt: skip
        peft.save_pretrained(str(root / f"a{i}"))
        out[f"a{i}"] = str(root / f"a{i}")
    return out


def timed(engine: Engine, reqs) -> tuple[float, list]:
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    took = time.perf_counter() - t0
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    return sum(len(r.token_ids) for r in results) / took, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm", action="store_true", help="also vLLM's CPU build with enable_lora (make peer)")
    args = ap.parse_args()
    work = workload(args.requests, 0)
    weight = sum(len(ids) + n for ids, n in work) + 16 * len(work)
    adapters = make_adapters(Path(tempfile.mkdtemp(prefix="weightq-lora-")), args.adapters, args.rank)
    spec = ",".join(f"{k}={v}" for k, v in adapters.items())
    # vLLM first, while this process holds no engine (started beside two compiled engines, its core
    # process failed to initialise once)
    peer = vllm_side(adapters, work, args.rank, weight, args.rounds) if args.vllm else None
    plain = Engine(EngineConfig(batcher=BatcherConfig(max_batch_weight=weight, max_total_tokens=512)))
    room = BatcherConfig(max_batch_weight=weight + 200 * args.adapters * args.rank, max_total_tokens=512)
    lora = Engine(EngineConfig(lora_modules=spec, batcher=room))
    names = sorted(adapters)
    base_reqs = requests(work, "b")
    mixed_reqs = [replace(r, id=f"m{i}", adapter=names[i % len(names)]) for i, r in enumerate(requests(work))]
    runs = {"base": (plain, base_reqs), "base_lora_engine": (lora, base_reqs), "mixed": (lora, mixed_reqs)}
    for engine, reqs in runs.values():
        timed(engine, reqs)  # warm (compiled shapes, allocator)
    tok_s: dict[str, list[float]] = {k: [] for k in runs}
    mixed_out = None
    for _ in range(args.rounds):
        for key, (engine, reqs) in runs.items():
            rate, results = timed(engine, reqs)
            tok_s[key].append(rate)
            if key == "mixed":
                mixed_out = results
    alone = [lora.generate([replace(r, id=f"s{r.id}")])[0] for r in mixed_reqs[: 2 * len(names)]]
    equal = all(a.token_ids == m.token_ids for a, m in zip(alone, mixed_out, strict=False))
    med = {k: round(statistics.median(v), 1) for k, v in tok_s.items()}
    out = {
        "bench": "lora", "requests": args.requests, "adapters": args.adapters, "rank": args.rank,
        "compiled": lora.runner.compiled, "rounds": args.rounds,
        "tok_s": med, "tok_s_each_round": {k: [round(x, 1) for x in v] for k, v in tok_s.items()},
        "mixed_vs_base": round(med["mixed"] / med["base"], 3),
        "mixed_vs_base_lora_engine": round(med["mixed"] / med["base_lora_engine"], 3),
        "greedy_equal_mixed_vs_alone": equal,
        "slots": lora.batcher.adapters.capacity, "slot_weight": lora.batcher.adapters.slot_weight,
        "slot_bytes": lora.runner.lora.slot_bytes,
        "adapter_weight_taken": plain.batcher.budget + 200 * args.adapters * args.rank - lora.batcher.budget,
    }  # fmt: skip
    if peer is not None:
        out["vllm"] = peer
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


def vllm_side(adapters: dict[str, str], work, rank: int, kv_tokens: int, rounds: int) -> dict:
    """bench/peer_lora_vllm.py in the peer venv on the same model, adapters and requests."""
    python = Path(__file__).resolve().parents[1] / ".venv-peer" / "bin" / "python"
    if not python.exists():
        return {"error": "no peer venv (make peer)"}
    spec = Path(tempfile.mkdtemp(prefix="weightq-lora-vllm-")) / "spec.json"
    model = str(builtin_path("tiny"))
    spec.write_text(json.dumps({"model": model, "adapters": adapters, "work": work, "rank": rank,
                                "kv_tokens": kv_tokens, "rounds": rounds}))  # fmt: skip
    script = Path(__file__).with_name("peer_lora_vllm.py")
    run = subprocess.run([str(python), str(script), str(spec)], capture_output=True, text=True, timeout=3600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or not lines:
        errors = [line for line in run.stderr.splitlines() if "Error" in line or "error" in line]
        return {"error": "\n".join(errors[-12:]) or run.stderr[-1500:]}
    return json.loads(lines[-1])


if __name__ == "__main__":
    main()
