"""deploy/k8s, validated offline: ``kubectl kustomize`` renders it, every object passes the
Kubernetes API schema (``kubernetes-validate``, strict), and the objects fit together: each
container runs flags its service accepts, probes its own port, has resources; disruption
budgets and autoscalers point at Deployments that exist."""

from __future__ import annotations

import importlib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.scheduling import WorkerRole
from pdserve.telemetry.metrics import QUEUE_DEPTH
from pdserve.worker.options import options_from_args, worker_parser

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not installed (Debian: apt-get install kubernetes-client, or the "
    "kubectl package of Kubernetes' own apt repository)",
)
COMPONENTS = {"redis", "kvstore", "scheduler", "router", "gateway", "prefill", "decode"}
WORKERS = {"prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}
ENV = {"$(POD_IP)": "10.1.2.3", "$(PDSERVE_REDIS_URL)": "redis://redis:6379/0"}


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    assert KUBECTL is not None
    rendered = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / "deploy" / "k8s")],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def of_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_every_object_matches_the_api_schema(objects: list[dict[str, Any]]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {
        "pdserve"
    }


def test_components_and_services(objects: list[dict[str, Any]]) -> None:
    deployments = of_kind(objects, "Deployment")
    assert set(deployments) == COMPONENTS
    services = of_kind(objects, "Service")
    assert set(services) == COMPONENTS - set(WORKERS)  # workers are found through Redis
    for name, svc in services.items():
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": name}


def _argv(container: dict[str, Any]) -> list[str]:
    argv = [*container.get("command", []), *container.get("args", [])]
    for ref, value in ENV.items():
        argv = [a.replace(ref, value) for a in argv]
    return argv


def _port(argv: list[str]) -> int:
    return int(next(a.split("=", 1)[1] for a in argv if a.startswith("--port=")))


def test_containers_run_real_flags_probe_their_port_and_have_resources(
    objects: list[dict[str, Any]],
) -> None:
    for name, deployment in of_kind(objects, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= (
            deployment["spec"]["template"]["metadata"]["labels"].items()
        )
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            resources = container["resources"]
            assert "cpu" in resources["requests"] and "memory" in resources["limits"], name
        (container,) = pod["containers"]
        assert "readinessProbe" in container and "livenessProbe" in container, name
        if name == "redis":
            continue
        argv = _argv(container)
        assert argv[:2] == ["python", "-m"]
        module, args = argv[2], argv[3:]
        if module == "services.gateway":
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        else:
            assert container["readinessProbe"]["grpc"]["port"] == _port(args), name
        if name in WORKERS:
            parser = worker_parser(
                module, None, roles=[WORKERS[name]], default_max_wait_ms=0.0, env={}
            )
            options = options_from_args(parser.parse_args(args))
            assert options.role is WORKERS[name]
            assert options.address(_port(args)) == f"10.1.2.3:{_port(args)}"
            assert options.kvstore == "kvstore:50060"
        else:
            importlib.import_module(f"{module}.__main__").parse_args(args)
        ports = {p["containerPort"] for p in container["ports"]}
        assert 9100 in ports  # PDSERVE_METRICS_PORT
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == "9100"


def test_config_map_feeds_every_pdserve_container(objects: list[dict[str, Any]]) -> None:
    (config,) = of_kind(objects, "ConfigMap").values()
    assert config["data"]["PDSERVE_METRICS_PORT"] == "9100"
    assert config["data"]["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
    for name, deployment in of_kind(objects, "Deployment").items():
        if name == "redis":
            continue
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            refs = [e["configMapRef"]["name"] for e in container["envFrom"]]
            assert refs == [config["metadata"]["name"]]


def test_budgets_and_autoscalers_point_at_deployments(objects: list[dict[str, Any]]) -> None:
    deployments = of_kind(objects, "Deployment")
    budgets = of_kind(objects, "PodDisruptionBudget")
    assert set(budgets) == {"router", "gateway", "scheduler", "prefill", "decode"}
    for budget in budgets.values():
        labels = budget["spec"]["selector"]["matchLabels"]
        matched = [
            d for d in deployments.values()
            if labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert len(matched) == 1
    scalers = of_kind(objects, "HorizontalPodAutoscaler")
    assert set(scalers) == set(WORKERS)
    for name, hpa in scalers.items():
        assert hpa["spec"]["scaleTargetRef"]["name"] == name and name in deployments
        (metric,) = hpa["spec"]["metrics"]
        assert metric["pods"]["metric"]["name"] == QUEUE_DEPTH
