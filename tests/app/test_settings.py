"""Settings come from the environment, typed, in groups, with the variable named in every error; each
process validates the groups it reads (the worker all of them); the engine's config (and the batcher's in
it) keeps their names and defaults."""

from dataclasses import fields
from types import SimpleNamespace

import pytest
from weightq.celery_config import celery_config
from weightq.settings import ENV, GROUPS, GatewaySettings, Settings, env_name
from weightq.worker.to_engine import BATCHER_FIELDS, ENGINE_FIELDS, engine_config

# Every variable the settings read before they were grouped (issue 43): the names must never change.
NAMES_BEFORE_GROUPS = """
AFFINITY AFFINITY_BACKLOG AFFINITY_PREFIX_CHARS ALLOWED_HOSTS API_KEY BATCHER_MODE BODY_TIMEOUT_S COMPILE CONCURRENCY
DEVICE DTYPE ENABLE_LORA ENGINE_PROCESS FAIR_QUEUE GATEWAY_HOST GATEWAY_PORT GPU_MEMORY_FRACTION
GRAMMAR_COMPILE_MEMORY_MB GRAMMAR_COMPILE_TIMEOUT_S INTERACTIVE_SLOTS KEY_PRIORITIES KV_CACHE_MB LEASE_RENEW_S
LEASE_TTL_S LORA_MODULES LOST_JOB_GRACE_S LOST_JOB_SCAN_LIMIT MAX_ATTEMPTS MAX_BATCH_SIZE MAX_BATCH_WEIGHT
MAX_BODY_BYTES MAX_CONCURRENT_PER_CLIENT MAX_INPUT_LENGTH MAX_LORA_RANK MAX_PREFILL_WEIGHT MAX_QUEUE_WAIT_S
MAX_TOTAL_TOKENS METRICS_HOST METRICS_KEY METRICS_PORT MODEL OPEN_MAX_PRIORITY PREFIX_CACHE PREFIX_CACHE_SHARED
PRIORITY_HEADROOM QUEUE RATE_BURST RATE_LIMIT_PER_S RECOVER_INTERVAL_S REDIS_APPENDFSYNC REDIS_RETRY_S
REDIS_SENTINEL_MASTER REDIS_SENTINEL_PASSWORD REDIS_SSL_CA_CERTS REDIS_SSL_CERT_REQS REDIS_URL REDIS_WAIT_REPLICAS
REDIS_WAIT_TIMEOUT_MS REQUEST_TIMEOUT_S RESTORE_INTERVAL_S RESULT_TTL_S RUNNER SERVED_MODEL_NAME SHUTDOWN_GRACE_S
SIM_STEP_COST STREAMS_REDIS_URL STREAMS_SENTINEL_MASTER STREAM_FLUSH_MS STREAM_MAXLEN STREAM_TTL_S TASK_EVENTS
TORCH_THREADS TRUSTED_PROXIES VISIBILITY_TIMEOUT_S WEIGHTQ_HOME
"""
TODAYS_NAMES = NAMES_BEFORE_GROUPS.split()
# variables added after the grouping: new names, never renamed old ones
ADDED_SINCE = ["TASK_LOGS", "AFFINITY_SLACK", "OPERATOR_KEY", "LORA_ROOT", "LORA_HUB_IDS"]
BAD_ENGINE = {"TORCH_THREADS": "abc", "RUNNER": "bogus", "MAX_BATCH_WEIGHT": "lots"}


def test_the_environment_names_are_todays_one_field_each():
    assert len(TODAYS_NAMES) == 75
    names = set(TODAYS_NAMES) | set(ADDED_SINCE)
    assert set(ENV) == names and len(ENV) == sum(len(g.model_fields) for g in GROUPS.values())


# The one rule's exceptions: a field that declares an alias (its group's prefix and its name), by group.
ALIASED = {
    "redis": "REDIS_",
    "batcher": "BATCHER_",
    "stream": "STREAM_",
    "gateway": "GATEWAY_",
    "metrics": "METRICS_",
}


def test_every_variable_is_its_field_upper_cased_or_the_alias_the_module_docstring_lists():
    for group, cls in GROUPS.items():
        for name, info in cls.model_fields.items():
            if info.alias is None:
                assert env_name(cls, name) == name.upper()
            elif name == "streams_url":
                assert info.alias == "STREAMS_REDIS_URL"
            else:
                assert info.alias == ALIASED[group] + name.upper(), (group, name)


def test_from_env_types_and_defaults():
    env = {"MAX_BATCH_WEIGHT": "4096", "TASK_EVENTS": "on", "MODEL": "/models/x", "GPU_MEMORY_FRACTION": "0.5"}
    s = Settings.from_env(env | {"REDIS_URL": "", "gateway_port": "9000"}, env_file=None)
    assert s.batcher.max_batch_weight == 4096 and s.queues.task_events is True and s.served.model == "/models/x"
    assert s.engine.gpu_memory_fraction == 0.5 and s.redis.url == "" and s.worker.concurrency == 128
    assert s.gateway.port == 9000  # names are case-insensitive; a group's field may be shorter than its variable
    assert engine_config(s.served, s.engine, s.batcher).batcher.max_batch_weight == 4096
    d = Settings()
    assert engine_config(d.served, d.engine, d.batcher).batcher.max_batch_weight == 0  # 0 means derive


def test_bad_values_name_the_variable_when_their_group_is_read():
    s = Settings.from_env({"MAX_BATCH_WEIGHT": "lots", "TASK_EVENTS": "maybe", "BATCHER_MODE": "fast"}, env_file=None)
    with pytest.raises(ValueError, match="MAX_BATCH_WEIGHT='lots': Input should be a valid integer"):
        _ = s.batcher
    with pytest.raises(ValueError, match="TASK_EVENTS='maybe': Input should be a valid boolean"):
        _ = s.queues
    with pytest.raises(ValueError, match="BATCHER_MODE='fast': Input should be 'auto', 'worst_case' or 'predictive'"):
        s.check()
    assert s.gateway.port == 8000  # the other groups are unaffected
    with pytest.raises(TypeError, match="gateway_prot"):
        Settings(gateway_prot=1)  # a misspelt name in code fails at once


def test_the_web_side_ignores_a_bad_engine_variable_and_the_worker_refuses_it(monkeypatch, tmp_path):
    from weightq.client import Client
    from weightq.gateway import create_app

    s = Settings.from_env(BAD_ENGINE | {"REDIS_URL": "redis://127.0.0.1:9/0", "API_KEY": "k"}, env_file=None)
    create_app(s)  # the gateway: its client, limits, hub and routes
    client = Client(settings=s)
    assert client.app.conf.task_default_queue == "weightq"  # the client's Celery configuration
    assert client.router.queues([]) == [] and s.gateway.api_key == "k"
    with pytest.raises(ValueError, match="TORCH_THREADS='abc'"):
        _ = s.engine
    with pytest.raises(ValueError, match="TRUSTED_PROXIES='no-such'"):
        create_app(Settings.from_env({"TRUSTED_PROXIES": "no-such"}, env_file=None))  # the gateway's own: refused

    from weightq.worker.boot import EngineStep

    monkeypatch.chdir(tmp_path)  # no .env
    for name, value in BAD_ENGINE.items():
        monkeypatch.setenv(name, value)
    app = SimpleNamespace(settings=Settings.from_env())  # what the worker's Celery app was configured with
    with pytest.raises(ValueError, match=r"RUNNER='bogus'.*TORCH_THREADS='abc'.*MAX_BATCH_WEIGHT='lots'"):
        EngineStep.start(None, SimpleNamespace(hostname="w@t", app=app))  # every group, before anything starts


def test_a_dotenv_file_fills_in_what_the_environment_leaves_unset(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("MAX_BATCH_WEIGHT=2048\nCONCURRENCY=7\n# a comment\nQUEUE=from-file\n")
    s = Settings.from_env({"QUEUE": "from-env", "CONCURRENCY": ""}, env_file=env_file)
    assert s.batcher.max_batch_weight == 2048 and s.worker.concurrency == 7  # an empty variable counts as unset
    assert s.queues.queue == "from-env"  # the environment wins over the file
    assert Settings.from_env({}, env_file=tmp_path / "missing.env").batcher.max_batch_weight == 0


def test_settings_built_in_code_take_only_what_they_are_given(monkeypatch):
    monkeypatch.setenv("MAX_BATCH_WEIGHT", "999")
    assert Settings(queue="q").batcher.max_batch_weight == 0
    assert Settings.from_env().batcher.max_batch_weight == 999
    s = Settings(gateway_port=1, queue="q").replace(gateway_host="0.0.0.0")
    assert (s.gateway.host, s.gateway.port, s.queues.queue) == ("0.0.0.0", 1, "q")
    assert GatewaySettings(port=2).port == GatewaySettings(GATEWAY_PORT=2).port == 2  # a group alone


def test_celery_config_is_json_only_late_ack_and_short_visibility():
    conf = celery_config(Settings(redis_url="redis://h:1/0", visibility_timeout_s=17))
    assert conf["accept_content"] == ["json"] and conf["task_serializer"] == "json"
    assert conf["task_acks_late"] and conf["worker_prefetch_multiplier"] == 1 and conf["worker_pool"] == "threads"
    assert conf["broker_transport_options"]["visibility_timeout"] == 17
    assert conf["broker_url"] == conf["result_backend"] == "redis://h:1/0"


def test_each_option_is_declared_once_and_each_setting_reaches_it_with_its_default():
    """EngineConfig holds the batcher's config rather than re-declaring its options (they once had two
    or three declarations with different defaults: PREFIX_CACHE, MAX_PREFILL_WEIGHT, BATCHER_MODE,
    MAX_TOTAL_TOKENS, MAX_BATCH_WEIGHT and the block size), and every setting of the worker's three
    groups goes to exactly one of them under its own name and default."""
    from weightq.batcher import BatcherConfig
    from weightq.batcher.config import PRIORITY_HEADROOM
    from weightq.engine import EngineConfig

    assert not ENGINE_FIELDS & BATCHER_FIELDS and "batcher" not in ENGINE_FIELDS
    d = Settings()
    assert engine_config(d.served, d.engine, d.batcher) == EngineConfig()
    groups = [GROUPS["served"], GROUPS["engine"], GROUPS["batcher"]]
    names = [name for g in groups for name in g.model_fields]
    assert len(names) == len(set(names))  # one setting per name across the three
    # the names clients see, the engine's process, and where run-time adapters may come from (the worker checks)
    not_engine = {"served_model_name", "engine_process", "lora_root", "lora_hub_ids"}
    assert set(names) - ENGINE_FIELDS - BATCHER_FIELDS == not_engine
    defaults = {f.name: f.default for f in fields(EngineConfig)} | {f.name: f.default for f in fields(BatcherConfig)}
    for g in groups:
        for name in set(g.model_fields) - not_engine:
            assert defaults[name] == g.model_fields[name].default, name
    assert d.batcher.priority_headroom == PRIORITY_HEADROOM == BatcherConfig().priority_headroom
    given = Settings(max_total_tokens=300, prefix_cache="0", batcher_mode="worst_case", model="m", kv_cache_mb=64)
    cfg = engine_config(given.served, given.engine, given.batcher)
    assert (cfg.model, cfg.kv_cache_mb) == ("m", 64)
    assert (cfg.batcher.max_total_tokens, cfg.batcher.prefix_cache, cfg.batcher.mode) == (300, False, "worst_case")
