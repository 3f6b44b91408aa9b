"""The deployment files against the code: docker-compose.yml is `weightq compose`'s output, and for any
number of GPUs every service parses (commands with the real CLI, environment names as real settings)
with each worker pinned to a GPU of its own; the images serve (a CUDA torch by default, a compiler
where compile is on); Prometheus scrapes each series once and the Grafana dashboard asks only for
metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from weightq.cli import build_parser
from weightq.cli.compose import CPU_INDEX, compose_yaml
from weightq.settings import ENV, Settings

ROOT = Path(__file__).resolve().parents[3]
EXTERNAL_ENV = {"HF_HOME", "REDISCLI_AUTH", "GF_SECURITY_ADMIN_PASSWORD"}  # read by others, not by Settings
WEIGHTQ_SERVICES = ("worker", "gateway", "flower")


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} takes its default; ${VAR:?error} a placeholder."""
    value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "secret", value)


def workers(services: dict) -> dict:
    return {name: svc for name, svc in services.items() if name.startswith("worker-")}


def test_the_repository_compose_file_is_the_generated_one():
    assert (ROOT / "docker-compose.yml").read_text() == compose_yaml()  # regenerate: weightq compose > ...


@pytest.mark.parametrize("gpus", ["1", "2", "4", "8", "0,2,5"])
def test_one_gpu_per_worker_for_n_gpus(gpus):
    services = yaml.safe_load(compose_yaml(gpus))["services"]
    want = [str(i) for i in range(int(gpus))] if gpus.isdigit() else gpus.split(",")
    pinned = []
    for name, svc in workers(services).items():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]  # exactly one reservation
        assert "count" not in device and device["capabilities"] == ["gpu"], name  # count: 1 + --scale = one GPU
        (gpu,) = device["device_ids"]
        pinned.append(gpu)
        assert svc["build"]["target"] == "worker" and svc["build"]["args"]["TORCH_INDEX"] == ""  # PyPI: CUDA torch
        assert any(v.endswith(":/data") for v in svc["volumes"])  # the model cache survives restarts
    assert sorted(pinned) == sorted(want)  # every GPU once, no GPU twice


@pytest.mark.parametrize(
    "kw", [{}, {"gpus": "4", "expose_redis": True}, {"cpu": 2}, {"gpus": "2", "role": "workers"}], ids=repr
)
def test_every_service_parses_with_the_real_cli_and_settings(kw):
    doc = yaml.safe_load(compose_yaml(**kw))
    services, parser = doc["services"], build_parser()
    known = set(ENV) | EXTERNAL_ENV
    for name, svc in services.items():
        if not name.startswith(WEIGHTQ_SERVICES):
            continue
        cmd = [interpolate(str(x)) for x in svc["command"]]
        if cmd[0] == "weightq":
            assert parser.parse_args(cmd[1:]).command == name.split("-")[0]
        else:
            assert cmd[:4] == ["celery", "-A", "weightq", "flower"] and any(a.startswith("--basic-auth=") for a in cmd)
        env = {k: interpolate(str(v)) for k, v in svc["environment"].items()}
        assert set(env) <= known, (name, set(env) - known)
        Settings.from_env({k: v for k, v in env.items() if k not in EXTERNAL_ENV}).check()
        for dep in svc.get("depends_on", {}):
            assert dep in services
    for svc in services.values():  # named volumes and secrets are declared
        for volume in svc.get("volumes", []):
            assert volume.startswith("./") or volume.split(":")[0] in doc["volumes"]
        for secret in svc.get("secrets", []):
            assert secret in doc["secrets"]


def test_roles_cpu_and_a_published_redis():
    full = yaml.safe_load(compose_yaml("2"))["services"]
    redis_cmd = full["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes" and "ports" not in full["redis"]
    assert ":?" in full["gateway"]["environment"]["API_KEY"]  # it binds 0.0.0.0: it needs a key
    assert full["prometheus"]["profiles"] == full["grafana"]["profiles"] == ["monitoring"]
    exposed = yaml.safe_load(compose_yaml("2", expose_redis=True))["services"]
    assert exposed["redis"]["ports"] == ["6379:6379"] and "--requirepass" in exposed["redis"]["command"]
    assert "${REDIS_PASSWORD:?" in exposed["worker-0"]["environment"]["REDIS_URL"]
    remote = yaml.safe_load(compose_yaml("2", role="workers"))["services"]
    assert set(remote) == {"worker-0", "worker-1"}  # another machine: workers only, on the first one's Redis
    assert remote["worker-0"]["environment"]["REDIS_URL"].startswith("${REDIS_URL:?")
    cpu = workers(yaml.safe_load(compose_yaml(cpu=2))["services"])
    assert len(cpu) == 2 and all(
        "deploy" not in s and s["build"]["args"]["TORCH_INDEX"] == CPU_INDEX for s in cpu.values()
    )
    for bad in ("0", "1,1", "x"):
        with pytest.raises(ValueError, match="--gpus"):
            compose_yaml(bad)


def test_images_cuda_torch_by_default_and_a_compiler_in_the_worker():
    text = (ROOT / "Dockerfile").read_text()
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S))
    assert set(stages) == {"web", "worker"}
    assert "torch" not in stages["web"] and '".[flower]"' in stages["web"]  # the web image has no engine
    worker = stages["worker"]
    assert re.search(r"^ARG TORCH_INDEX=$", worker, re.M)  # empty: PyPI's torch, the CUDA build
    assert '"torch==2.13.0"' in worker  # pinned, as in pyproject.toml
    # compile is on by default on the CPU (COMPILE=auto), and triton needs a C compiler on CUDA
    assert worker.index("g++") < worker.index("torch==")


def test_prometheus_scrapes_each_series_once():
    jobs = {j["job_name"]: j for j in yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]}
    assert jobs["weightq-gateways"]["metrics_path"] == "/metrics"  # each gateway's own: every gateway
    cluster = jobs["weightq-cluster"]
    assert cluster["metrics_path"] == "/metrics/cluster" and [len(c["targets"]) for c in cluster["static_configs"]] == [
        1
    ]
    assert all("authorization" in j for j in jobs.values())  # /metrics needs the API key


def test_the_dashboard_asks_only_for_exported_metrics(redis_url):
    from prometheus_client import generate_latest
    from weightq.gateway.core import Gateway

    gw = Gateway(Settings(redis_url=redis_url))
    text = (generate_latest(gw.registry) + generate_latest(gw.cluster)).decode()
    exported = set(re.findall(r"^# TYPE (\S+)", text, re.M))
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/weightq.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    asked = {m for e in exprs for m in re.findall(r"weightq_\w+", e)}
    missing = {m for m in asked if m not in exported and re.sub(r"_(bucket|sum|count|total)$", "", m) not in exported}
    assert asked and not missing, missing
    assert {"weightq_queue_depth", "weightq_job_time_to_first_token_seconds_bucket"} <= asked


def test_celery_app_named_by_compose_exists():
    from weightq.celery import app

    app.loader.import_default_modules()  # what a worker does at start
    assert "weightq.generate" in app.tasks


def test_every_setting_reaches_the_containers_model_is_said_and_monitoring_needs_nothing_to_start():
    """Settings come from the project's .env (compose reads it for ${...} too) to the workers and the
    gateway; MODEL has no default; the monitoring profile's credentials are checked in its containers,
    not by ${...:?}, which compose applies to the whole file, so a plain `up` never asks for them."""
    doc = yaml.safe_load(compose_yaml())
    svc = doc["services"]
    for name in ("worker-0", "gateway"):
        assert svc[name]["env_file"] == [{"path": ".env", "required": False}], name
        assert svc[name]["environment"]["MODEL"].startswith("${MODEL:?"), name
    text = compose_yaml()
    assert "GRAFANA_PASSWORD:?" not in text and "METRICS_KEY:?" not in text
    for name, var in (("prometheus", "METRICS_KEY"), ("grafana", "GF_SECURITY_ADMIN_PASSWORD")):
        assert f'test -n "$${var}"' in svc[name]["entrypoint"][-1], name
    assert svc["gateway"]["environment"]["METRICS_KEY"] == "${METRICS_KEY:-}"
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert {j["authorization"]["credentials_file"] for j in prometheus["scrape_configs"]} == {"/tmp/metrics_key"}
