"""weightq's engine against vLLM's CPU build (`LLM.generate`) on the same workload, alternating, in one run.

    make peer                      # once: vLLM's CPU build in .venv-peer (never part of `make test`)
    python -m bench.peer --json    # [--rounds 3] [--cases 64,256,1024,256@4096] [--threads K]
                                   # [--suite all|throughput|pressure] [--pressure-kv 4096,8192]
                                   # [--weightq-config KEY=VALUE ...] [--vllm-config KEY=VALUE ...]

Workload: bench.engine's (prompts of 16-256 random token ids, 8-128 new tokens, greedy, EOS ignored, fixed
seed) on the built-in tiny model, which vLLM loads from the same directory as a plain Llama in float32.
Cases: `N` is N requests with KV capacity for the whole workload, N x (256 + 128) tokens, on both sides;
`N@K` gives both sides K KV tokens (vLLM: block_size 32, num_gpu_blocks_override K/32). vLLM runs in its
default compiled mode (prefix caching on, but reset before every call) with max_num_seqs = the largest N of
the KV setting; each side keeps its default prefill batching; both sides use the same torch thread count
(vLLM's worker gets it through VLLM_CPU_OMP_THREADS_BIND).

Cases with the same KV setting share one weightq Engine (in this process) and one vLLM LLM (a long-lived child
process in the peer venv, see bench/peer_vllm.py), started once and warmed up on 4 requests: the whole-workload
cases get the capacity (and vLLM the max_num_seqs) of the largest of them. Then, per case, each round runs the
workload on one side, then on the other (the order swaps every round; the sides never run at the same time).
- weightq_tok_s / vllm_tok_s: median over rounds of output tokens / wall time of one generate call;
  ratio = weightq / vLLM; rounds: every round's figures; round_s: wall time of one round, both sides.
- cpu_util: per round and side, CPU seconds the side used / wall seconds (all its processes and threads):
  near --threads when it had the cores to itself, lower when other work on the machine took them;
  load_1m: the 1-minute load average as each round began (both sides and everything else).
- kv_settings: per KV setting, its cases and what each side allocated (read back).
- startup_s: per KV setting (in the order of kv_settings) and side, start-up (weightq: Engine(...); vLLM:
  import, load, compile, KV allocation) and the warm-up (the first generate), never counted in tok/s.
- identical: requests whose output token ids are the same on both sides (round 1). A divergence where the
  reference (transformers, fp32) top1-top2 logit gap at the first differing position is < 1e-4, as
  bench.engine counts it, is a match and is listed in near_ties; anything else is listed in mismatches.
- settings: what each side ran with, read back from each engine.
- pressure: the memory-pressure cases (output lengths decided by stop_token_ids, KV capacity fixed, each
  weightq batcher mode against vLLM): see bench/peer_pressure.py for their figures.
Without the peer venv it says how to make it and exits with status 2. A default run took ~10 minutes on 2 idle
cores (vLLM start-up ~1 minute per KV setting; 1,024 requests ~1 minute a round), 35 when they were shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .peer_client import DEFAULT_PEER, PEER_ENV, PeerError, VllmPeer, omp_bind, peer_problem, peer_python

REPO = Path(__file__).resolve().parent.parent
PEER_BLOCK = 32  # vLLM's CPU attention wants multiples of 32
MAX_MODEL_LEN = 2048
WARMUP = 4  # requests of the first case, once per side and KV setting
# Pause between the sides: vLLM's worker and scheduler busy-poll their queues for 1 s after their last message
# (shm_broadcast's SpinCondition) and OpenMP teams spin briefly after a parallel region; neither may eat into
# the other side's timed call.
SETTLE_S = 1.5


# ----- pure helpers (tested without torch or vLLM) ------------------------------------------------------------
def parse_cases(spec: str) -> list[tuple[int, int | None]]:
    """`64,256@4096` -> [(64, None), (256, 4096)]: None means KV for the whole workload."""
    cases: list[tuple[int, int | None]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        n, _, kv = item.partition("@")
        cases.append((int(n), int(kv) if kv else None))
    if not cases or any(n < 1 for n, _ in cases):
        raise ValueError(f"bad --cases {spec!r}: want e.g. 64,256,1024,256@4096")
    if any(kv is not None and kv < MAX_MODEL_LEN for _, kv in cases):
        raise ValueError(f"bad --cases {spec!r}: vLLM wants KV for one request of {MAX_MODEL_LEN} tokens at least")
    return cases


def whole_workload_kv(n: int) -> int:
    """KV tokens that hold every request at once, whatever its lengths (as bench.engine sizes it); vLLM also
    wants room for one request of max_model_len."""
    return max(n * (256 + 128), MAX_MODEL_LEN)


def weightq_config(kv_tokens: int, overrides: dict[str, Any]):
    """weightq's EngineConfig at `kv_tokens` with --weightq-config's overrides, each given to the config
    that declares it (the batcher's options to `EngineConfig.batcher`)."""
    from weightq.batcher import BatcherConfig
    from weightq.engine import EngineConfig

    names = {f.name for f in dataclasses.fields(BatcherConfig)}
    batcher = {k: v for k, v in overrides.items() if k in names}
    engine = {k: v for k, v in overrides.items() if k not in names}
    return EngineConfig(**engine, batcher=BatcherConfig(**{"max_batch_weight": kv_tokens, **batcher}))


def weightq_fields() -> set[str]:
    """The option names --weightq-config takes: EngineConfig's own and its BatcherConfig's."""
    from weightq.batcher import BatcherConfig
    from weightq.engine import EngineConfig

    return {f.name for c in (EngineConfig, BatcherConfig) for f in dataclasses.fields(c)} - {"batcher"}


def parse_overrides(items: list[str], allowed: set[str] | None = None) -> dict[str, Any]:
    """KEY=VALUE strings -> dict; values are JSON when they parse (1024, 0.5, true, null), else strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad option {item!r}: want KEY=VALUE")
        if allowed is not None and key not in allowed:
            raise ValueError(f"unknown key {key!r}; known: {', '.join(sorted(allowed))}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def medians(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """Median tok/s of each side and their ratio (weightq / vLLM)."""
    a, b = statistics.median(ours), statistics.median(theirs)
    return a, b, (a / b if b else float("inf"))


def tally(n: int, divergences: list[tuple[int, int, float]], near_tie: float) -> dict[str, Any]:
    """divergences: (request, first differing token, reference top1-top2 gap there)."""
    ties = [d for d in divergences if d[2] < near_tie]
    bad = [d for d in divergences if d[2] >= near_tie]
    return {
        "identical": f"{n - len(bad)}/{n}",
        "near_ties": [f"request {i} token {k}: gap {g:.1e}" for i, k, g in ties],
        "mismatches": [f"request {i} token {k}: gap {g:.1e}" for i, k, g in bad],
    }


# ----- weightq, in this process ----------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    t = os.times()
    return t.user + t.system


def run_weightq(engine, work, tag: str) -> tuple[float, float, float, list[list[int]]]:
    """(tok/s, seconds, CPU seconds, output ids) of one generate() over the workload."""
    from .engine import requests

    reqs = requests(work, tag)
    cpu, t0 = cpu_seconds(), time.perf_counter()
    results = engine.generate(reqs)
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - cpu
    return sum(r.completion_tokens for r in results) / dt, dt, cpu, [list(r.token_ids) for r in results]


def reference_gaps(model_dir: Path, work, outputs: list[list[int]], diverged: list[tuple[int, int]]) -> list[float]:
    """Top1-top2 logit gap of the reference model after prompt + the common prefix, per (request, token)."""
    if not diverged:
        return []
    import torch
    from transformers import AutoModelForCausalLM
    from weightq.engine.builder import on_fresh_thread  # keeps the model's OpenMP team off the main thread

    def gaps() -> list[float]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
        out = []
        for i, k in diverged:
            with torch.no_grad():
                top = model(torch.tensor([work[i][0] + outputs[i][:k]])).logits[0, -1].topk(2).values
            out.append(float(top[0] - top[1]))
        return out

    return on_fresh_thread(gaps)


def kv_groups(cases: list[tuple[int, int | None]]) -> list[tuple[int, list[int]]]:
    """Cases that share a KV setting, as (kv tokens, request counts) in the order first seen: whole-workload
    cases share the largest one's capacity, which holds each of them whole."""
    groups: dict[int | None, list[int]] = {}
    for n, kv in cases:
        groups.setdefault(kv, []).append(n)
    return [(kv or whole_workload_kv(max(ns)), ns) for kv, ns in groups.items()]


def run_group(args, kv_tokens: int, sizes: list[int], python: Path, env: dict[str, str], wq_overrides: dict[str, Any]):
    """Start both sides once for this KV setting, then alternate rounds per case."""
    from weightq.engine import Engine
    from weightq.engine.model import builtin_path

    from .engine import NEAR_TIE, workload

    model_dir = builtin_path("tiny")

    def log(msg: str) -> None:
        print(f"[bench.peer] {kv_tokens} KV tokens: {msg}", file=sys.stderr, flush=True)

    warm = workload(sizes[0], args.seed)[:WARMUP]
    t0 = time.perf_counter()
    engine = Engine(weightq_config(kv_tokens, wq_overrides))
    wq_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_weightq(engine, warm, "warm")
    wq_warm = time.perf_counter() - t0
    log(f"weightq up in {wq_start:.1f}s + {wq_warm:.1f}s warm-up; starting vLLM")
    start = {
        "model": str(model_dir),
        "kv_tokens": kv_tokens,
        "block_size": PEER_BLOCK,
        "max_num_seqs": max(sizes),
        "max_model_len": MAX_MODEL_LEN,
        "threads": args.threads,
        "llm": parse_overrides(args.vllm_config),
    }
    cases = []
    peer = VllmPeer(python, start, env, args.peer_log)
    try:
        hello = peer.hello
        vllm_warm = peer.run(warm)["elapsed_s"]
        log(f"vLLM up in {hello['startup_s']:.1f}s + {vllm_warm:.1f}s warm-up")
        startup = {"weightq": wq_start, "weightq_warmup": wq_warm, "vllm": hello["startup_s"], "vllm_warmup": vllm_warm}
        kv_setting = {
            "kv_tokens": kv_tokens,
            "requests": sizes,
            "weightq_kv_tokens": engine.runner.memory()["kv_blocks_total"] * engine.runner.memory()["block_size"],
            "vllm_kv_tokens": hello["settings"]["kv_tokens"],
            "vllm_max_num_seqs": hello["settings"]["max_num_seqs"],
        }
        wq_settings = {
            "config": dataclasses.asdict(engine.config),
            "attention": engine.backend,
            "runner": engine.lm.runner,
            "block_size": engine.runner.memory().get("block_size"),
            "torch_threads": torch_threads(),
        }
        for n in sizes:
            work = workload(n, args.seed)
            ours: list[float] = []
            theirs: list[float] = []
            util: dict[str, list[float]] = {"weightq": [], "vllm": []}
            round_s: list[float] = []
            load: list[float] = []
            our_ids: list[list[int]] = []
            their_ids: list[list[int]] = []
            for r in range(args.rounds):
                t_round = time.perf_counter()
                load.append(os.getloadavg()[0])
                for side in ("weightq", "vllm") if r % 2 == 0 else ("vllm", "weightq"):
                    time.sleep(SETTLE_S)
                    if side == "weightq":
                        tok_s, dt, cpu, ids = run_weightq(engine, work, f"{n}r{r}-")
                        ours.append(tok_s)
                        util["weightq"].append(cpu / dt)
                        our_ids = our_ids or ids
                    else:
                        reply = peer.run(work, token_ids=r == 0)
                        theirs.append(reply["tokens"] / reply["elapsed_s"])
                        util["vllm"].append(reply["cpu_s"] / reply["elapsed_s"])
                        their_ids = their_ids or reply["token_ids"]
                round_s.append(time.perf_counter() - t_round)
                log(
                    f"{n} requests, round {r + 1}: weightq {ours[-1]:.0f} tok/s, vLLM {theirs[-1]:.0f} tok/s "
                    f"({round_s[-1]:.0f}s)"
                )
            diverged = [(i, k) for i in range(n) if (k := first_divergence(our_ids[i], their_ids[i])) is not None]
            gaps = reference_gaps(model_dir, work, our_ids, diverged)
            a, b, ratio = medians(ours, theirs)
            cases.append(
                {
                    "requests": n,
                    "kv_tokens": kv_tokens,
                    "output_tokens": sum(m for _, m in work),
                    "weightq_tok_s": round(a, 1),
                    "vllm_tok_s": round(b, 1),
                    "ratio": round(ratio, 3),
                    "rounds": {"weightq": [round(x, 1) for x in ours], "vllm": [round(x, 1) for x in theirs]},
                    "round_s": [round(x, 1) for x in round_s],
                    "cpu_util": {side: [round(x, 2) for x in xs] for side, xs in util.items()},
                    "load_1m": [round(x, 1) for x in load],
                    **tally(n, [(i, k, g) for (i, k), g in zip(diverged, gaps, strict=True)], NEAR_TIE),
                }
            )
    finally:
        peer.close()
        del engine
    return cases, kv_setting, startup, wq_settings, hello["settings"]


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    ap = argparse.ArgumentParser(description="weightq's engine against vLLM's CPU build, same workload, alternating")
    ap.add_argument("--json", action="store_true", help="one line of JSON (else indented)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="64,256,1024,256@4096", help="N (KV for the whole workload) or N@KV_TOKENS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--suite",
        choices=("all", "throughput", "pressure"),
        default="all",
        help="throughput: --cases; pressure: the memory-pressure cases (bench/peer_pressure.py)",
    )
    ap.add_argument("--pressure-kv", default="4096,8192", help="KV capacities (tokens) of the pressure cases")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: torch's default here)")
    ap.add_argument(
        "--weightq-config", nargs="*", default=[], metavar="KEY=VALUE", help="EngineConfig and BatcherConfig fields"
    )
    ap.add_argument("--vllm-config", nargs="*", default=[], metavar="KEY=VALUE", help="extra LLM(...) arguments")
    ap.add_argument("--vllm-bind", help="VLLM_CPU_OMP_THREADS_BIND (default: the first --threads usable CPUs)")
    ap.add_argument("--peer-python", help=f"the peer venv's python (default: ${PEER_ENV} or {DEFAULT_PEER})")
    ap.add_argument("--peer-log", type=Path, default=Path(tempfile.gettempdir()) / "weightq-bench-peer-vllm.log")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the vLLM child is told to exit
    python = peer_python(args.peer_python)
    if problem := peer_problem(python):
        print(
            f"bench.peer: {problem}. Make vLLM's CPU build with `make peer` (it goes into .venv-peer), "
            f"or point --peer-python / ${PEER_ENV} at a python that has vllm.",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        cases = parse_cases(args.cases)
        parse_overrides(args.vllm_config)
    except ValueError as e:
        ap.error(str(e))
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        pressure_kv = [int(k) for k in args.pressure_kv.split(",") if k.strip()]
    except ValueError:
        ap.error(f"--pressure-kv: a comma-separated list of token counts (got {args.pressure_kv!r})")

    import torch

    try:
        wq_overrides = parse_overrides(args.weightq_config, weightq_fields())
    except ValueError as e:
        ap.error(f"--weightq-config: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": args.vllm_bind or omp_bind(args.threads)}
    env.pop("PYTHONPATH", None)

    from .peer_pressure import MAX_TOKENS, REQUESTS, STOP_TOKEN_IDS, run_pressure

    out: dict[str, Any] = {"settings": {}, "cases": [], "kv_settings": [], "startup_s": {}, "pressure": []}
    settings: dict[str, Any] = {}
    try:
        for kv_tokens, sizes in kv_groups(cases) if args.suite != "pressure" else []:
            group, kv_setting, startup, wq_settings, vllm_settings = run_group(
                args, kv_tokens, sizes, python, env, wq_overrides
            )
            out["cases"] += group
            out["kv_settings"].append(kv_setting)
            for side, seconds in startup.items():  # one figure per KV setting, in the order of kv_settings
                out["startup_s"].setdefault(side, []).append(round(seconds, 2))
            settings = {"weightq": wq_settings, "vllm": vllm_settings}
        for kv_tokens in pressure_kv if args.suite != "throughput" else []:
            out["pressure"].append(run_pressure(args, kv_tokens, python, env, wq_overrides))
    except PeerError as e:
        print(f"bench.peer: {e}\nIf vllm is missing from the peer venv, run `make peer`.", file=sys.stderr)
        sys.exit(2)
    if settings:
        settings["weightq"]["config"].pop("max_batch_weight")  # per KV setting: see kv_tokens
        for key in ("max_num_seqs", "num_gpu_blocks", "kv_tokens"):
            settings["vllm"].pop(key, None)  # per KV setting: see kv_settings
    out["settings"] = {
        **settings,
        "torch_threads": args.threads,
        "rounds": args.rounds,
        "seed": args.seed,
        "workload": {"prompt_tokens": "16-256", "new_tokens": "8-128", "greedy": True, "ignore_eos": True},
        "pressure_workload": {
            "requests": REQUESTS,
            "prompt_tokens": "16-256",
            "max_tokens": MAX_TOKENS,
            "stop_token_ids": list(STOP_TOKEN_IDS),
            "greedy": True,
            "ignore_eos": True,
            "kv_tokens": pressure_kv,
        },
        "settle_s": SETTLE_S,
        "peer_log": str(args.peer_log),
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
