"""The one settings object: every knob from environment variables (or a `.env` file in the working
directory), typed and validated by pydantic-settings, with documented defaults."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, DotEnvSettingsSource, EnvSettingsSource, SettingsConfigDict
from weightq.tasks.contract import OWN_QUEUE_MARK, STAGED_MARK
from weightq.tasks.limits import OPEN_MAX_PRIORITY

ENV_FILE = ".env"


def env_name(field_name: str) -> str:
    """The environment variable of a setting: its name upper-cased (REDIS_URL, MAX_BATCH_WEIGHT, ...)."""
    return field_name.upper()


class Settings(BaseSettings):
    """Read with `Settings.from_env()`; each field's environment variable is its name upper-cased
    (REDIS_URL, MODEL, MAX_BATCH_WEIGHT, ...), an empty one counts as unset, and the process
    environment wins over `.env`. `Settings(...)` takes only what it is given. Unset REDIS_URL means
    the embedded Redis."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", env_ignore_empty=True, case_sensitive=False)

    redis_url: str = ""  # empty: the embedded Redis (its URL is recorded under WEIGHTQ_HOME)
    # The token plane (streams, job state: every weightq:* key) on a Redis of its own, or a comma-separated
    # list of them (shards: tasks/contract.py, shard_of); empty: REDIS_URL. Same URL forms.
    streams_redis_url: Annotated[str, AfterValidator(lambda v: _shards(v))] = ""
    streams_sentinel_master: str = ""  # a sentinel:// STREAMS_REDIS_URL's group (empty: REDIS_SENTINEL_MASTER)
    model: str = "builtin:tiny"
    device: str = "auto"
    dtype: str = "auto"
    max_batch_weight: int = 0  # KV tokens; 0 derives it (MAX_BATCH_SIZE x MAX_TOTAL_TOKENS, or memory)
    max_batch_size: int = 0
    max_prefill_weight: int = 2048
    max_input_length: int = 0  # 0: the model's context limit - 1
    max_total_tokens: int = 0  # 0: the model's context limit
    kv_cache_mb: int = 512  # CPU KV budget when max_batch_weight is derived from memory
    gpu_memory_fraction: float = 0.85
    batcher_mode: Literal["auto", "worst_case", "predictive"] = (
        "auto"  # predictive on the paged runner, worst_case on the padded one; or either
    )
    runner: Literal["auto", "paged", "padded", "simulated"] = (
        "auto"  # paged | padded | auto (padded for T5/BART ...) | simulated (a measuring tool: runner/simulated.py)
    )
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile the paged runner (auto: on for CPU)
    priority_headroom: float = 0.1  # share of the KV budget background classes (priority < 5) may not take
    prefix_cache: bool = True  # paged runner: reuse the KV of repeated prompt prefixes (PREFIX_CACHE=0: off)
    # The prefix cache is per tenant (an API key's jobs only find their own prompts' blocks, and
    # cached_tokens says nothing of others'); on: all tenants share it (one trusted organisation).
    prefix_cache_shared: bool = False
    # LoRA adapters of the model, "name=path-or-hub-id,..." (vLLM's --lora-modules): a request's `model`
    # naming one runs with it, mixed with the base model's in the same steps (engine/lora/)
    lora_modules: str = ""
    enable_lora: bool = False  # 1: adapters may be loaded at run time (/v1/load_lora_adapter); implied by LORA_MODULES
    max_lora_rank: Annotated[int, Field(ge=1)] = 16  # the largest adapter rank served: each adapter slot is this wide
    # Structured output: a grammar that takes longer to compile (or more memory) is refused. Trial
    # compiles run in a helper process that is killed past the deadline (engine/sampling/grammar_trial.py).
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_memory_mb: int = 2048
    sim_step_cost: str = ""  # RUNNER=simulated (a measuring tool): "fixed_s,per_token_s,per_kv_token_s"
    # The engine's intra-op threads; 0: cores - 1 on the CPU (builder.py: serving_threads), 1 on CUDA or simulated
    torch_threads: int = 0
    # The engine in a process of its own (engine/process/): auto (on for CUDA, simulated, and a CPU
    # engine whose threads leave a core free), on, off
    engine_process: Literal["auto", "on", "off"] = "auto"
    # Backpressure: a job whose projected wait for a worker exceeds this many seconds is refused at
    # submission (the client raises Overloaded, the gateway answers 429 with Retry-After); 0: never
    max_queue_wait_s: Annotated[float, Field(ge=0)] = 0.0
    concurrency: int = 128  # task threads per worker: the most requests one worker holds at once
    # Task threads that background classes (priority < 5) may not take, so that an interactive job always
    # finds one and reaches the engine, which preempts background work for it; 0: CONCURRENCY / 8
    interactive_slots: Annotated[int, Field(ge=0)] = 0
    # Fair staging (app/worker/intake.py): jobs wait in Redis in the scheduler's order (class, then each
    # tenant's share in weight units) and a worker releases them as it can start them; off: first come,
    # first served in each class (redis:// and sentinel:// brokers; rediss:// and unix sockets: off)
    fair_queue: bool = True
    task_events: bool = True  # Flower's per-task view; off saves ~a third of the consumer's work per job
    queue: str = "weightq"
    # Prefix affinity (app/client/routing.py): a job goes to the own queue of the worker that a hash of its
    # prompt's first AFFINITY_PREFIX_CHARS characters picks (rendezvous over live workers), so that
    # one worker's prefix cache serves each prefix; idle workers steal from backlogged ones. Off: one queue.
    affinity: bool = True
    affinity_prefix_chars: int = Field(256, ge=1)
    # ... unless that worker's own queue already holds this many jobs: then the shared queue (a hot prefix spreads)
    affinity_backlog: int = Field(256, ge=0)
    visibility_timeout_s: int = 30  # a dead worker's jobs return to the queue after this
    lease_renew_s: float = 5.0  # a live worker re-stamps its in-flight messages this often (restamp_loop)
    restore_interval_s: int = 5  # how often every worker sweeps for expired leases
    stream_maxlen: int = 100_000  # entries kept per token stream
    stream_flush_ms: float = Field(50.0, ge=0)  # a stream is written at most this often (its first token at once)
    stream_ttl_s: int = 3600  # a stream expires this long after its end (or 1 day after its start)
    result_ttl_s: int = 86_400
    shutdown_grace_s: float = 30.0  # warm shutdown: finish running generations this long, then requeue
    # a job is dead-lettered once its worker died this many times while running it; after one crash
    # fewer it runs alone, so the last crash is its own (app/worker/reaper.py)
    max_attempts: int = Field(3, ge=2)
    lease_ttl_s: float = Field(2.0, gt=0)  # a worker silent this long, with no connection left, is dead
    redis_retry_s: float = 60.0  # a worker waits this long for Redis to come back before failing a job
    recover_interval_s: float = 5.0  # how often a worker looks for jobs whose message was lost
    lost_job_grace_s: float = 30.0  # ... among jobs queued at least this long
    lost_job_scan_limit: int = 50_000  # ... when the queue is no longer than this
    weightq_home: str = str(Path.home() / ".cache" / "weightq")
    redis_appendfsync: Literal["always", "everysec"] = (
        "always"  # the embedded Redis: "always" (durable) or "everysec" (faster)
    )
    redis_ssl_cert_reqs: Literal["required", "optional", "none"] = (
        "required"  # rediss:// URLs: required | optional | none
    )
    redis_ssl_ca_certs: str = ""  # rediss:// URLs: CA bundle (default: the system's)
    redis_sentinel_master: str = "mymaster"  # sentinel:// URLs: the monitored group's name
    redis_sentinel_password: str = ""  # sentinel:// URLs: the sentinels' own password, if they need one
    # State writes wait until this many replicas have them (Redis WAIT), or "all" the replicas that are up.
    redis_wait_replicas: Annotated[int, Field(ge=0)] | Literal["all"] = 0
    redis_wait_timeout_ms: int = Field(1000, ge=1)  # ... this long, then the write is retried
    metrics_port: int = 0  # a worker's own Prometheus endpoint (0: off; the gateway's /metrics covers all)
    metrics_host: str = "127.0.0.1"
    # HTTP gateway
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    # when set, every route but the probes (/health, /live, /ready) needs `Authorization: Bearer <key>` (comma: several)
    api_key: str = ""
    metrics_key: str = ""  # a key that reads /metrics and /metrics/cluster only (Prometheus' credential)
    key_priorities: str = (
        ""  # "key:class,...": a key's jobs run at that priority class, the most its X-Priority may ask
    )
    # Generations in progress per key (or address; a request of n choices counts n); 0: no limit;
    # auto: 32 per key when API_KEY is set, none without keys (one local user).
    max_concurrent_per_client: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    # Generation requests per second per key (or address); 0: no limit; auto: 10 when API_KEY is set.
    rate_limit_per_s: Annotated[float, Field(ge=0)] | Literal["auto"] = "auto"
    rate_burst: int = 0  # the rate limit's bucket (0: max(1, RATE_LIMIT_PER_S))
    # The highest X-Priority class a caller may ask for unless KEY_PRIORITIES grants its key more.
    open_max_priority: Annotated[int, Field(ge=0, le=9)] = OPEN_MAX_PRIORITY
    # Without API_KEY, requests must name this gateway in their Host header (a DNS-rebinding page
    # names its own): localhost, a loopback address, the bind address, or one of these ("*": any).
    allowed_hosts: str = ""
    served_model_name: str = ""  # the model name clients send and see (default: MODEL)
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413
    body_timeout_s: float = 10.0  # a request body not received within this gets 408 (a trickled body)
    request_timeout_s: float = 600.0  # a job with no stream entry for this long is cancelled (504)
    # Proxies whose X-Forwarded-For names the client (per-address limits, logs): addresses or networks,
    # comma-separated, "*" (any), or "none"
    trusted_proxies: str = "127.0.0.1"

    @field_validator("queue")
    @classmethod
    def _queue_name(cls, value: str) -> str:
        if OWN_QUEUE_MARK in value:
            raise ValueError(f"a queue name may not contain {OWN_QUEUE_MARK!r}: it names workers' own queues")
        if STAGED_MARK in value:
            raise ValueError(f"a queue name may not contain {STAGED_MARK!r}: it names staged jobs")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _addresses(cls, value: str) -> str:
        for item in filter(None, (x.strip() for x in value.split(","))):
            if item not in ("*", "none"):
                ipaddress.ip_network(item)  # ValueError: reported by from_env() with the variable
        return value

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        return (init_settings,)  # the environment is read by from_env() alone, so Settings(...) is exact

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, env_file: str | Path | None = ENV_FILE) -> Settings:
        """The settings of the environment (`env`, default os.environ) over those of `env_file` (if it
        exists); a bad value raises ValueError naming the variable, the value and what was expected."""
        values: dict[str, Any] = {}
        if env_file is not None and Path(env_file).is_file():
            values |= DotEnvSettingsSource(cls, env_file=env_file, env_ignore_empty=True)()
        source = EnvSettingsSource(cls, case_sensitive=False, env_ignore_empty=True)
        if env is not None:
            source.env_vars = {k.lower(): v for k, v in env.items() if v != ""}
        values |= source()
        try:
            return cls(**values)
        except ValidationError as e:
            problems = [
                f"{env_name(str(err['loc'][0]))}={values.get(str(err['loc'][0]))!r}: {err['msg']}" for err in e.errors()
            ]
            raise ValueError("; ".join(problems)) from None

    @property
    def home(self) -> Path:
        return Path(self.weightq_home)

    def reserved_slots(self) -> int:
        """INTERACTIVE_SLOTS resolved: the task threads background jobs leave to the urgent classes."""
        wanted = self.interactive_slots or max(1, self.concurrency // 8)
        return max(0, min(wanted, self.concurrency - 1))

    def resolved_redis_url(self) -> str:
        """REDIS_URL, else the URL of the embedded Redis that `weightq` started, else localhost."""
        if self.redis_url:
            return self.redis_url
        recorded = self.home / "redis" / "url"
        if recorded.exists():
            return recorded.read_text().strip()
        return "redis://127.0.0.1:6379/0"

    def streams_urls(self, broker_url: str | None = None) -> list[str]:
        """The token plane's shards, home first: STREAMS_REDIS_URL's list, else the broker's URL."""
        return _listed(self.streams_redis_url) or [broker_url or self.resolved_redis_url()]

    def streams_master(self) -> str:
        """The Sentinel group of the streams' Redis (the broker's when it is the same server)."""
        return (self.streams_redis_url and self.streams_sentinel_master) or self.redis_sentinel_master


def _listed(urls: str) -> list[str]:
    """A comma-separated list of URLs, blanks dropped."""
    return [u.strip() for u in urls.split(",") if u.strip()]


def _shards(value: str) -> str:
    if len(set(urls := _listed(value))) != len(urls):
        raise ValueError("a server is listed twice: each shard of the token plane is a Redis of its own")
    return value
