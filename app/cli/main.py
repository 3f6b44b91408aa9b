"""The `weightq` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from typing import TYPE_CHECKING

from weightq.batcher import BatcherConfig, ConfigError
from weightq.batcher.config import PRIORITY_HEADROOM
from weightq.batcher.sim import (
    POLICIES,
    StepCost,
    load_trace,
    sharegpt_like,
    simulate_mixed,
    simulate_policies,
    simulate_tenants,
)
from weightq.tasks.limits import DEFAULTS, Door

from .batch_cmd import batch_parser
from .compose import compose_parser
from .redis_server import redis_for, redis_parser
from .stack import require_worker_extra, stack_parsers

if TYPE_CHECKING:
    from fastapi import FastAPI
    from weightq.settings import Settings

TABLE_COLUMNS = (
    ("output_tokens_per_s", "out tok/s"),
    ("requests_per_s", "req/s"),
    ("ttft_p50_s", "TTFT p50"),
    ("ttft_p99_s", "TTFT p99"),
    ("tpot_p50_s", "TPOT p50"),
    ("tpot_p99_s", "TPOT p99"),
    ("peak_weight", "peak"),
    ("overflow_steps", "overflow"),
    ("preempted_tokens", "preempted"),
)


def _sim_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate admission policies on a trace at one KV budget",
        description="Discrete-event simulation of an engine step by step under each admission policy "
        "(static, tgi, optimistic, weighted, predictive, oracle), all at the same KV budget.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--requests", type=int, default=2000, help="synthetic trace size (default 2000)")
    p.add_argument("--budget", type=int, default=16384, help="max_batch_weight in tokens (default 16384)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="asked by every request (default 1024)")
    p.add_argument("--max-total-tokens", type=int, default=2048, help="longest input + max_new (default 2048)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at t=0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, help='JSONL: {"input_len", "output_len"[, "max_new_tokens", "arrival_s"]}')
    p.add_argument("--max-prefill-weight", type=int, default=4096, help="prompt tokens per step, 0 = off")
    p.add_argument("--block-size", type=int, default=1, help="KV block size of the token weight model")
    p.add_argument(
        "--prefix-cache", action="store_true", help="reuse the KV of trace prefix groups (prefix_group, prefix_len)"
    )
    p.add_argument(
        "--priority-headroom",
        type=float,
        default=PRIORITY_HEADROOM,
        help="share of the budget classes below 5 may not take (default: the engine's)",
    )
    p.add_argument(
        "--preset",
        choices=["mixed", "tenants"],
        default=None,
        help="mixed: 20%% interactive (priority 9) and 80%% background (0) at --rate (default 6/s), "
        "with priorities, interactive alone, and one class; prints interactive TTFT p99 and throughput ratios. "
        "tenants: one tenant's batch of --requests (default 1000 here) at t=0 and another's request a second, "
        "one class: fair sharing, the light tenant alone and first come first served; its TTFT, throughput, "
        "Jain's fairness index",
    )
    p.add_argument("--tenant-cap", type=float, default=0.0, help="share of the budget one tenant may hold (0: off)")
    p.add_argument("--jump-window", type=float, default=1.0, help="seconds a later request may jump (0 = FIFO)")
    p.add_argument("--max-wait", type=float, default=30.0, help="seconds after which nothing jumps a request")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of the policies")
    p.add_argument(
        "--step-cost",
        type=StepCost.parse,
        default=StepCost(),
        help="'fixed,per_token,per_kv_token' seconds (default '0.008,6e-5,3e-7', ~7B on an A100)",
    )
    p.set_defaults(func=cmd_sim)


def cmd_sim(args: argparse.Namespace) -> int:
    policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        raise SystemExit(f"weightq sim: unknown policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    cfg = BatcherConfig(
        max_batch_weight=args.budget,
        max_total_tokens=args.max_total_tokens,
        max_prefill_weight=args.max_prefill_weight,
        block_size=args.block_size,
        jump_window_s=args.jump_window,
        max_wait_s=args.max_wait,
        prefix_cache=args.prefix_cache,
        priority_headroom=args.priority_headroom,
        tenant_cap=args.tenant_cap,
    )
    try:
        cfg = cfg.resolved()
    except ConfigError as e:
        raise SystemExit(f"weightq sim: {e}") from e
    if args.preset == "mixed":
        kw = {"rate": args.rate} if args.rate else {}
        mixed = simulate_mixed(cfg, args.step_cost, n=args.requests, seed=args.seed, **kw)
        print(json.dumps(mixed, indent=None if args.json else 2))
        return 0
    if args.preset == "tenants":
        flood = args.requests if args.requests != 2000 else 1000
        out = simulate_tenants(cfg, args.step_cost, flood=flood, light_rate=args.rate or 1.0, seed=args.seed)
        print(json.dumps(out, indent=None if args.json else 2))
        return 0
    if args.trace:
        trace = load_trace(args.trace, args.max_new_tokens)
        info = {"source": args.trace}
    else:
        trace = sharegpt_like(args.requests, seed=args.seed, max_new_tokens=args.max_new_tokens, rate=args.rate)
        info = {
            "source": "sharegpt_like",
            "seed": args.seed,
            "arrival_rate": args.rate,
            "max_new_tokens": args.max_new_tokens,
        }
    too_long = [i for i, r in enumerate(trace) if r.input_len + r.max_new_tokens > cfg.max_total_tokens]
    if too_long:
        raise SystemExit(
            f"weightq sim: {len(too_long)} trace requests exceed max_total_tokens {cfg.max_total_tokens} "
            f"(first: line {too_long[0] + 1}); raise --max-total-tokens"
        )
    result = simulate_policies(trace, cfg, args.step_cost, policies, info)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0


def format_table(result: dict) -> str:
    t = result["trace"]
    lines = [
        f"{t['requests']} requests (mean input {t['mean_input']}, mean output {t['mean_output']}), "
        f"budget {t['budget']} tokens, max_total_tokens {t['max_total_tokens']}",
        "",
        f"{'policy':<11}" + "".join(f"{label:>11}" for _, label in TABLE_COLUMNS),
    ]
    for name, m in result["policies"].items():
        lines.append(f"{name:<11}" + "".join(f"{m[key]:>11}" for key, _ in TABLE_COLUMNS))
    return "\n".join(lines)


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="run prompts through the engine in this process and stream the text",
        description="Load MODEL into the continuous-batching engine and generate, streaming tokens to the terminal.",
    )
    p.add_argument("prompts", nargs="*", default=["The scheduler admits"], help="prompts (default: one demo prompt)")
    p.add_argument("--model", default="builtin:tiny", help="builtin:tiny, a local directory, or a cached hub id")
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"default {DEFAULTS[Door.CLI].max_new_tokens}")
    p.add_argument("--temperature", type=float, default=None, help="default 0: greedy")
    p.add_argument("--top-p", type=float, default=None, help="default 1: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-batch-weight", type=int, default=0, help="KV capacity in tokens (default 0: from memory)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from weightq.tasks.request import RequestError, parse_request

    given = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p}
    asked = {k: v for k, v in given.items() if v is not None}  # unset: the door's defaults
    try:  # checked as any job is, before the model loads
        jobs = [parse_request({"prompt": p, "seed": args.seed, **asked}, Door.CLI) for p in args.prompts]
    except RequestError as e:
        raise SystemExit(f"weightq generate: {e}") from None
    require_worker_extra("generate")
    from weightq.engine import Engine, EngineConfig, FinishEvent
    from weightq.worker.to_engine import engine_request

    batcher = BatcherConfig(max_batch_weight=args.max_batch_weight)
    engine = Engine(EngineConfig(model=args.model, device=args.device, batcher=batcher))
    engine.start()
    try:
        handles = [engine.submit(engine_request(f"cli-{i}", job), stream=True) for i, job in enumerate(jobs)]
        for prompt, handle in zip(args.prompts, handles, strict=True):
            print(f"\n>>> {prompt}", end="", flush=True)
            for event in handle.events(timeout=600):
                if isinstance(event, FinishEvent):
                    if event.error:
                        print(f"\n[error] {event.error}")
                        return 1
                    ttft_ms = event.ttft_s * 1000
                    print(
                        f"\n[{event.reason}: {event.completion_tokens} tokens, first after {ttft_ms:.0f} ms, "
                        f"{event.total_s:.2f} s]"
                    )
                else:
                    print(event.text, end="", flush=True)
        stats = engine.stats()
        print(f"engine: {stats['steps']} steps, attention {stats['attention']}, KV cache {engine.kv_derivation}")
    finally:
        engine.stop()
    return 0


def _worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker",
        help="start a Celery worker hosting the engine (threads pool, embedded Redis if REDIS_URL is unset)",
        description="Start a correctly configured Celery worker: threads pool, one engine per process. "
        "Settings come from the environment (REDIS_URL, MODEL, MAX_BATCH_WEIGHT, ...; see README).",
    )
    p.add_argument("--concurrency", "-c", type=int, default=None, help="task threads (default CONCURRENCY=128)")
    p.add_argument("--hostname", "-n", default=None, help="worker name, e.g. gpu1@%%h")
    p.add_argument("--loglevel", "-l", default="INFO")
    p.add_argument("--pool", "-P", default="threads", help="must be threads; others are refused")
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:

    from weightq.settings import Settings

    require_worker_extra("worker")
    settings = Settings.from_env().check()  # before starting anything (the worker checks them again)
    with redis_for("weightq worker", settings.redis) as url:
        _run_worker(args, settings.replace(redis_url=url))
    return 0


def _run_worker(args: argparse.Namespace, settings: Settings) -> None:
    from weightq.celery import app

    app.configure(settings)
    argv = [
        "worker",
        "-P",
        args.pool,
        "-c",
        str(args.concurrency or settings.worker.concurrency),
        "-Q",
        settings.queues.queue,
        "-l",
        args.loglevel,
        # Gossip and mingle exchange worker state we keep in Redis ourselves; gossip also fails to
        # restart after a broker reconnect (Celery 5.7), leaving the consumer stuck.
        "--without-gossip",
        "--without-mingle",
    ]
    if settings.queues.task_events:
        argv.append("-E")
    if args.hostname:
        argv += ["-n", args.hostname]
    app.worker_main(argv)


def _gateway_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gateway",
        help="serve the OpenAI- and TGI-compatible HTTP API in front of the queue",
        description="HTTP gateway: /v1/completions, /v1/chat/completions, /v1/models, /generate, /generate_stream, "
        "/info, /health, /metrics. Settings from the environment (REDIS_URL, API_KEY, ...; see README).",
    )
    p.add_argument("--host", default=None, help="bind address (default GATEWAY_HOST=127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default GATEWAY_PORT=8000)")
    p.add_argument(
        "--allow-insecure", action="store_true", help="bind a non-loopback address without API_KEY (not recommended)"
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_gateway)


def cmd_gateway(args: argparse.Namespace) -> int:
    import ipaddress

    from weightq.gateway import create_app
    from weightq.settings import Settings

    settings = Settings.from_env()
    host = args.host or settings.gateway.host
    port = settings.gateway.port if args.port is None else args.port
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not settings.gateway.api_key and not args.allow_insecure:
        raise SystemExit(
            f"weightq gateway: refusing to serve {host} without an API key: set API_KEY (clients send "
            "`Authorization: Bearer <key>`), bind 127.0.0.1, or pass --allow-insecure"
        )
    from .supervise import refuse_taken_ports

    refuse_taken_ports("weightq gateway", host, {"gateway": port})  # before anything else, not at bind time
    # Redis away at start is no reason to exit: /ready answers 503 until it answers (Kubernetes waits)
    with redis_for("weightq gateway", settings.redis, must_answer=False) as url:
        app = create_app(settings.replace(gateway_host=host), url)  # its Host check knows the bind
        _serve(app, host, port, args.log_level)
    return 0


def _serve(app: FastAPI, host: str, port: int, log_level: str) -> None:
    import uvicorn

    server = uvicorn.Server(
        # proxy_headers off: the app applies TRUSTED_PROXIES itself (however it is served)
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, proxy_headers=False)
    )
    stop = server.handle_exit

    def handle_exit(sig, frame) -> None:  # a restart is not every client hanging up: keep their jobs
        app.state.gateway.shutting_down = True
        stop(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    # uvicorn handles SIGINT and SIGTERM, then raises the signal again once it has shut down: as
    # KeyboardInterrupt here (redis_for's handlers), so that the command's cleanup runs. SIGHUP (a
    # closed terminal) it leaves alone: it shuts down as for SIGTERM.
    hangup = signal.signal(signal.SIGHUP, handle_exit)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
    finally:
        signal.signal(signal.SIGHUP, hangup)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightq", description="Celery-native LLM generation, batched by weight.")
    sub = parser.add_subparsers(dest="command", required=True)
    _sim_parser(sub)
    _generate_parser(sub)
    _worker_parser(sub)
    _gateway_parser(sub)
    batch_parser(sub)
    stack_parsers(sub)
    redis_parser(sub)
    compose_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM, held as one) before a command's own handling
        return 130


if __name__ == "__main__":
    sys.exit(main())
