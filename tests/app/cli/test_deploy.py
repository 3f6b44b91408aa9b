"""A render check of the Kubernetes manifests (deploy/k8s, kustomize): what kustomize would build
exists and parses, the probes name routes the gateway serves and that do not depend on the workers, a
worker's grace outlasts its warm shutdown, and the autoscaler reads a series the gateway exports in the
way that scales from zero without oscillating; a real worker, started with the manifest's METRICS_HOST,
serves what the worker's probes read. (tests/repo/test_k8s_manifests.py validates the objects themselves.)"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml
from weightq.cli.processes import WorkerProcess
from weightq.cli.redis_server import free_port
from weightq.gateway.guard import Guard
from weightq.settings import ENV, Settings

K8S = Path(__file__).resolve().parents[3] / "deploy" / "k8s"


def documents() -> dict[tuple[str, str], dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    for gen in kustomization["configMapGenerator"]:
        for env in gen.get("envs", []):
            assert (K8S / env).is_file(), env
    return out


def env_file() -> dict[str, str]:
    lines = (K8S / "weightq.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def test_the_manifests_parse_and_every_setting_is_a_setting():
    docs = documents()
    assert {("Deployment", "weightq-gateway"), ("StatefulSet", "weightq-worker"), ("StatefulSet", "weightq-redis"),
            ("ScaledObject", "weightq-worker")} <= set(docs)  # fmt: skip
    names = set(ENV) | {"HF_HOME"}
    assert set(env_file()) <= names, set(env_file()) - names
    for kind, name in (("Deployment", "weightq-gateway"), ("StatefulSet", "weightq-worker")):
        refs = [e.get("configMapRef", {}).get("name") for e in container(docs[(kind, name)])["envFrom"]]
        assert "weightq-config" in refs, name  # every setting of weightq.env reaches it


def test_the_gateways_probes_are_open_and_do_not_depend_on_the_workers():
    gw = container(documents()[("Deployment", "weightq-gateway")])
    assert gw["livenessProbe"]["httpGet"]["path"] == "/live"
    assert gw["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert {"/live", "/ready"} <= set(Guard.OPEN)  # no key needed


def test_a_workers_grace_outlasts_its_warm_shutdown_and_it_asks_for_one_gpu():
    worker = documents()[("StatefulSet", "weightq-worker")]
    grace_s = float(env_file().get("SHUTDOWN_GRACE_S", Settings().worker.shutdown_grace_s))
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace_s + 20
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "MODEL" in " ".join(container(worker)["command"])  # refuses to start without MODEL said


def test_the_autoscaler_reads_the_backlog_as_an_average_and_scales_from_zero():
    keda = documents()[("ScaledObject", "weightq-worker")]
    assert keda["spec"]["scaleTargetRef"]["name"] == "weightq-worker" and keda["spec"]["minReplicaCount"] == 0
    assert keda["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert "weightq_backlog_worker_seconds" in trigger["metadata"]["query"]
    metrics = (Path(__file__).resolve().parents[3] / "app" / "metrics.py").read_text()
    assert '"weightq_backlog_worker_seconds"' in metrics  # a series the gateway exports


def test_a_worker_serves_what_its_probes_read(redis_url, tmp_path):
    """The worker's liveness, readiness and startup probes GET a path on its METRICS_PORT (app/worker/boot.py
    serves it once the engine has started): a real worker answers it with its own series."""
    c = container(documents()[("StatefulSet", "weightq-worker")])
    env = {e["name"]: e.get("value") for e in c["env"]}
    probes = [c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")]
    (named,) = {p["port"] for p in probes}
    (path,) = {p["path"] for p in probes}
    assert env["METRICS_PORT"] == str(next(p["containerPort"] for p in c["ports"] if p["name"] == named))
    port = free_port()  # the manifest's port may be taken on a shared test machine
    worker = WorkerProcess(redis_url, "probe@test", tmp_path, concurrency=8, metrics_port=port,
                           metrics_host=env["METRICS_HOST"])  # fmt: skip
    try:
        worker.wait_ready()
        deadline, body = time.monotonic() + 60, b""
        while not body:  # the server starts just after the first heartbeat
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
                    assert answer.status == 200
                    body = answer.read()
            except urllib.error.URLError as e:
                if not isinstance(e.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                    raise AssertionError(f"{path} on METRICS_PORT: {e}\n{worker.log()[-2000:]}") from e
                time.sleep(0.2)
        assert b'weightq_requests_running{worker="probe@test"}' in body
    finally:
        worker.kill()
