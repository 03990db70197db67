"""deploy/k8s, validated offline for both overlays (dev: open, one replica; production:
secured, Redis under Sentinel): ``kubectl kustomize`` renders it, every object passes the
Kubernetes API schema (``kubernetes-validate``, strict), and the objects fit together: each
container runs flags its service accepts, probes its own port, has resources and runs
unprivileged; disruption budgets and autoscalers point at workloads that exist. In production
no pdserve container runs without TLS, mutual TLS and the token, no Redis without its password
and protected mode, the Secrets the pods mount are the ones the Job creates, and network
policies leave only the gateway and the router reachable from outside the namespace."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.scheduling.redis_url import parse_sentinel
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.security.certs import make_certs
from pdserve.telemetry.metrics import QUEUE_DEPTH
from pdserve.worker.options import options_from_args, worker_parser
from tests.unit.deploy_scripts import healthcheck, init_secrets

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not installed (Debian: apt-get install kubernetes-client, or the "
    "kubectl package of Kubernetes' own apt repository)",
)
OVERLAYS = ("dev", "production")
PDSERVE = {"kvstore", "scheduler", "planner", "router", "gateway", "prefill", "decode"}
WORKERS = {"prefill": [WorkerRole.PREFILL], "decode": [WorkerRole.DECODE, WorkerRole.MIXED]}
SECRETS = "/var/lib/pdserve/secrets"
Objects = list[dict[str, Any]]


def render(path: Path) -> Objects:
    assert KUBECTL is not None
    rendered = subprocess.run(
        [KUBECTL, "kustomize", str(path)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> Objects:
    return render(K8S / "overlays" / request.param)


@pytest.fixture(scope="module")
def production() -> Objects:
    return render(K8S / "overlays" / "production")


def of_kind(objects: Objects, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: Objects) -> dict[str, dict[str, Any]]:
    return {**of_kind(objects, "Deployment"), **of_kind(objects, "StatefulSet")}


def pods(objects: Objects) -> dict[str, dict[str, Any]]:
    """Every pod template: workloads and Jobs."""
    return {
        n: o["spec"]["template"]
        for n, o in {**workloads(objects), **of_kind(objects, "Job")}.items()
    }


def env_of(objects: Objects, container: dict[str, Any]) -> dict[str, str]:
    """The environment a container gets from its ConfigMaps and literal values (a Secret's
    variables: ``<secret NAME>``)."""
    maps = {n: m.get("data", {}) for n, m in of_kind(objects, "ConfigMap").items()}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(maps[source["configMapRef"]["name"]])
        else:
            env[f"<secret {source['secretRef']['name']}>"] = "*"
    for var in container.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else f"<{next(iter(var['valueFrom']))}>"
    return env


def argv_of(objects: Objects, container: dict[str, Any]) -> list[str]:
    """The container's argv (``args``: the image's entry point stays), $(VAR) expanded."""
    assert "command" not in container or container["name"] in ("redis", "sentinel")
    env = {**env_of(objects, container), "POD_IP": "10.1.2.3"}
    expand = lambda a: re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a)  # noqa: E731
    return [expand(a) for a in [*container.get("command", []), *container.get("args", [])]]


def test_every_object_matches_the_api_schema(objects: Objects) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {
        "pdserve"
    }


def test_the_default_is_the_production_overlay(production: Objects) -> None:
    assert render(K8S) == production


def test_components_and_services(objects: Objects) -> None:
    assert set(workloads(objects)) == PDSERVE | {"redis"}
    services = of_kind(objects, "Service")
    assert set(services) == {"kvstore", "scheduler", "router", "gateway", "redis"}
    for name, svc in services.items():  # workers are found through Redis, by pod IP
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": name}


def _port(argv: list[str]) -> int:
    return int(next(a.split("=", 1)[1] for a in argv if a.startswith("--port=")))


def test_containers_run_real_flags_probe_their_port_and_have_resources(objects: Objects) -> None:
    for name, pod in pods(objects).items():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            resources = container["resources"]
            assert "cpu" in resources["requests"] and "memory" in resources["limits"], name
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, name
    for name, deployment in of_kind(objects, "Deployment").items():
        pod = deployment["spec"]["template"]
        assert (
            deployment["spec"]["selector"]["matchLabels"].items()
            <= pod["metadata"]["labels"].items()
        )
        if name == "redis":
            continue
        (container,) = pod["spec"]["containers"]
        argv = argv_of(objects, container)
        assert argv[:2] == ["python", "-m"], name
        module, args = argv[2], argv[3:]
        kind = healthcheck.KINDS.get(module, "grpc")
        assert container["readinessProbe"]["exec"]["command"] == [
            "pdserve-healthcheck",
            kind,
            str(_port(args)),
        ], name
        assert "livenessProbe" in container, name
        if name in WORKERS:
            parser = worker_parser(
                module, None, roles=WORKERS[name], default_max_wait_ms=0.0, env={}
            )
            options = options_from_args(parser.parse_args(args))
            assert options.address(_port(args)) == f"10.1.2.3:{_port(args)}"
            assert options.kvstore == "kvstore:50060"
            assert container["startupProbe"]["exec"] == container["readinessProbe"]["exec"]
        else:
            importlib.import_module(f"{module}.__main__").parse_args(args)
        assert 9100 in {p["containerPort"] for p in container["ports"]}  # PDSERVE_METRICS_PORT
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9100"
        assert container["envFrom"][0] == {"configMapRef": {"name": "pdserve-env"}}


def test_features_are_on_by_default(objects: Objects) -> None:
    env = of_kind(objects, "ConfigMap")["pdserve-env"]["data"]
    assert env["PDSERVE_METRICS_PORT"] == "9100"
    deployments = of_kind(objects, "Deployment")

    def argv(name: str) -> list[str]:
        return argv_of(objects, deployments[name]["spec"]["template"]["spec"]["containers"][0])

    assert {"--policy=kv_aware", "--default-mode=conditional"} <= set(argv("scheduler"))
    assert "--mode=conditional" in argv("router")
    assert "--role=mixed" in argv("decode") and "--lane=long" in argv("prefill")
    assert {"--min-prefill=1", "--min-decode=1"} <= set(argv("planner"))


def test_budgets_and_autoscalers_point_at_workloads(objects: Objects) -> None:
    budgets, scalers = (
        of_kind(objects, "PodDisruptionBudget"),
        of_kind(objects, "HorizontalPodAutoscaler"),
    )
    production = "pdserve-tls" in of_kind(objects, "ConfigMap")
    assert set(budgets) == ((PDSERVE | {"redis"}) - {"kvstore"} if production else set())
    for budget in budgets.values():
        labels = budget["spec"]["selector"]["matchLabels"]
        matched = [
            w
            for w in workloads(objects).values()
            if labels.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1
    assert set(scalers) == (set(WORKERS) if production else set())
    for name, hpa in scalers.items():
        assert hpa["spec"]["scaleTargetRef"]["name"] == name and name in workloads(objects)
        (metric,) = hpa["spec"]["metrics"]
        assert metric["pods"]["metric"]["name"] == QUEUE_DEPTH


def test_dev_is_open_and_says_so() -> None:
    objects = render(K8S / "overlays" / "dev")
    maps = of_kind(objects, "ConfigMap")
    assert maps["pdserve-env"]["data"]["PDSERVE_INSECURE"] == "1"
    assert "pdserve-tls" not in maps and not of_kind(objects, "NetworkPolicy")
    assert {d["spec"]["replicas"] for d in workloads(objects).values()} == {1}


def _mounted_files(objects: Objects, pod: dict[str, Any], container: dict[str, Any]) -> set[str]:
    """Paths of the Secret files ``container`` mounts (each Secret's keys, or its items)."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    files: set[str] = set()
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is not None:
            keys = [i["path"] for i in secret.get("items", [])] or SECRET_KEYS[secret["secretName"]]
            files |= {f"{mount['mountPath']}/{key}" for key in keys}
    return files


SECRET_KEYS: dict[str, list[str]] = {}


@pytest.fixture(scope="module")
def job_secrets(production: Objects, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Secrets the Job creates, made by its own code from its own arguments."""
    (job,) = of_kind(production, "Job").values()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    args = init_secrets.parser().parse_args(argv_of(production, container)[1:])
    tls = make_certs(tmp_path_factory.mktemp("tls")).dir
    made = {
        s["metadata"]["name"]: s
        for s in init_secrets.kubernetes_secrets(tls, args.redis_url_template)
    }
    SECRET_KEYS.update({name: sorted(s["data"]) for name, s in made.items()})
    return {"args": args, "secrets": made, "job": job}


def test_production_runs_every_member_with_tls_and_the_token(
    production: Objects, job_secrets: dict[str, Any]
) -> None:
    for name in PDSERVE:
        pod = of_kind(production, "Deployment")[name]["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        env = env_of(production, container)
        assert "PDSERVE_INSECURE" not in env and "PDSERVE_REDIS_URL" not in env, name
        assert "<secret pdserve-redis-url>" in env, name  # the password from a Secret
        if name == "planner":  # a Redis client; serves plaintext health only
            continue
        files = _mounted_files(production, pod, container)
        wanted = ("PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY")
        wanted += (
            ("PDSERVE_ROUTER_TLS_CA",)
            if name == "gateway"
            else ("PDSERVE_TLS_CA", "PDSERVE_INTERNAL_TOKEN_FILE")
        )
        for var in wanted:
            assert env[var] in files, (name, var)
        if name != "gateway":
            assert env["PDSERVE_TLS_CLIENT_AUTH"] == ("0" if name == "router" else "1"), name
            assert env["PDSERVE_TLS_SERVER_NAME"] in job_secrets["args"].host
        if name in ("router", "scheduler"):
            assert env["PDSERVE_API_KEYS"] in files, name


def test_production_secrets_are_the_jobs_and_it_may_only_create_them(
    production: Objects, job_secrets: dict[str, Any]
) -> None:
    used = {
        v["secret"]["secretName"]
        for pod in pods(production).values()
        for v in pod["spec"].get("volumes", [])
        if "secret" in v
    }
    used |= {
        s["secretRef"]["name"]
        for pod in pods(production).values()
        for c in pod["spec"]["containers"]
        for s in c.get("envFrom", [])
        if "secretRef" in s
    }
    assert used == set(job_secrets["secrets"])
    services = set(of_kind(production, "Service")) - {"redis"}
    assert set(job_secrets["args"].service) == services
    (role,) = of_kind(production, "Role").values()
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    (binding,) = of_kind(production, "RoleBinding").values()
    sa = job_secrets["job"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "pdserve"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    for name, pod in pods(production).items():
        if name != "pdserve-secrets":
            assert pod["spec"]["automountServiceAccountToken"] is False, name


def test_production_redis_is_sentinel_with_passwords(
    production: Objects, job_secrets: dict[str, Any]
) -> None:
    redis = of_kind(production, "StatefulSet")["redis"]
    assert redis["spec"]["replicas"] == 3 and "redis" not in of_kind(production, "Deployment")
    scripts = of_kind(production, "ConfigMap")["redis-scripts"]["data"]
    node, sentinel = scripts["node.sh"], scripts["sentinel.sh"]
    assert "/etc/pdserve-redis/redis.conf --protected-mode yes" in node
    assert "'protected-mode yes'" in sentinel and '"requirepass $pw"' in sentinel
    assert "sentinel monitor pdserve $master 6379 2" in sentinel
    assert "protected-mode no" not in "".join(scripts.values())
    containers = redis["spec"]["template"]["spec"]["containers"]
    assert [c["command"] for c in containers] == [
        ["sh", "/scripts/node.sh"],
        ["sh", "/scripts/sentinel.sh"],
    ]
    for c in containers:
        assert "/etc/pdserve-redis/password" in _mounted_files(
            production, redis["spec"]["template"], c
        )
    url = job_secrets["args"].redis_url_template.replace("{password}", "pw")
    target = parse_sentinel(url)
    assert target.service == "pdserve" and target.password == target.sentinel_password == "pw"
    headless = of_kind(production, "Service")["redis"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert {h for h, _ in target.sentinels} == {f"redis-{i}.redis" for i in range(3)}
    assert {p for _, p in target.sentinels} == {
        p["port"] for p in headless["ports"] if p["name"] == "sentinel"
    }


def test_production_network_policies_admit_outsiders_to_gateway_and_router_only(
    production: Objects,
) -> None:
    policies = of_kind(production, "NetworkPolicy")
    deny = [
        p
        for p in policies.values()
        if p["spec"]["podSelector"] == {}
        and p["spec"]["policyTypes"] == ["Ingress"]
        and not p["spec"].get("ingress")
    ]
    assert deny, "no default-deny ingress policy"
    public = {"gateway": {8000}, "router": {50051}}
    for name, policy in policies.items():
        selected = policy["spec"]["podSelector"].get("matchLabels", {})
        for rule in policy["spec"].get("ingress", []):
            sources = rule.get("from", [])
            inside = sources and all(set(s) == {"podSelector"} for s in sources)
            if inside:
                continue
            ports = {p["port"] for p in rule.get("ports", [])}
            target = selected.get("app.kubernetes.io/name")
            assert ports and (ports <= public.get(target, set()) or ports == {9100}), name


def test_production_spreads_workers_over_nodes(production: Objects) -> None:
    for name in WORKERS:
        spec = of_kind(production, "Deployment")[name]["spec"]["template"]["spec"]
        (spread,) = spec["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["labelSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}


def test_the_mooncake_component_runs_a_master_and_points_the_workers_at_it() -> None:
    """overlays/mooncake (dev with components/mooncake): the objects pass the schema, the
    master runs flags mooncake_master takes and is probed on its RPC port, and every worker's
    --kvstore is a Mooncake address naming the master's Service and ports."""
    from pdserve.kvstore.mooncake.address import MooncakeAddress
    from tests.unit.test_deploy import master_flags

    objects = render(K8S / "overlays" / "mooncake")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "pdserve"
    deployments = of_kind(objects, "Deployment")
    (master,) = deployments["mooncake-master"]["spec"]["template"]["spec"]["containers"]
    argv = argv_of(objects, master)
    assert argv[0] == "mooncake_master"
    assert {a.split("=")[0] for a in argv[1:]} <= master_flags()
    flags = dict(a.removeprefix("--").split("=", 1) for a in argv[1:])
    ports = {p["name"]: p["containerPort"] for p in master["ports"]}
    assert (ports["rpc"], ports["metadata"]) == (
        int(flags["rpc_port"]), int(flags["http_metadata_server_port"]),
    )  # fmt: skip
    assert master["readinessProbe"]["tcpSocket"]["port"] == "rpc"
    service = of_kind(objects, "Service")["mooncake-master"]
    assert {p["port"] for p in service["spec"]["ports"]} == {ports["rpc"], ports["metadata"]}
    for name, roles in WORKERS.items():
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        args = argv_of(objects, container)[3:]
        parser = worker_parser(name, None, roles=roles, default_max_wait_ms=0.0, env={})
        options = options_from_args(parser.parse_args(args))
        assert options.kvstore is not None
        address = MooncakeAddress.parse(options.kvstore)
        assert address.master == f"mooncake-master:{ports['rpc']}"
        assert address.metadata == f"http://mooncake-master:{ports['metadata']}/metadata"
