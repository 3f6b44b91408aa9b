"""docker-compose.yml is checked against the code: every command parses with the real CLI, every
environment variable is a real setting, and the deployment keeps its promises (AOF, GPU, auth)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from weightq.cli import build_parser
from weightq.settings import Settings, env_name

ROOT = Path(__file__).resolve().parents[2]
EXTERNAL_ENV = {"HF_HOME"}  # read by libraries, not by Settings


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} takes its default; ${VAR:?error} a placeholder."""
    value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "user:secret", value)


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_weightq_commands_parse_with_the_cli(services):
    parser = build_parser()
    for name in ("worker", "gateway"):
        cmd = [interpolate(str(x)) for x in services[name]["command"]]
        assert cmd[0] == "weightq", name
        args = parser.parse_args(cmd[1:])
        assert args.command == name
    assert parser.parse_args(services["gateway"]["command"][1:]).host == "0.0.0.0"


def test_environment_names_are_settings_and_parse(services):
    known = {env_name(name) for name in Settings.model_fields} | EXTERNAL_ENV
    for name, svc in services.items():
        env = {k: interpolate(str(v)) for k, v in (svc.get("environment") or {}).items()}
        assert set(env) <= known, (name, set(env) - known)
        settings = Settings.from_env({k: v for k, v in env.items() if k not in EXTERNAL_ENV})
        if "REDIS_URL" in env:
            assert settings.redis_url == "redis://redis:6379/0"


def test_deployment_promises(services):
    redis_cmd = services["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert any(v.endswith(":/data") for v in services["worker"]["volumes"])  # model cache survives restarts
    flower = services["flower"]["command"]
    assert flower[:4] == ["celery", "-A", "weightq", "flower"] and any(a.startswith("--basic-auth=") for a in flower)
    assert "API_KEY" in services["gateway"]["environment"]  # the gateway binds 0.0.0.0: it needs a key


def test_celery_app_named_by_compose_exists():
    from weightq.celery import app

    app.loader.import_default_modules()  # what a worker does at start
    assert "weightq.generate" in app.tasks
