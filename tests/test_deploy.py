"""deploy/k8s (Kubernetes manifests), deploy/prometheus and deploy/grafana checked against the project: every
manifest against the Kubernetes schemas (bundled with kubernetes-validate: no cluster, no network), and the
routes, settings and metric names they use against the code that serves them."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fakeredis
import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from api.metrics import ApiMetrics
from common.cluster import ModelState
from common.protocol import Finish
from common.settings import Settings, load_settings
from tests.helpers import REPO, dockerfile, env_vars
from worker.metrics import WorkerMetrics

K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"  # the oldest Kubernetes the manifests must suit
API_DRAIN_MARGIN = 5  # seconds uvicorn drains past shutdownGraceSeconds (api/main.py)
POOL_DEVICES = {"cpu": None, "cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}


def resources() -> list[tuple[str, dict[str, Any]]]:
    """(file, resource) for every resource of the manifests kustomization.yaml lists."""
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    return [(name, doc) for name in listed for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def find(kind: str, name: str) -> dict[str, Any]:
    return next(doc for _, doc in resources() if doc["kind"] == kind and doc["metadata"]["name"] == name)


def ferry_deployments() -> list[dict[str, Any]]:
    """The Deployments whose pods run the Ferry image."""
    return [doc for _, doc in resources() if doc["kind"] == "Deployment"
            and doc["spec"]["template"]["spec"]["containers"][0]["image"].startswith("ferry:")]


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def pool(deployment: dict[str, Any]) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["ferry/pool"]


def route_paths() -> set[str]:
    app = create_app(Settings(model_path=Path("unused"), model_name="m"), redis=fakeredis.FakeAsyncRedis())
    return {route.path for route in app.routes}  # type: ignore[attr-defined]


def config_json() -> str:
    return yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["ferry.json"]


LoadSettings = Callable[[dict[str, Any]], Settings]


@pytest.fixture
def container_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LoadSettings:
    """The settings a container of the manifests starts with: the ConfigMap's file, then its own env."""
    config = tmp_path / "ferry.json"
    config.write_text(config_json())

    def load(container: dict[str, Any]) -> Settings:
        for name in env_vars():
            monkeypatch.delenv(name, raising=False)
        env = {item["name"]: item["value"] for item in container.get("env", [])}
        assert env["FERRY_CONFIG"] == "/etc/ferry/ferry.json"
        for name, value in {**env, "FERRY_CONFIG": str(config)}.items():
            monkeypatch.setenv(name, value)
        return load_settings()

    return load


@pytest.mark.parametrize(("name", "resource"), resources(),
                         ids=[f"{name}:{doc['kind']}/{doc['metadata']['name']}" for name, doc in resources()])
def test_every_manifest_validates_against_the_kubernetes_schemas(name: str, resource: dict[str, Any]) -> None:
    # valid (else it raises), and against the schemas of that very version, not an older one's
    assert kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_the_schemas_catch_a_misspelt_field() -> None:
    broken = copy.deepcopy(find("Deployment", "ferry-api"))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(path.name for path in K8S.glob("*.yaml") if path.name != "kustomization.yaml")


def test_the_configmap_holds_deploy_ferry_json() -> None:
    assert json.loads(config_json()) == json.loads((REPO / "deploy" / "ferry.json").read_text())


def test_containers_set_only_known_settings_and_load_them(container_settings: LoadSettings) -> None:
    """Every Ferry container (init containers too) names only settings Ferry reads, and the configuration it
    ends up with is valid; the config volume puts the ConfigMap's file where FERRY_CONFIG says."""
    known = env_vars()
    for deployment in ferry_deployments():
        spec = deployment["spec"]["template"]["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            names = {item["name"] for item in container.get("env", [])}
            assert names <= known, (deployment["metadata"]["name"], names - known)
        container = main_container(deployment)
        container_settings(container)
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/ferry")
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == "ferry-config"


def test_api_probes_use_the_apps_health_routes() -> None:
    container = main_container(find("Deployment", "ferry-api"))
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    paths = route_paths()
    ports = {port["name"] for port in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in paths and container[probe]["httpGet"]["port"] in ports


def test_pods_stop_gracefully(container_settings: LoadSettings) -> None:
    """API pods: the preStop pause, then shutdownGraceSeconds for open streams and uvicorn's margin, inside the
    grace period. Workers: their running batch may take up to e2eTimeout to finish."""
    api = find("Deployment", "ferry-api")
    container = main_container(api)
    settings = container_settings(container)
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = api["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pause + settings.shutdown_grace_seconds + API_DRAIN_MARGIN
    workers = [d for d in ferry_deployments() if main_container(d)["command"] == ["ferry-worker"]]
    assert {pool(worker) for worker in workers} == set(POOL_DEVICES)
    for worker in workers:
        settings = container_settings(main_container(worker))
        assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > settings.e2e_timeout


def test_each_worker_pool_requests_its_accelerator(container_settings: LoadSettings) -> None:
    for worker in (find("Deployment", f"ferry-worker-{name}") for name in POOL_DEVICES):
        container = main_container(worker)
        settings = container_settings(container)
        assert settings.worker_pool == pool(worker) and settings.device.split(":")[0] == pool(worker)
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        device = POOL_DEVICES[pool(worker)]
        accelerators = {name for name in {*requests, *limits} if "/" in name}
        assert accelerators == ({device} if device else set())
        if device:
            assert requests[device] == limits[device] >= 1  # extended resources: requests equal limits
        probes = [container[probe]["httpGet"] for probe in ("startupProbe", "livenessProbe")]
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert all(ports[probe["port"]] == settings.worker_metrics_port for probe in probes)
        assert settings.worker_metrics_host == "0.0.0.0"  # the kubelet and Prometheus come to the pod's address


def test_pods_run_as_the_images_user_except_the_npu_pool() -> None:
    """The NPU pool runs as root: its device files belong to the host driver's group (worker-npu.yaml)."""
    image_user = int(next(args for kind, args in dockerfile() if kind == "USER"))
    for deployment in ferry_deployments():
        context = deployment["spec"]["template"]["spec"]["securityContext"]
        if deployment["metadata"]["name"] == "ferry-worker-npu":
            assert context["runAsUser"] == 0
        else:
            assert context["runAsNonRoot"] and context["runAsUser"] == image_user


def test_services_and_the_autoscaler_point_at_the_pods(container_settings: LoadSettings) -> None:
    for service_name in ("ferry-api", "redis"):
        service = find("Service", service_name)
        pods = [d for _, d in resources() if d["kind"] == "Deployment"
                and service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, service_name
        ports = {port["name"] for port in main_container(pods[0])["ports"]}
        assert {port["targetPort"] for port in service["spec"]["ports"]} <= ports
    redis = urlparse(container_settings(main_container(find("Deployment", "ferry-api"))).redis_url)
    assert (redis.hostname, redis.port) == ("redis", find("Service", "redis")["spec"]["ports"][0]["port"])
    target = find("HorizontalPodAutoscaler", "ferry-api")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "ferry-api")
    assert "cpu" in main_container(find("Deployment", "ferry-api"))["resources"]["requests"]  # utilization needs it


# --------------------------------------------------------------------------------------------- Prometheus


def meta_name(name: str) -> str:
    """A Kubernetes label or annotation name as Prometheus's discovery spells it in a meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def scraped(pod: dict[str, Any], keeps: list[dict[str, Any]]) -> bool:
    """Whether the scrape config's ``keep`` rules keep this pod template."""
    meta = {f"__meta_kubernetes_pod_label_{meta_name(k)}": v for k, v in pod["metadata"]["labels"].items()}
    meta |= {f"__meta_kubernetes_pod_annotation_{meta_name(k)}": v
             for k, v in pod["metadata"].get("annotations", {}).items()}
    return all(re.fullmatch(rule["regex"], ";".join(meta.get(label, "") for label in rule["source_labels"]))
               for rule in keeps)


def test_prometheus_scrapes_the_api_and_worker_pods_on_their_metrics_ports(container_settings: LoadSettings) -> None:
    (job,) = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    keeps = [rule for rule in job["relabel_configs"] if rule.get("action") == "keep"]
    kept = {d["metadata"]["name"] for _, d in resources() if d["kind"] == "Deployment"
            and scraped(d["spec"]["template"], keeps)}
    assert kept == {d["metadata"]["name"] for d in ferry_deployments()}  # not Redis
    for deployment in ferry_deployments():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        container = main_container(deployment)
        port = int(annotations["prometheus.io/port"])
        assert port in {p["containerPort"] for p in container["ports"]}
        if container["command"] == ["ferry-api"]:
            assert port == container_settings(container).port and annotations["prometheus.io/path"] in route_paths()
        else:
            assert port == container_settings(container).worker_metrics_port


# --------------------------------------------------------------------------------------------- Grafana


def exported() -> tuple[set[str], set[str]]:
    """The sample names and label names API pods and workers export, every metric exercised once."""
    api = ApiMetrics()
    api.request_queued("m", 4, 8)
    api.token_received("m", 0.1, first=True)
    api.token_received("m", 0.01, first=False)
    api.request_refused("m", "overloaded")
    finish = Finish(finish_reason="length", generated_tokens=8, prompt_tokens=4, seed=0, generated_text="x")
    api.request_finished("m", finish, 0.5)
    api.observe_cluster([ModelState(model="m", queue_depth=0, workers=[])])
    worker = WorkerMetrics("m", kv_budget_tokens=1024)
    worker.observe_errors(1)
    names: set[str] = set()
    labels: set[str] = set()
    for registry in (api.registry, worker.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                names.add(sample.name)
                labels |= sample.labels.keys()
    return names, labels


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard, Grafana's variables given values so that it parses."""
    dashboard = json.loads((REPO / "deploy" / "grafana" / "ferry.json").read_text())
    panels = [*dashboard["panels"], *(p for row in dashboard["panels"] for p in row.get("panels", []))]
    queries = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    return [query.replace("$__rate_interval", "5m").replace("$model", ".*") for query in queries]


def test_the_dashboard_charts_only_exported_metrics_and_labels() -> None:
    names, labels = exported()
    job = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"][0]
    labels |= {rule["target_label"] for rule in job["relabel_configs"]  # the labels the scrape adds
               if "target_label" in rule and not rule["target_label"].startswith("__")}
    used_names, used_labels = set(), set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            used_names.add(node.name)
            used_labels.update(matcher.name for matcher in node.matchers.matchers)
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            used_labels.update(node.modifier.labels)

    queries = dashboard_queries()
    assert len(queries) >= 20
    for query in queries:
        promql_parser.walk(promql_parser.parse(query), visit)
    dashboard = json.loads((REPO / "deploy" / "grafana" / "ferry.json").read_text())
    for variable in (v for v in dashboard["templating"]["list"] if v["type"] == "query"):
        match = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"])
        assert match is not None, variable
        used_names.add(match.group(1))
        used_labels.add(match.group(2))
    assert used_names <= names, used_names - names
    assert used_labels <= labels, used_labels - labels
