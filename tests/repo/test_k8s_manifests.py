"""The Kubernetes manifests (deploy/k8s) as `kubectl apply -k deploy/k8s` would send them, checked
without a cluster.

`render()` does what the kustomization does that matters here (the namespace, the images, the generated
ConfigMaps, the common labels); every object it gives is validated against the Kubernetes schemas that
kubernetes_validate bundles, in strict mode (an unknown or misplaced field fails). Where kubectl is on the
PATH, `kubectl kustomize` must render the same objects. KEDA's ScaledObject is a CRD those schemas lack:
`test_the_autoscaler_...` checks by hand what it needs (its target is the worker object; its serverAddress
resolves to a shipped Service and port, a Prometheus whose config scrapes the job its query names; the
query's metrics exist in app/metrics.py). Then what a cluster would only show at run time: every pod has
liveness and readiness probes that reach something it serves, KEDA's target declares no replicas, every
Secret and ConfigMap a pod reads is shipped or documented, and the NetworkPolicies let only the gateway and
the workers reach Redis. None of this has run on a cluster (docs/kubernetes.md says so)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37"  # the newest schemas kubernetes-validate 1.37 bundles
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}
CRDS = {"ScaledObject"}  # KEDA's: not in the Kubernetes schemas
OURS = {"weightq-web", "weightq-worker"}  # built from the Dockerfile, pushed by the user


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def env_pairs(text: str) -> dict[str, str]:
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def generated_config_maps(kust: dict) -> list[dict]:
    out = []
    for gen in kust.get("configMapGenerator", []):
        data: dict[str, str] = {}
        for name in gen.get("envs", []):
            data |= env_pairs((K8S / name).read_text())
        for name in gen.get("files", []):
            key, _, path = name.rpartition("=") if "=" in name else (name, "", name)
            data[key] = (K8S / path).read_text()
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return out


def pod_spec(obj: dict) -> dict | None:
    return obj["spec"]["template"]["spec"] if obj["kind"] in WORKLOADS else None


def containers(obj: dict) -> list[dict]:
    spec = pod_spec(obj)
    return [] if spec is None else [*spec.get("initContainers", []), *spec["containers"]]


def retag(image: str, images: list[dict]) -> str:
    """An image as kustomize's `images:` rewrites it (by the name before the tag)."""
    name, _, tag = image.partition(":")
    for entry in images:
        if entry["name"] == name:
            return f"{entry.get('newName', name)}:{entry.get('newTag', tag)}"
    return image


def render() -> list[dict]:
    """The objects `kubectl apply -k deploy/k8s` sends, less the generated names' hash suffixes."""
    kust = kustomization()
    objects = []
    for name in kust["resources"]:
        objects += [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]
    objects += generated_config_maps(kust)
    labels = {k: v for entry in kust.get("labels", []) for k, v in entry["pairs"].items()}
    for obj in objects:
        meta = obj["metadata"]
        meta["labels"] = meta.get("labels", {}) | labels
        if obj["kind"] not in CLUSTER_SCOPED and "namespace" in kust:
            meta["namespace"] = kust["namespace"]
        for c in containers(obj):
            c["image"] = retag(c["image"], kust.get("images", []))
    return objects


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def example_secrets() -> dict[str, dict]:
    docs = yaml.safe_load_all((K8S / "secrets.example.yaml").read_text())
    return {d["metadata"]["name"]: d for d in docs if d}


# ----- the kustomization and the schemas ---------------------------------------------------------------
def test_every_file_the_kustomization_names_exists_and_every_image_is_named_there():
    kust = kustomization()
    named = [*kust["resources"]]
    for gen in kust.get("configMapGenerator", []):
        named += gen.get("envs", []) + [f.rpartition("=")[2] for f in gen.get("files", [])]
    for name in named:
        assert (K8S / name).is_file(), f"kustomization.yaml names {name}, which deploy/k8s lacks"
    assert "secrets.example.yaml" not in kust["resources"]  # placeholders are never applied
    in_images = {entry["name"] for entry in kust["images"]}
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            for c in containers(doc) if doc else []:
                assert c["image"].partition(":")[0] in in_images, f"{name}: {c['image']} is not in images:"
    rendered = [c["image"] for obj in render() for c in containers(obj)]
    assert rendered and all(":" in i and not i.endswith(":latest") for i in rendered), rendered
    ours = {i for i in rendered if i.rpartition("/")[2].partition(":")[0] in OURS}
    assert len(ours) == 2 and all("/" in i for i in ours), ours  # pulled from a registry, not a local name


def test_the_dockerfile_builds_the_targets_the_images_name():
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", (ROOT / "Dockerfile").read_text(), re.M))
    assert {f"weightq-{t}" for t in targets} >= OURS, targets
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for target in ("web", "worker"):
        assert f"--target {target}" in docs
    assert "kustomize edit set image" in docs


@pytest.mark.parametrize(
    "obj", [o for o in render() if o["kind"] not in CRDS], ids=lambda o: f"{o['kind']}/{o['metadata']['name']}"
)
def test_each_object_is_valid_against_the_kubernetes_schemas(obj):
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_only_the_keda_object_lacks_a_schema():
    """What the schemas cannot check is the CRD alone, which test_the_autoscaler_... checks by hand."""
    crds = [o for o in render() if o["kind"] in CRDS]
    assert [o["kind"] for o in crds] == ["ScaledObject"]
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(crds[0], KUBERNETES_VERSION, strict=True)


def test_the_example_secrets_are_valid_and_say_they_are_placeholders():
    for secret in example_secrets().values():
        kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
        assert all("change-me" in v for v in secret["stringData"].values()), secret["metadata"]["name"]


def strip_hashes(obj, generated: set[str]):
    """kustomize's generated names (`weightq-config-7h96kk77ft`) back to the generator's name."""
    if isinstance(obj, dict):
        return {k: strip_hashes(v, generated) for k, v in obj.items()}
    if isinstance(obj, list):
        return [strip_hashes(v, generated) for v in obj]
    if isinstance(obj, str):
        base = obj.rpartition("-")[0]
        return base if base in generated else obj
    return obj


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_same_objects():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, check=True).stdout
    generated = {gen["name"] for gen in kustomization().get("configMapGenerator", [])}
    theirs = [strip_hashes(doc, generated) for doc in yaml.safe_load_all(out) if doc]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(theirs, key=key) == sorted(render(), key=key)


# ----- pods: probes, replicas, what they read ------------------------------------------------------------
def test_every_pod_has_liveness_and_readiness_probes_that_check_something_real():
    for obj in render():
        for c in pod_spec(obj)["containers"] if pod_spec(obj) else []:
            where = f"{obj['metadata']['name']}/{c['name']}"
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            for kind in ("livenessProbe", "readinessProbe"):
                probe = c.get(kind)
                assert probe, f"{where} has no {kind}"
                if "exec" in probe:
                    command = " ".join(probe["exec"]["command"])
                    assert command.strip() not in ("true", "exit 0", "sh -c true"), f"{where}: {kind} checks nothing"
                    assert "ping" in command, f"{where}: {kind} runs {command!r}"
                port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
                if isinstance(port, str):
                    assert port in ports, f"{where}: {kind} names port {port!r}, which it does not declare"
                if obj["metadata"]["name"] == "weightq-worker":  # its METRICS_PORT, reachable from the node
                    assert env["METRICS_PORT"] == str(ports[port]) and env["METRICS_HOST"] == "0.0.0.0", where


def test_redis_probes_authenticate_with_its_password():
    redis = find(render(), "StatefulSet", "weightq-redis")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["REDISCLI_AUTH"]["value"] == "$(REDIS_PASSWORD)"
    assert c["args"][c["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "weightq-redis", "key": "REDIS_PASSWORD"}


def env_order_is_defined(c: dict) -> None:
    """$(VAR) in env, command and args expands only variables defined earlier in env (or by envFrom)."""
    defined: list[str] = []
    for e in c.get("env", []):
        for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
            assert ref in defined, f"{c['name']}: {e['name']} uses $({ref}) before it is defined"
        defined.append(e["name"])
    for arg in [*c.get("command", []), *c.get("args", [])]:
        for ref in re.findall(r"\$\((\w+)\)", arg):
            assert ref in defined, f"{c['name']}: $({ref}) in its command is not in its env"


def test_gateway_and_workers_reach_redis_with_the_password():
    objects = render()
    redis = find(objects, "Service", "weightq-redis")
    port = redis["spec"]["ports"][0]["port"]
    for kind, name in (("Deployment", "weightq-gateway"), ("StatefulSet", "weightq-worker")):
        (c,) = find(objects, kind, name)["spec"]["template"]["spec"]["containers"]
        env_order_is_defined(c)
        env = {e["name"]: e for e in c["env"]}
        assert env["REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@weightq-redis:{port}/0", name
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "weightq-redis", name
    config = find(objects, "ConfigMap", "weightq-config")["data"]
    assert "REDIS_URL" not in config  # a password-less URL there would be shadowed and misleading
    env_order_is_defined(find(objects, "StatefulSet", "weightq-redis")["spec"]["template"]["spec"]["containers"][0])


def references(obj: dict) -> list[tuple[str, str, str | None, bool]]:
    """(Secret or ConfigMap, its name, the key read or None for all, optional) for what a pod reads."""
    spec, out = pod_spec(obj), []
    for c in containers(obj):
        for e in c.get("env", []):
            for kind, ref in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if r := e.get("valueFrom", {}).get(ref):
                    out.append((kind, r["name"], r["key"], r.get("optional", False)))
        for e in c.get("envFrom", []):
            for kind, ref in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                if r := e.get(ref):
                    out.append((kind, r["name"], None, r.get("optional", False)))
    for v in spec.get("volumes", []) if spec else []:
        if s := v.get("secret"):
            out += [("Secret", s["secretName"], i["key"], s.get("optional", False)) for i in s.get("items", [])]
        if m := v.get("configMap"):
            out.append(("ConfigMap", m["name"], None, m.get("optional", False)))
    return out


def test_every_secret_and_config_map_a_pod_reads_is_shipped_or_documented():
    objects = render()
    shipped = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    examples, docs = example_secrets(), (ROOT / "docs" / "kubernetes.md").read_text()
    seen = set()
    for obj in objects:
        for kind, name, key, optional in references(obj):
            seen.add(name)
            if (kind, name) in shipped:
                assert key is None or key in shipped[(kind, name)]["data"], f"{name} lacks {key}"
                continue
            assert kind == "Secret", f"{obj['metadata']['name']} reads ConfigMap {name}, which is not shipped"
            assert name in examples, f"{obj['metadata']['name']} reads Secret {name}: not in secrets.example.yaml"
            assert key is None or key in examples[name]["stringData"], f"secrets.example.yaml: {name} lacks {key}"
            created = re.search(rf"kubectl (-n \S+ )?create secret generic {name} ", docs)
            assert created, f"docs/kubernetes.md: how to create {name}"
            assert optional or name != "weightq-hf", "HF_TOKEN is for gated models only: optional"
    assert set(examples) <= seen, set(examples) - seen  # no example of a Secret nothing reads


def test_the_worker_cache_outlives_scale_to_zero_and_keda_owns_the_replicas():
    worker = find(render(), "StatefulSet", "weightq-worker")
    spec = worker["spec"]
    assert "replicas" not in spec  # KEDA's; a value here would reset it on every apply
    assert spec["persistentVolumeClaimRetentionPolicy"]["whenScaled"] == "Retain"
    (claim,) = spec["volumeClaimTemplates"]
    (c,) = spec["template"]["spec"]["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    config = find(render(), "ConfigMap", "weightq-config")["data"]
    for var in ("HF_HOME", "WEIGHTQ_HOME"):
        assert config[var].startswith(mount["mountPath"] + "/"), var
    assert not any("emptyDir" in v for v in spec["template"]["spec"].get("volumes", []))


# ----- KEDA and Prometheus ------------------------------------------------------------------------------
def service_for(objects: list[dict], url: str) -> tuple[dict, dict]:
    """The shipped Service (and its port) a URL's host names: `name`, `name.ns`, `name.ns.svc[...]`."""
    parts = urlsplit(url if "//" in url else f"http://{url}")
    name, _, rest = parts.hostname.partition(".")
    ns = rest.partition(".")[0] or kustomization()["namespace"]
    assert not rest or rest in (f"{ns}", f"{ns}.svc", f"{ns}.svc.cluster.local"), parts.hostname
    assert ns == kustomization()["namespace"], f"{url}: namespace {ns}, not the kustomization's"
    svc = find(objects, "Service", name)
    ports = [p for p in svc["spec"]["ports"] if p["port"] == parts.port]
    assert ports, f"{url}: Service {name} has no port {parts.port}"
    return svc, ports[0]


def selected_container(objects: list[dict], svc: dict, port: dict) -> tuple[dict, dict]:
    """The workload the Service selects, and its container that serves the port's targetPort."""
    for obj in objects:
        labels = obj["spec"]["template"]["metadata"]["labels"] if pod_spec(obj) else {}
        if pod_spec(obj) and svc["spec"]["selector"].items() <= labels.items():
            for c in pod_spec(obj)["containers"]:
                if any(p.get("name") == port["targetPort"] for p in c.get("ports", [])):
                    return obj, c
    raise AssertionError(f"Service {svc['metadata']['name']} selects no container serving {port['targetPort']}")


def test_the_autoscaler_reads_a_series_the_shipped_prometheus_scrapes():
    """KEDA's ScaledObject, by hand (a CRD): required fields, its target, its Prometheus and its query."""
    objects = render()
    keda = find(objects, "ScaledObject", "weightq-worker")
    assert keda["apiVersion"] == "keda.sh/v1alpha1"
    target = keda["spec"]["scaleTargetRef"]
    worker = find(objects, target.get("kind", "Deployment"), target["name"])
    assert target.get("apiVersion", "apps/v1") == worker["apiVersion"] and "replicas" not in worker["spec"]
    assert keda["spec"]["minReplicaCount"] == 0 < keda["spec"]["maxReplicaCount"]
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert float(meta["threshold"]) > 0 and float(meta["activationThreshold"]) == 0
    svc, port = service_for(objects, meta["serverAddress"])
    prometheus, c = selected_container(objects, svc, port)
    assert "prometheus" in c["image"]

    metrics = (ROOT / "app" / "metrics.py").read_text()
    names = set(re.findall(r"\bweightq_\w+", meta["query"]))
    assert "weightq_backlog_worker_seconds" in names
    for name in names:
        assert f'"{name}"' in metrics, f"the query reads {name}, which app/metrics.py does not export"

    config_arg = next(a for a in c["args"] if a.startswith("--config.file="))
    config_path = Path(config_arg.partition("=")[2])
    volumes = {v["name"]: v for v in pod_spec(prometheus)["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if config_path.parent == Path(m["mountPath"])]
    config_map = find(objects, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][config_path.name])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (job_name,) = re.findall(r'job="([^"]+)"', meta["query"])
    job = jobs[job_name]
    assert job["metrics_path"] == "/metrics/cluster"  # where BacklogCollector is registered
    (static,) = job["static_configs"]
    (address,) = static["targets"]
    gateway_svc, gateway_port = service_for(objects, address)
    gateway, _ = selected_container(objects, gateway_svc, gateway_port)
    assert gateway["metadata"]["name"] == "weightq-gateway"


def test_prometheus_sends_the_metrics_key_the_gateway_reads():
    objects = render()
    prometheus = find(objects, "Deployment", "weightq-prometheus")
    (c,) = pod_spec(prometheus)["containers"]
    config = yaml.safe_load(find(objects, "ConfigMap", "weightq-prometheus")["data"]["prometheus.yml"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    files = {}
    for v in pod_spec(prometheus)["volumes"]:
        if s := v.get("secret"):
            files |= {f"{mounts[v['name']]}/{i['path']}": (s["secretName"], i["key"]) for i in s["items"]}
    gateway = find(objects, "Deployment", "weightq-gateway")
    gateway_secrets = {
        e["secretRef"]["name"] for e in pod_spec(gateway)["containers"][0]["envFrom"] if "secretRef" in e
    }
    for job in config["scrape_configs"]:
        secret, key = files[job["authorization"]["credentials_file"]]
        assert key == "METRICS_KEY" and secret in gateway_secrets, job["job_name"]
    role = find(objects, "Role", "weightq-prometheus")  # kubernetes_sd of pods, this namespace only
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = find(objects, "RoleBinding", "weightq-prometheus")
    (subject,) = binding["subjects"]
    assert subject["name"] == pod_spec(prometheus)["serviceAccountName"]
    assert subject["namespace"] == kustomization()["namespace"]


# ----- NetworkPolicies ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pod:
    """A connection's source: its namespace and labels."""

    namespace: str
    labels: dict = field(default_factory=dict, hash=False)


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "matchExpressions: extend this check"
    return selector.get("matchLabels", {}).items() <= labels.items()


def peer_admits(peer: dict, source: Pod, namespace: str) -> bool:
    assert "ipBlock" not in peer, "ipBlock: extend this check"
    ns_ok = (
        selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source.namespace})
        if "namespaceSelector" in peer
        else source.namespace == namespace
    )
    return ns_ok and selects(peer.get("podSelector", {}), source.labels)


def allowed(objects: list[dict], source: Pod, workload: str, port_name: str) -> bool:
    """Whether NetworkPolicy lets `source` connect to `workload`'s container port `port_name`."""
    (obj,) = [o for o in objects if o["kind"] in WORKLOADS and o["metadata"]["name"] == workload]
    labels, ns = obj["spec"]["template"]["metadata"]["labels"], obj["metadata"]["namespace"]
    port = next(p for c in pod_spec(obj)["containers"] for p in c.get("ports", []) if p["name"] == port_name)
    policies = [
        p for p in objects
        if p["kind"] == "NetworkPolicy" and p["metadata"]["namespace"] == ns and "Ingress" in p["spec"]["policyTypes"]
        and selects(p["spec"]["podSelector"], labels)
    ]  # fmt: skip
    if not policies:
        return True  # a pod no policy selects accepts everything
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers_ok = "from" not in rule or any(peer_admits(peer, source, ns) for peer in rule["from"])
            ports_ok = "ports" not in rule or any(
                p.get("port") in (port["containerPort"], port_name) and p.get("protocol", "TCP") == "TCP"
                for p in rule["ports"]
            )
            if peers_ok and ports_ok:
                return True
    return False


def test_network_policies_let_only_the_gateway_and_workers_reach_redis():
    objects = render()
    ns = kustomization()["namespace"]
    gateway, worker = Pod(ns, {"app": "weightq-gateway"}), Pod(ns, {"app": "weightq-worker"})
    prometheus, stranger = Pod(ns, {"app": "weightq-prometheus"}), Pod(ns, {"app": "debug"})
    elsewhere = Pod("default", {"app": "weightq-gateway"})  # a look-alike in another namespace
    keda = Pod("keda", {"app": "keda-operator"})
    policies = [p for p in objects if p["kind"] == "NetworkPolicy"]
    deny_all = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny_all and deny_all[0]["spec"]["policyTypes"] == ["Ingress"]
    assert any(p["spec"]["podSelector"] == {"matchLabels": {"app": "weightq-redis"}} for p in policies)
    assert allowed(objects, gateway, "weightq-redis", "redis") and allowed(objects, worker, "weightq-redis", "redis")
    for source in (prometheus, stranger, elsewhere, keda):
        assert not allowed(objects, source, "weightq-redis", "redis"), source
    assert allowed(objects, prometheus, "weightq-gateway", "http")  # /metrics, /metrics/cluster
    assert allowed(objects, keda, "weightq-prometheus", "http")  # the scaling query
    assert not allowed(objects, stranger, "weightq-prometheus", "http")
    for source in (gateway, stranger, keda):
        assert not allowed(objects, source, "weightq-worker", "metrics")
