"""Settings come from the environment, typed, with the variable named in every error."""

import pytest
from weightq.celery_config import celery_config
from weightq.settings import Settings
from weightq.worker.to_engine import engine_config


def test_from_env_types_and_defaults():
    s = Settings.from_env(
        {
            "MAX_BATCH_WEIGHT": "4096",
            "TASK_EVENTS": "off",
            "MODEL": "/models/x",
            "GPU_MEMORY_FRACTION": "0.5",
            "REDIS_URL": "",
        }
    )
    assert s.max_batch_weight == 4096 and s.task_events is False and s.model == "/models/x"
    assert s.gpu_memory_fraction == 0.5 and s.redis_url == "" and s.concurrency == 128
    assert engine_config(s).max_batch_weight == 4096
    assert engine_config(Settings.from_env({})).max_batch_weight is None  # 0 means derive


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="MAX_BATCH_WEIGHT='lots': Input should be a valid integer"):
        Settings.from_env({"MAX_BATCH_WEIGHT": "lots"})
    with pytest.raises(ValueError, match="TASK_EVENTS='maybe': Input should be a valid boolean"):
        Settings.from_env({"TASK_EVENTS": "maybe"})
    with pytest.raises(ValueError, match="BATCHER_MODE='fast': Input should be 'auto', 'worst_case' or 'predictive'"):
        Settings.from_env({"BATCHER_MODE": "fast"})


def test_a_dotenv_file_fills_in_what_the_environment_leaves_unset(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("MAX_BATCH_WEIGHT=2048\nCONCURRENCY=7\n# a comment\nQUEUE=from-file\n")
    s = Settings.from_env({"QUEUE": "from-env", "CONCURRENCY": ""}, env_file=env_file)
    assert s.max_batch_weight == 2048 and s.concurrency == 7  # an empty variable counts as unset
    assert s.queue == "from-env"  # the environment wins over the file
    assert Settings.from_env({}, env_file=tmp_path / "missing.env").max_batch_weight == 0


def test_settings_built_in_code_take_only_what_they_are_given(monkeypatch):
    monkeypatch.setenv("MAX_BATCH_WEIGHT", "999")
    assert Settings(queue="q").max_batch_weight == 0
    assert Settings.from_env().max_batch_weight == 999


def test_celery_config_is_json_only_late_ack_and_short_visibility():
    conf = celery_config(Settings(redis_url="redis://h:1/0", visibility_timeout_s=17))
    assert conf["accept_content"] == ["json"] and conf["task_serializer"] == "json"
    assert conf["task_acks_late"] and conf["worker_prefetch_multiplier"] == 1 and conf["worker_pool"] == "threads"
    assert conf["broker_transport_options"]["visibility_timeout"] == 17
    assert conf["broker_url"] == conf["result_backend"] == "redis://h:1/0"


def test_one_default_per_option_from_the_environment_to_the_batcher():
    """An option the settings pass down keeps one default in every layer (PRIORITY_HEADROOM once
    differed: 0.1 in the settings and the engine, 0.0 in the batcher and so the simulator)."""
    from weightq.batcher import BatcherConfig
    from weightq.batcher.config import PRIORITY_HEADROOM
    from weightq.engine import EngineConfig

    assert Settings().priority_headroom == PRIORITY_HEADROOM
    assert EngineConfig().priority_headroom == PRIORITY_HEADROOM == engine_config(Settings()).priority_headroom
    assert BatcherConfig(max_batch_weight=1024, max_total_tokens=512).priority_headroom == PRIORITY_HEADROOM
