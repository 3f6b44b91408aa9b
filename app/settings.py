"""The one settings object: every knob from environment variables (or a `.env` file in the working
directory), typed and validated by pydantic, with documented defaults, in groups that each
component receives alone: `settings.redis`, `.served`, `.engine`, `.batcher`, `.worker`, `.stream`,
`.queues`, `.gateway`, `.metrics` (as Celery's `broker_*`, `worker_*`, `task_*`).

Why it is built this way:
- One rule names every variable, and names never change: a field's name upper-cased, unless the field
  declares an alias (where the bare name says too little), its group's prefix and name: REDIS_* (every
  `redis` field but streams_sentinel_master and weightq_home; streams_url: STREAMS_REDIS_URL),
  BATCHER_MODE, STREAM_{MAXLEN,FLUSH_MS,TTL_S}, {GATEWAY,METRICS}_{HOST,PORT}. `ENV` maps them all.
- A group is validated when it is first read, from the raw values `Settings` keeps, so a process
  checks only what it uses: the gateway and the client never read `settings.engine`, and a bad
  TORCH_THREADS stops the worker (which calls `check()` at start), not them. A bad value raises
  ValueError naming the variable, the value and what was expected, whenever its group is read.
- One way to build settings in code: `Settings(**values)` with the variables' names lower-cased
  (`Settings(queue="q", gateway_port=0)`), routed to their groups; `replace()` for a changed copy.
  A group alone is built by its own class (`GatewaySettings(port=0)`).
- Only entry points call `from_env` (the CLI, the Celery app module, the gateway's app factory, a
  `Client()` given none); the rest is given settings, the engine an `EngineConfig` of the same names
  and defaults (the worker's `engine_config`).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import re
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from dotenv import dotenv_values
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from weightq.tasks.contract import OWN_QUEUE_MARK, STAGED_MARK
from weightq.tasks.limits import OPEN_MAX_PRIORITY

ENV_FILE = ".env"


class Group(BaseModel):
    """A namespace of settings: frozen, built by field name (or by its variable, the alias)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True)


def env_name(group: type[Group], field_name: str) -> str:
    """The environment variable of a setting: its alias, else its name upper-cased (MODEL, QUEUE, ...)."""
    return group.model_fields[field_name].alias or field_name.upper()


def _listed(urls: str) -> list[str]:
    """A comma-separated list of URLs, blanks dropped."""
    return [u.strip() for u in urls.split(",") if u.strip()]


def _shards(value: str) -> str:
    if len(set(urls := _listed(value))) != len(urls):
        raise ValueError("a server is listed twice: each shard of the token plane is a Redis of its own")
    return value


class RedisSettings(Group):
    """Where Redis is and how to reach it: the broker's URL, the token plane's, Sentinel, TLS, durability."""

    url: str = Field("", alias="REDIS_URL")  # empty: the embedded Redis (its URL is recorded under WEIGHTQ_HOME)
    # The token plane (streams, job state: every weightq:* key) on a Redis of its own, or a comma-separated
    # list of them (shards: `shard_of`); empty: REDIS_URL. Same URL forms.
    streams_url: Annotated[str, AfterValidator(_shards)] = Field("", alias="STREAMS_REDIS_URL")
    streams_sentinel_master: str = ""  # a sentinel:// STREAMS_REDIS_URL's group (empty: REDIS_SENTINEL_MASTER)
    sentinel_master: str = Field("mymaster", alias="REDIS_SENTINEL_MASTER")  # sentinel:// URLs: the group's name
    # sentinel:// URLs: the sentinels' own password, if they need one
    sentinel_password: str = Field("", alias="REDIS_SENTINEL_PASSWORD")
    # rediss:// URLs: required | optional | none
    ssl_cert_reqs: Literal["required", "optional", "none"] = Field("required", alias="REDIS_SSL_CERT_REQS")
    ssl_ca_certs: str = Field("", alias="REDIS_SSL_CA_CERTS")  # rediss:// URLs: CA bundle (default: the system's)
    # State writes wait until this many replicas have them (Redis WAIT), or "all" the replicas that are up.
    wait_replicas: Annotated[int, Field(ge=0)] | Literal["all"] = Field(0, alias="REDIS_WAIT_REPLICAS")
    wait_timeout_ms: int = Field(1000, ge=1, alias="REDIS_WAIT_TIMEOUT_MS")  # ... this long, then the write is retried
    retry_s: float = Field(60.0, alias="REDIS_RETRY_S")  # how long a state write waits for Redis to come back
    # the embedded Redis: "always" (durable) or "everysec" (faster)
    appendfsync: Literal["always", "everysec"] = Field("always", alias="REDIS_APPENDFSYNC")
    weightq_home: str = str(Path.home() / ".cache" / "weightq")  # the embedded Redis' data and URL, local logs

    @property
    def home(self) -> Path:
        return Path(self.weightq_home)

    def resolved_url(self) -> str:
        """REDIS_URL, else the URL of the embedded Redis that `weightq` started, else localhost."""
        if self.url:
            return self.url
        recorded = self.home / "redis" / "url"
        if recorded.exists():
            return recorded.read_text().strip()
        return "redis://127.0.0.1:6379/0"

    def streams_urls(self, broker_url: str | None = None) -> list[str]:
        """The token plane's shards, home first: STREAMS_REDIS_URL's list, else the broker's URL."""
        return _listed(self.streams_url) or [broker_url or self.resolved_url()]

    def streams_master(self) -> str:
        """The Sentinel group of the streams' Redis (the broker's when it is the same server)."""
        return (self.streams_url and self.streams_sentinel_master) or self.sentinel_master


# A hub id, as the hub spells one: `name` or `org/name` (the engine's `adapter.HUB_ID` is the same pattern).
HUB_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
MAX_ADAPTER_SPEC = 4096  # characters of a lora_path


def adapter_is_local(spec: str) -> bool:
    """The one rule that tells an adapter's directory from a hub id (the engine's `adapter.is_local`
    applies it too): a directory is written as a path, starting with "/", "~" or "."; anything else
    is a hub id. It reads the string only, never the disk, so the gateway and every worker agree."""
    return spec.startswith(("/", "~", "."))


class AdapterSourceError(ValueError):
    """A run-time adapter source refused: `status` 403 where LORA_ROOT / LORA_HUB_IDS do not allow it,
    400 where it is neither an absolute directory path nor a hub id. The message never echoes a path."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


class ServedSettings(Group):
    """The model a queue serves, as both sides describe it (the gateway's /info without a live worker),
    and where adapters loaded at run time may come from (the gateway refuses early; each worker checks again)."""

    model: str = "builtin:tiny"
    served_model_name: str = ""  # the model name clients send and see (default: MODEL)
    device: str = "auto"
    dtype: str = "auto"
    max_input_length: int = 0  # 0: the model's context limit - 1
    max_total_tokens: int = 0  # 0: the model's context limit
    # /v1/load_lora_adapter: a local lora_path must resolve (symlinks and ".." followed) inside this
    # absolute directory; empty: no local directory. LORA_MODULES (the operator's own) is not limited.
    lora_root: str = ""
    # ... and a hub id must match one of these fnmatch patterns, comma-separated ("myorg/*"); empty: none
    lora_hub_ids: str = ""

    @field_validator("lora_root")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if value and not os.path.isabs(value):
            raise ValueError("must be an absolute directory (the gateway and the workers resolve it alike)")
        return value

    def name(self) -> str:
        """The model's name for clients: SERVED_MODEL_NAME, else MODEL."""
        return self.served_model_name or self.model

    def adapter_source(self, spec: str) -> str:
        """What a worker loads for a run-time `lora_path`: the real path of a directory inside LORA_ROOT,
        or a hub id LORA_HUB_IDS allows. Raises AdapterSourceError saying which setting refuses it."""
        hub_ids = [p.strip() for p in self.lora_hub_ids.split(",") if p.strip()]
        if not self.lora_root and not hub_ids:
            raise AdapterSourceError(
                "adapters cannot be loaded at run time: set LORA_ROOT (the directory they may be loaded from) "
                "or LORA_HUB_IDS (the hub ids allowed, e.g. myorg/*) on the gateway and the workers"
            )
        if not spec or len(spec) > MAX_ADAPTER_SPEC or "\x00" in spec:
            raise AdapterSourceError(f"must be a directory path or a hub id of 1-{MAX_ADAPTER_SPEC} characters", 400)
        if adapter_is_local(spec):
            return self._local_source(spec)
        if not HUB_ID.fullmatch(spec) or ".." in spec:
            raise AdapterSourceError("neither an absolute directory path nor a hub id (name or org/name)", 400)
        if not hub_ids:
            raise AdapterSourceError("hub ids cannot be loaded at run time (LORA_HUB_IDS is not set)")
        if not any(fnmatch.fnmatchcase(spec, pattern) for pattern in hub_ids):
            raise AdapterSourceError(f"hub id {spec!r} is not allowed by LORA_HUB_IDS")
        return spec

    def _local_source(self, spec: str) -> str:
        if not self.lora_root:
            raise AdapterSourceError("local directories cannot be loaded at run time (LORA_ROOT is not set)")
        if not os.path.isabs(spec):  # "~" and "./" mean different places to the gateway and to each worker
            raise AdapterSourceError("a local directory must be an absolute path inside LORA_ROOT", 400)
        root, real = os.path.realpath(self.lora_root), os.path.realpath(spec)
        if os.path.commonpath([root, real]) != root:
            raise AdapterSourceError("outside LORA_ROOT")
        return real


class EngineSettings(Group):
    """The engine's own: runner, compilation, threads, process, KV memory, LoRA, grammars (worker only)."""

    runner: Literal["auto", "paged", "padded", "simulated"] = (
        "auto"  # paged | padded | auto (padded for T5/BART ...) | simulated (a measuring tool: SimulatedRunner)
    )
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile the paged runner (auto: on for CPU)
    # The engine's intra-op threads; 0: cores - 1 on the CPU (`serving_threads`), 1 on CUDA or simulated
    torch_threads: int = 0
    # The engine in a process of its own (`own_process`): auto (on for CUDA, simulated, and a CPU
    # engine whose threads leave a core free), on, off
    engine_process: Literal["auto", "on", "off"] = "auto"
    kv_cache_mb: int = 512  # CPU KV budget when max_batch_weight is derived from memory
    gpu_memory_fraction: float = 0.85
    # LoRA adapters of the model, "name=path-or-hub-id,..." (vLLM's --lora-modules): a request's `model`
    # naming one runs with it, mixed with the base model's in the same steps (`Resident`)
    lora_modules: str = ""
    enable_lora: bool = False  # 1: adapters may be loaded at run time (/v1/load_lora_adapter); implied by LORA_MODULES
    max_lora_rank: Annotated[int, Field(ge=1)] = 16  # the largest adapter rank served: each adapter slot is this wide
    # Structured output: a grammar that takes longer to compile (or more memory) is refused. Trial
    # compiles run in a helper process that is killed past the deadline (`Grammars`).
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_memory_mb: int = 2048
    sim_step_cost: str = ""  # RUNNER=simulated (a measuring tool): "fixed_s,per_token_s,per_kv_token_s"


class BatcherSettings(Group):
    """Who runs next: the batch's weight and size, prefill chunks, admission mode, headroom, prefix cache."""

    max_batch_weight: int = 0  # KV tokens; 0 derives it (MAX_BATCH_SIZE x MAX_TOTAL_TOKENS, or memory)
    max_batch_size: int = 0
    max_prefill_weight: int = 2048
    # predictive on the paged runner, worst_case on the padded one; or either
    mode: Literal["auto", "worst_case", "predictive"] = Field("auto", alias="BATCHER_MODE")
    priority_headroom: float = 0.1  # share of the KV budget background classes (priority < 5) may not take
    prefix_cache: bool = True  # paged runner: reuse the KV of repeated prompt prefixes (PREFIX_CACHE=0: off)


class WorkerSettings(Group):
    """A worker's runtime: task threads and slots, leases and timeouts, crash recovery, shutdown."""

    concurrency: int = 128  # task threads per worker: the most requests one worker holds at once
    # Task threads held back for jobs that come to preempt (urgent ones beside background work, a light
    # tenant's beside a flood): the batcher runs at most CONCURRENCY - INTERACTIVE_SLOTS requests, so it,
    # not the threads, is what binds, and these reach it to preempt; 0: CONCURRENCY / 8
    interactive_slots: Annotated[int, Field(ge=0)] = 0
    visibility_timeout_s: int = 30  # a dead worker's jobs return to the queue after this
    lease_renew_s: float = 5.0  # a live worker re-stamps its in-flight messages this often (restamp_loop)
    restore_interval_s: int = 5  # how often every worker sweeps for expired leases
    lease_ttl_s: float = Field(2.0, gt=0)  # a worker silent this long, with no connection left, is dead
    shutdown_grace_s: float = 30.0  # warm shutdown: finish running generations this long, then requeue
    # a job is dead-lettered once its worker died this many times while running it; after one crash
    # fewer it runs alone, so the last crash is its own (`Reaper`)
    max_attempts: int = Field(3, ge=2)
    recover_interval_s: float = 5.0  # how often a worker looks for jobs whose message was lost
    lost_job_grace_s: float = 30.0  # ... among jobs queued at least this long
    lost_job_scan_limit: int = 50_000  # ... when the queue is no longer than this
    # Celery's "received" and "succeeded" lines, two a job at INFO: off unless asked (or at -l DEBUG),
    # as they cost the worker's main process about a sixth of its CPU per short job (bench.jobcost)
    task_logs: bool = False

    def reserved_slots(self) -> int:
        """INTERACTIVE_SLOTS resolved: the task threads background jobs leave to the urgent classes."""
        wanted = self.interactive_slots or max(1, self.concurrency // 8)
        return max(0, min(wanted, self.concurrency - 1))


class StreamSettings(Group):
    """Token streams and job results in Redis: their length, write pace and lifetimes."""

    maxlen: int = Field(100_000, alias="STREAM_MAXLEN")  # entries kept per token stream
    # a stream's tokens are held at most this long (its first token not at all)
    flush_ms: float = Field(50.0, ge=0, alias="STREAM_FLUSH_MS")
    ttl_s: int = Field(3600, alias="STREAM_TTL_S")  # a stream expires this long after its end (or 1 day after start)
    result_ttl_s: int = 86_400


class QueueSettings(Group):
    """Where a job goes and in what order: the queue, fair staging, affinity, backpressure, task events."""

    queue: str = "weightq"
    # Fair staging (`Intake`): jobs wait in Redis in the scheduler's order (class, then each tenant's
    # share in weight units) and a worker releases them as it can start them; off: first come, first
    # served in each class (redis:// and sentinel:// brokers; rediss:// and unix sockets: off)
    fair_queue: bool = True
    # Celery task events from the start (and task-sent from clients). Off (the default), a worker sends
    # them once asked (`enable_events`), which Flower does every 5 s while it runs: Flower's per-task
    # view costs nothing while no one watches (on: ~5% of the worker main process's CPU at 256 streams)
    task_events: bool = False
    # Prefix affinity (`Router`): a job goes to the own queue of the worker that a hash of its prompt's
    # first AFFINITY_PREFIX_CHARS characters picks (rendezvous over live workers), so that one worker's
    # prefix cache serves each prefix; idle workers steal from backlogged ones. Off: one queue.
    affinity: bool = True
    affinity_prefix_chars: int = Field(256, ge=1)
    # ... unless that worker's own queue already holds this many jobs: then the shared queue (a hot prefix spreads)
    affinity_backlog: int = Field(256, ge=0)
    # Bounded load: a worker's own queue takes a job while it holds fewer than (1 + AFFINITY_SLACK) x the
    # mean backlog of the workers that could take it (at least 16); past that the job goes to the next
    # worker in its prefix's order (a submission's jobs of one prefix together), so hashing never piles
    # work on one worker and moves only the excess
    affinity_slack: float = Field(0.05, ge=0)
    # The prefix cache is per tenant (an API key's jobs only find their own prompts' blocks, and
    # cached_tokens says nothing of others'); on: all tenants share it (one trusted organisation).
    # Here because the client's routing key and the worker's cache salt must agree on it.
    prefix_cache_shared: bool = False
    # Backpressure: a job whose projected wait for a worker exceeds this many seconds is refused at
    # submission (the client raises Overloaded, the gateway answers 429 with Retry-After); 0: never
    max_queue_wait_s: Annotated[float, Field(ge=0)] = 0.0

    @field_validator("queue")
    @classmethod
    def _queue_name(cls, value: str) -> str:
        if OWN_QUEUE_MARK in value:
            raise ValueError(f"a queue name may not contain {OWN_QUEUE_MARK!r}: it names workers' own queues")
        if STAGED_MARK in value:
            raise ValueError(f"a queue name may not contain {STAGED_MARK!r}: it names staged jobs")
        return value


class GatewaySettings(Group):
    """The HTTP gateway: where it listens, its keys, per-client limits, body limits, trusted proxies."""

    host: str = Field("127.0.0.1", alias="GATEWAY_HOST")
    port: int = Field(8000, alias="GATEWAY_PORT")
    # when set, every route but the probes (/health, /live, /ready) needs `Authorization: Bearer <key>` (comma: several)
    api_key: str = ""
    metrics_key: str = ""  # a key that reads /metrics and /metrics/cluster only (Prometheus' credential)
    # The operator's key (comma: several): it alone may load and unload LoRA adapters at run time
    # (/v1/load_lora_adapter, /v1/unload_lora_adapter), and it reaches no other route; empty: both are off (403)
    operator_key: str = ""
    # "key:class,...": a key's jobs run at that priority class, the most its X-Priority may ask
    key_priorities: str = ""
    # The highest X-Priority class a caller may ask for unless KEY_PRIORITIES grants its key more.
    open_max_priority: Annotated[int, Field(ge=0, le=9)] = OPEN_MAX_PRIORITY
    # Generations in progress per key (or address; a request of n choices counts n); 0: no limit;
    # auto: 32 per key when API_KEY is set, none without keys (one local user).
    max_concurrent_per_client: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    # Generation requests per second per key (or address); 0: no limit; auto: 10 when API_KEY is set.
    rate_limit_per_s: Annotated[float, Field(ge=0)] | Literal["auto"] = "auto"
    rate_burst: int = 0  # the rate limit's bucket (0: max(1, RATE_LIMIT_PER_S))
    # Without API_KEY, requests must name this gateway in their Host header (a DNS-rebinding page
    # names its own): localhost, a loopback address, the bind address, or one of these ("*": any).
    allowed_hosts: str = ""
    max_body_bytes: int = 4 * 2**20  # larger request bodies get 413
    body_timeout_s: float = 10.0  # a request body not received within this gets 408 (a trickled body)
    request_timeout_s: float = 600.0  # a job with no stream entry for this long is cancelled (504)
    # Proxies whose X-Forwarded-For names the client (per-address limits, logs): addresses or networks,
    # comma-separated, "*" (any), or "none"
    trusted_proxies: str = "127.0.0.1"

    @field_validator("trusted_proxies")
    @classmethod
    def _addresses(cls, value: str) -> str:
        for item in filter(None, (x.strip() for x in value.split(","))):
            if item not in ("*", "none"):
                ipaddress.ip_network(item)  # ValueError: reported with the variable
        return value


class MetricsSettings(Group):
    """A worker's own Prometheus endpoint (0: off; the gateway's /metrics covers all)."""

    port: int = Field(0, alias="METRICS_PORT")
    host: str = Field("127.0.0.1", alias="METRICS_HOST")


GROUPS: dict[str, type[Group]] = {
    "redis": RedisSettings,
    "served": ServedSettings,
    "engine": EngineSettings,
    "batcher": BatcherSettings,
    "worker": WorkerSettings,
    "stream": StreamSettings,
    "queues": QueueSettings,
    "gateway": GatewaySettings,
    "metrics": MetricsSettings,
}
# Every environment variable: its group and its field there.
ENV: dict[str, tuple[str, str]] = {
    env_name(cls, field): (group, field) for group, cls in GROUPS.items() for field in cls.model_fields
}

G = TypeVar("G", bound=Group)


def validated(cls: type[G], raw: Mapping[str, Any]) -> G:
    """A group from raw values by variable name; a bad one raises ValueError naming it."""
    given = {info.alias or f: raw[env_name(cls, f)] for f, info in cls.model_fields.items() if env_name(cls, f) in raw}
    try:
        return cls(**given)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            name = str(err["loc"][0]).upper() if err["loc"] else cls.__name__
            problems.append(f"{name}={raw.get(name)!r}: {err['msg']}")
        raise ValueError("; ".join(problems)) from None


class Settings:
    """Read with `Settings.from_env()`; built in code with `Settings(name=value, ...)`, the variables'
    names lower-cased (only what it is given: the environment is not read). Groups are validated on
    first use; `check()` validates them all (the worker, at start)."""

    def __init__(self, **values: Any) -> None:
        unknown = [k for k in values if k.upper() not in ENV]
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(unknown)} (a setting is its variable lower-cased)")
        self._raw = {k.upper(): v for k, v in values.items()}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, env_file: str | Path | None = ENV_FILE) -> Settings:
        """The settings of the environment (`env`, default os.environ) over those of `env_file` (if it
        exists); variable names are case-insensitive and an empty one counts as unset."""
        raw: dict[str, Any] = {}
        if env_file is not None and Path(env_file).is_file():
            raw |= _known(dotenv_values(env_file))
        raw |= _known(os.environ if env is None else env)
        return cls(**{k.lower(): v for k, v in raw.items()})

    def replace(self, **values: Any) -> Settings:
        """A copy with these settings changed (same names as the constructor's)."""
        return Settings(**{k.lower(): v for k, v in self._raw.items()} | values)

    def check(self) -> Settings:
        """Every group validated now: one ValueError naming each bad variable. Returns self."""
        problems = []
        for name in GROUPS:
            try:
                getattr(self, name)
            except ValueError as e:
                problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @cached_property
    def redis(self) -> RedisSettings:
        return validated(RedisSettings, self._raw)

    @cached_property
    def served(self) -> ServedSettings:
        return validated(ServedSettings, self._raw)

    @cached_property
    def engine(self) -> EngineSettings:
        return validated(EngineSettings, self._raw)

    @cached_property
    def batcher(self) -> BatcherSettings:
        return validated(BatcherSettings, self._raw)

    @cached_property
    def worker(self) -> WorkerSettings:
        return validated(WorkerSettings, self._raw)

    @cached_property
    def stream(self) -> StreamSettings:
        return validated(StreamSettings, self._raw)

    @cached_property
    def queues(self) -> QueueSettings:
        return validated(QueueSettings, self._raw)

    @cached_property
    def gateway(self) -> GatewaySettings:
        return validated(GatewaySettings, self._raw)

    @cached_property
    def metrics(self) -> MetricsSettings:
        return validated(MetricsSettings, self._raw)


def _known(values: Mapping[str, str | None]) -> dict[str, str]:
    """The settings' variables among these (any case), empty ones dropped."""
    return {k.upper(): v for k, v in values.items() if k.upper() in ENV and v}
