"""Run a trace through a batcher and a modelled engine, step by step, and measure what users see."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, replace

from ..blocks import chain_keys
from ..config import BatcherConfig
from ..fairness import jain_index
from ..request import Request
from .cost import StepCost
from .policies import POLICIES, make_batcher
from .trace import TraceRequest, mixed_priority, two_tenants


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of unsorted values; 0.0 when empty."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def simulate(
    trace: list[TraceRequest],
    policy: str,
    config: BatcherConfig,
    cost: StepCost | None = None,
    *,
    max_steps: int = 5_000_000,
) -> dict:
    """Simulate one policy; returns its metrics (see `weightq sim --help`)."""
    cost = cost or StepCost()
    batcher = make_batcher(policy, config)
    budget = batcher.budget
    n = len(trace)
    true_len: list[int] = []
    reqs: list[Request] = []
    for i, tr in enumerate(trace):
        out = min(tr.output_len, tr.max_new_tokens)
        true_len.append(out)
        max_new = out if policy == "oracle" else tr.max_new_tokens
        prefix = _prefix_keys(i, tr, config)
        reqs.append(
            Request(str(i), tr.input_len, max_new, tr.arrival_s, priority=tr.priority, prefix=prefix, tenant=tr.tenant)
        )
    order = sorted(range(n), key=lambda i: trace[i].arrival_s)
    first_token = [0.0] * n
    done_at = [0.0] * n
    t = trace[order[0]].arrival_s if n else 0.0
    start = t
    nxt = finished = steps = peak = violations = 0
    while finished < n:
        while nxt < n and trace[order[nxt]].arrival_s <= t:
            batcher.submit(reqs[order[nxt]])
            nxt += 1
        if not batcher.running and not batcher.waiting:
            t = trace[order[nxt]].arrival_s
            continue
        plan = batcher.schedule(t)
        if not plan:
            raise RuntimeError(f"{policy}: nothing runnable with {len(batcher.waiting)} waiting (deadlock)")
        kv = sum(r.prefilled + c for r, c in plan.prefill) + sum(r.context_len for r in plan.decode)
        t += cost(plan.num_tokens, kv)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"{policy}: no progress after {max_steps} steps")
        emitted = batcher.complete(plan)
        weight = batcher.batch_weight()
        peak = max(peak, weight)
        violations += weight > budget
        for r in emitted:
            i = int(r.id)
            if r.generated == 1 and not first_token[i]:
                first_token[i] = t
            if r.generated >= true_len[i]:
                batcher.finish(r.id)
                done_at[i] = t
                finished += 1
    makespan = max(done_at) - start if n else 0.0
    ttft = [first_token[i] - trace[i].arrival_s for i in range(n)]
    tpot = [(done_at[i] - first_token[i]) / (true_len[i] - 1) for i in range(n) if true_len[i] > 1]
    generated = sum(true_len)
    stats = batcher.stats
    return {
        "output_tokens_per_s": round(generated / makespan, 2) if makespan else 0.0,
        "requests_per_s": round(n / makespan, 3) if makespan else 0.0,
        "ttft_p50_s": round(percentile(ttft, 50), 4),
        "ttft_p99_s": round(percentile(ttft, 99), 4),
        "tpot_p50_s": round(percentile(tpot, 50), 5),
        "tpot_p99_s": round(percentile(tpot, 99), 5),
        "peak_weight": peak,
        "budget": budget,
        "overflow_steps": violations,
        "preempted_tokens": stats.preempted_tokens,
        "generated_tokens": generated,
        "steps": steps,
        "makespan_s": round(makespan, 3),
        "preemptions": stats.preemptions,
        "prompt_tokens_computed": stats.prompt_tokens - stats.cached_tokens,
        "cached_tokens": stats.cached_tokens,
        "ttft_by_priority": {
            str(p): {
                "n": len(xs := [ttft[i] for i in range(n) if trace[i].priority == p]),
                "p50_s": round(percentile(xs, 50), 4),
                "p99_s": round(percentile(xs, 99), 4),
            }
            for p in sorted({tr.priority for tr in trace}, reverse=True)
        },
        **_by_tenant(trace, ttft, first_token, done_at, true_len),
    }


def _by_tenant(trace, ttft, first_token, done_at, true_len) -> dict:
    """Per-tenant TTFT and, over the time every tenant had work, Jain's index of each tenant's service
    (output tokens) over its max-min fair share of what was served then (1.0: perfectly fair)."""
    tenants = sorted({tr.tenant for tr in trace})
    if len(tenants) < 2:
        return {}
    n = len(trace)
    end = min(max(done_at[i] for i in range(n) if trace[i].tenant == t) for t in tenants)
    start = min(tr.arrival_s for tr in trace)

    def served(i: int) -> float:  # tokens of request i generated by `end` (evenly between its first and last)
        if first_token[i] > end or not true_len[i]:
            return 0.0
        span = done_at[i] - first_token[i]
        return true_len[i] * (1.0 if done_at[i] <= end or not span else (end - first_token[i]) / span)

    got = {t: sum(served(i) for i in range(n) if trace[i].tenant == t) for t in tenants}
    want = {
        t: float(sum(true_len[i] for i in range(n) if trace[i].tenant == t and trace[i].arrival_s <= end))
        for t in tenants
    }
    fair, left, pool = {}, sorted(tenants, key=want.__getitem__), sum(got.values())
    for k, t in enumerate(left):  # water-filling: the smaller demands are met first
        fair[t] = min(want[t], pool / (len(left) - k))
        pool -= fair[t]
    shares = [got[t] / fair[t] if fair[t] else 1.0 for t in tenants]
    return {
        "ttft_by_tenant": {
            t: {
                "n": len(xs := [ttft[i] for i in range(n) if trace[i].tenant == t]),
                "p50_s": round(percentile(xs, 50), 4),
                "p99_s": round(percentile(xs, 99), 4),
            }
            for t in tenants
        },
        "contended_s": round(end - start, 3),
        "jain_index": round(jain_index(shares), 4),
    }


def simulate_mixed(config: BatcherConfig, cost: StepCost | None = None, *, n: int = 2000, seed: int = 0, **kw) -> dict:
    """The preset mixed trace (trace.mixed_priority: 20% interactive, 80% background) three ways, with
    the weighted batcher: with priorities; the interactive requests alone (no background load); and
    every request in one class (the default one, which the headroom does not hold back). What
    priorities buy interactive requests and what they cost the rest."""
    trace = mixed_priority(n, seed=seed, **kw)
    mixed = simulate(trace, "weighted", config, cost)
    alone = simulate([r for r in trace if r.priority == 9], "weighted", config, cost)
    flat = simulate([replace(r, priority=config.headroom_priority) for r in trace], "weighted", config, cost)
    p99 = mixed["ttft_by_priority"]["9"]["p99_s"]
    return {
        "interactive_ttft_p99_s": p99,
        "interactive_alone_ttft_p99_s": alone["ttft_p99_s"],
        "interactive_ttft_p99_ratio": round(p99 / alone["ttft_p99_s"], 3) if alone["ttft_p99_s"] else None,
        "background_ttft_p99_s": mixed["ttft_by_priority"]["0"]["p99_s"],
        "without_priorities_ttft_p99_s": flat["ttft_p99_s"],
        "tok_s": mixed["output_tokens_per_s"],
        "tok_s_without_priorities": flat["output_tokens_per_s"],
        "throughput_ratio": round(mixed["output_tokens_per_s"] / flat["output_tokens_per_s"], 4),
        "overflow_steps": mixed["overflow_steps"],
        "priority_headroom": config.priority_headroom,
    }


def simulate_tenants(
    config: BatcherConfig, cost: StepCost | None = None, *, flood: int = 1000, light_rate: float = 1.0, seed: int = 0
) -> dict:
    """The preset two-tenant trace (trace.two_tenants: one tenant's batch of `flood` requests at t=0, another
    sending one request a second, one class) three ways with the weighted batcher: fair (tenants share by
    service received), the light tenant alone, and first come, first served. What fairness buys the
    light tenant, what it costs throughput, and Jain's index of the service each got."""
    trace = two_tenants(flood, light_rate=light_rate, seed=seed)
    fair = simulate(trace, "weighted", replace(config, fairness=True), cost)
    alone = simulate([r for r in trace if r.tenant == "app"], "weighted", config, cost)
    fcfs = simulate(trace, "weighted", replace(config, fairness=False), cost)
    light = fair["ttft_by_tenant"]["app"]["p99_s"]
    return {
        "light_ttft_p99_s": light,
        "light_alone_ttft_p99_s": alone["ttft_p99_s"],
        "light_ttft_p99_ratio": round(light / alone["ttft_p99_s"], 3) if alone["ttft_p99_s"] else None,
        "light_ttft_p99_fcfs_s": fcfs["ttft_by_tenant"]["app"]["p99_s"],
        "tok_s": fair["output_tokens_per_s"],
        "tok_s_fcfs": fcfs["output_tokens_per_s"],
        "throughput_ratio": round(fair["output_tokens_per_s"] / fcfs["output_tokens_per_s"], 4),
        "jain_index": fair["jain_index"],
        "jain_index_fcfs": fcfs["jain_index"],
        "overflow_steps": fair["overflow_steps"],
    }


def _prefix_keys(i: int, tr: TraceRequest, config: BatcherConfig) -> tuple[bytes, ...]:
    """Block keys of stand-in token ids: the group's shared prefix, then ids of this request's own."""
    if not (config.prefix_cache and tr.prefix_group and tr.prefix_len):
        return ()
    group = int.from_bytes(hashlib.blake2b(tr.prefix_group.encode(), digest_size=5).digest(), "little")
    ids = [(group << 20) + k for k in range(tr.prefix_len)]
    ids += [-((i << 20) + k) - 1 for k in range(tr.input_len - tr.prefix_len)]
    return chain_keys(ids, config.block_size)


def simulate_policies(
    trace: list[TraceRequest],
    config: BatcherConfig,
    cost: StepCost | None = None,
    policies: tuple[str, ...] = POLICIES,
    trace_info: dict | None = None,
) -> dict:
    """The JSON document of `weightq sim --json`: the trace, the cost model, one entry per policy."""
    cost = cost or StepCost()
    cfg = config.resolved()
    info = dict(trace_info or {})
    info.update(
        requests=len(trace),
        mean_input=round(sum(r.input_len for r in trace) / max(1, len(trace)), 1),
        mean_output=round(sum(min(r.output_len, r.max_new_tokens) for r in trace) / max(1, len(trace)), 1),
        budget=cfg.max_batch_weight,
        max_total_tokens=cfg.max_total_tokens,
        max_prefill_weight=cfg.max_prefill_weight,
        jump_window_s=cfg.jump_window_s,
        max_wait_s=cfg.max_wait_s,
        step_cost=asdict(cost),
    )
    return {"trace": info, "policies": {p: simulate(trace, p, cfg, cost) for p in policies}}
