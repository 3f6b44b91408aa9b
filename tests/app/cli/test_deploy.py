"""A render check of the Kubernetes manifests (deploy/k8s, kustomize): what kustomize would build
exists and parses, the probes name routes the gateway serves and that do not depend on the workers, a
worker's grace outlasts its warm shutdown, and the autoscaler reads a series the gateway exports in the
way that scales from zero without oscillating."""

from __future__ import annotations

from pathlib import Path

import yaml
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
        for env in gen["envs"]:
            assert (K8S / env).is_file(), env
    return out


def env_file() -> dict[str, str]:
    lines = (K8S / "weightq.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def test_the_manifests_parse_and_every_setting_is_a_setting():
    docs = documents()
    assert {("Deployment", "weightq-gateway"), ("Deployment", "weightq-worker"), ("StatefulSet", "weightq-redis"),
            ("ScaledObject", "weightq-worker")} <= set(docs)  # fmt: skip
    names = set(ENV) | {"HF_HOME"}
    assert set(env_file()) <= names, set(env_file()) - names
    for kind, name in (("Deployment", "weightq-gateway"), ("Deployment", "weightq-worker")):
        refs = [e.get("configMapRef", {}).get("name") for e in container(docs[(kind, name)])["envFrom"]]
        assert "weightq-config" in refs, name  # every setting of weightq.env reaches it


def test_the_gateways_probes_are_open_and_do_not_depend_on_the_workers():
    gw = container(documents()[("Deployment", "weightq-gateway")])
    assert gw["livenessProbe"]["httpGet"]["path"] == "/live"
    assert gw["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert {"/live", "/ready"} <= set(Guard.OPEN)  # no key needed


def test_a_workers_grace_outlasts_its_warm_shutdown_and_it_asks_for_one_gpu():
    worker = documents()[("Deployment", "weightq-worker")]
    grace_s = float(env_file().get("SHUTDOWN_GRACE_S", Settings().worker.shutdown_grace_s))
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace_s + 20
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "MODEL" in " ".join(container(worker)["command"])  # refuses to start without MODEL said


def test_the_autoscaler_reads_the_backlog_as_an_average_and_scales_from_zero():
    keda = documents()[("ScaledObject", "weightq-worker")]
    assert keda["spec"]["scaleTargetRef"]["name"] == "weightq-worker" and keda["spec"]["minReplicaCount"] == 0
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert "weightq_backlog_worker_seconds" in trigger["metadata"]["query"]
    metrics = (Path(__file__).resolve().parents[3] / "app" / "metrics.py").read_text()
    assert '"weightq_backlog_worker_seconds"' in metrics  # a series the gateway exports
