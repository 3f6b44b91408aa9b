"""vLLM's side of bench.peer. It runs in the peer venv (`make peer`) and imports only the standard library,
torch and vllm: the project is not installed there.

    .venv-peer/bin/python bench/peer_vllm.py     # driven by bench.peer, one JSON object a line

Protocol. The first line in is the start message: model (a directory), kv_tokens, block_size, max_num_seqs,
max_model_len, threads and llm (extra `LLM(...)` keyword arguments). The answer: {"ok", "startup_s" (import +
`LLM(...)`, which loads, compiles and allocates the KV cache), "settings"}. Then {"cmd": "run", "work":
[[prompt token ids, max new tokens], ...], "token_ids": bool} answers {"ok", "elapsed_s" (the `LLM.generate`
call alone), "cpu_s" (CPU time of all of vLLM's processes in it), "tokens"[, "token_ids"]}, and
{"cmd": "exit"} ends it. Any failure answers {"ok": false, "error"}.

vLLM logs to stdout, its engine-core process included, so before anything is imported the protocol keeps a
private copy of the original stdout and fd 1 is pointed at stderr (bench.peer sends that to a log file).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from typing import Any


def settings_of(llm: Any, threads: int) -> dict[str, Any]:
    """What the engine actually runs with, read back from its config (and from /proc, for its processes)."""
    import torch
    import vllm

    cfg = llm.llm_engine.vllm_config
    sched, cache, comp = cfg.scheduler_config, cfg.cache_config, cfg.compilation_config
    out: dict[str, Any] = {
        "version": vllm.__version__,
        "torch": torch.__version__,
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "max_model_len": cfg.model_config.max_model_len,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "chunked_prefill": getattr(sched, "enable_chunked_prefill", None),
        "block_size": cache.block_size,
        "num_gpu_blocks": cache.num_gpu_blocks,
        "kv_tokens": (cache.num_gpu_blocks or 0) * cache.block_size,
        "prefix_caching": cache.enable_prefix_caching,
        "gpu_memory_utilization": cache.gpu_memory_utilization,
        "enforce_eager": cfg.model_config.enforce_eager,
        "compilation_mode": getattr(comp.mode, "name", str(comp.mode)),
        "compile_backend": comp.backend,
        "frontend_torch_threads": torch.get_num_threads(),
        "requested_threads": threads,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "KMP_", "MKL_"))},
    }
    out["processes"] = omp_of_descendants()
    return out


def descendants() -> list[int]:
    """Our child processes and theirs (vLLM's engine core and worker), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [os.getpid()]
    while stack:
        found = children.get(stack.pop(), [])
        out += found
        stack += found
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes (all their threads) so far."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def omp_of_descendants() -> list[dict[str, Any]]:
    """OpenMP settings and thread counts of vLLM's processes (engine core, worker), read from /proc: the model
    runs in the worker, which takes OMP_NUM_THREADS from VLLM_CPU_OMP_THREADS_BIND at spawn."""
    out = []
    for pid in descendants():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split("=", 1) for x in f.read().decode(errors="replace").split("\0") if "=" in x)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/status") as f:
                threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        except OSError:
            continue
        omp = {k: env[k] for k in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND") if k in env}
        out.append({"pid": pid, "cmd": cmd[:80], "os_threads": threads, **omp})
    return out


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg) + "\n")

    try:
        start = json.loads(sys.stdin.readline())
        t0 = time.perf_counter()
        import torch

        torch.set_num_threads(start["threads"])
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        # On the CPU backend gpu_memory_utilization is the share of the NUMA node's memory that must be free at
        # start-up, KV override or not: the default 0.92 fails on a shared machine, and the KV size is the override.
        extra = {"gpu_memory_utilization": 0.5, **start.get("llm", {})}
        llm = LLM(
            model=start["model"],
            dtype="float32",
            max_model_len=start["max_model_len"],
            max_num_seqs=start["max_num_seqs"],
            block_size=start["block_size"],
            num_gpu_blocks_override=math.ceil(start["kv_tokens"] / start["block_size"]),
            seed=0,
            **extra,
        )
        startup_s = time.perf_counter() - t0
        send({"ok": True, "startup_s": startup_s, "settings": settings_of(llm, start["threads"])})
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["cmd"] == "exit":
                break
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in msg["work"]]
            extra = {"ignore_eos": True, **msg.get("params", {})}
            params = [SamplingParams(temperature=0.0, max_tokens=n, **extra) for _, n in msg["work"]]
            # The same prompts come back every round: without this vLLM's prefix cache (on by default)
            # would skip their prefill from the second round on.
            llm.reset_prefix_cache()
            pids = [os.getpid(), *descendants()]
            cpu, t = cpu_seconds(pids), time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed, cpu = time.perf_counter() - t, cpu_seconds(pids) - cpu
            ids = [list(o.outputs[0].token_ids) for o in outs]
            reply: dict[str, Any] = {"ok": True, "elapsed_s": elapsed, "cpu_s": cpu, "tokens": sum(map(len, ids))}
            reply["cached_tokens"] = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
            if msg.get("token_ids"):
                reply["token_ids"] = ids
            send(reply)
    except BaseException as e:  # reported to the parent, which decides
        traceback.print_exc()
        send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        sys.exit(1)


if __name__ == "__main__":
    main()
