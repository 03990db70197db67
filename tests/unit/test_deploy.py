"""docker-compose.yml and its overrides, checked without a container engine: each service runs
flags its service accepts, secured by default (TLS, mutual TLS and the token between members,
API keys at the router, HTTPS at the gateway, Redis with a password and protected mode, every
container unprivileged, host ports on 127.0.0.1), pdserve's scheduling on, Jaeger optional;
docker-compose.insecure.yml really turns the security off and docker-compose.ha.yml points every
service at Sentinel. Where ``docker-compose`` is installed it validates every combination and
must agree with the merge done here."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.scheduling.redis_url import parse_sentinel
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.worker.options import options_from_args, worker_parser
from tests.unit.deploy_scripts import ENTRYPOINT, init_secrets, run_entrypoint

ROOT = Path(__file__).resolve().parents[2]
BASE, INSECURE, HA = "docker-compose.yml", "docker-compose.insecure.yml", "docker-compose.ha.yml"
SECRETS = "/var/lib/pdserve/secrets"
WORKER_ROLES = {
    "services.prefill": [WorkerRole.PREFILL],
    "services.decode": [WorkerRole.DECODE, WorkerRole.MIXED],
}
MEMBERS = {"kvstore", "scheduler", "prefill", "decode", "router"}
"""Services that are cluster members (the gateway is a client; the planner a Redis client)."""
_VAR = re.compile(r"\$\{(\w+)(?::-([^${}]*))?\}")


def _interpolate(value: Any) -> Any:
    """Compose's ``${NAME:-default}`` with every variable unset (``$$`` stays escaped)."""
    if isinstance(value, str):
        while (new := _VAR.sub(lambda m: m.group(2) or "", value)) != value:
            value = new
        return value
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of an override's service: mappings merge, the rest is replaced."""
    out = dict(base)
    for key, value in override.items():
        merged = key in ("environment", "depends_on") and isinstance(out.get(key), dict)
        out[key] = {**out[key], **value} if merged else value
    return out


def compose(*files: str) -> dict[str, dict[str, Any]]:
    """The services of ``files`` merged in order, with every variable at its default."""
    services: dict[str, dict[str, Any]] = {}
    for name in files:
        for svc, spec in yaml.safe_load((ROOT / name).read_text())["services"].items():
            services[svc] = _merge(services.get(svc, {}), _interpolate(spec))
    return services


def argv_of(command: list[str]) -> list[str]:
    """The argv a container runs; ``sh -c "exec ..."`` is unwrapped, $(hostname -i) faked."""
    if command[:2] == ["sh", "-c"]:
        args = shlex.split(command[2].replace('"$$(hostname -i)"', "10.0.0.7"))
        return args[1:] if args[0] == "exec" else args
    return list(command)


def module_of(spec: dict[str, Any]) -> str | None:
    argv = argv_of(spec.get("command") or [])
    return argv[2] if argv[:2] == ["python", "-m"] else None


SERVICES = compose(BASE)
PDSERVE = [n for n, s in SERVICES.items() if s.get("image") == "pdserve:latest"]
PDSERVE_SERVICES = [n for n in PDSERVE if module_of(SERVICES[n])]


@pytest.mark.parametrize("files", [(BASE,), (BASE, INSECURE), (BASE, HA)])
@pytest.mark.parametrize("name", PDSERVE)
def test_service_command_parses(files: tuple[str, ...], name: str) -> None:
    argv = argv_of(compose(*files)[name]["command"])
    if argv[:2] == ["python", "-m"]:
        module, args = argv[2], argv[3:]
        if module in WORKER_ROLES:
            parser = worker_parser(
                module, None, roles=WORKER_ROLES[module], default_max_wait_ms=0.0, env={}
            )
            options = options_from_args(parser.parse_args(args))
            assert options.kvstore is not None and options.kvstore.startswith("kvstore:")
            assert options.address(50070).startswith("10.0.0.7:")
        else:
            importlib.import_module(f"{module}.__main__").parse_args(args)
    elif argv[:1] == ["mooncake_master"]:
        assert {a.split("=")[0] for a in argv[1:]} <= master_flags()
    elif argv[:1] == ["pdserve-init-secrets"]:
        init_secrets.parser().parse_args(argv[1:])
    elif argv != ["true"]:  # model-init: `test -f ... || pdserve model init DIR --preset P`
        assert "pdserve model init /models/demo-small --preset small" in " ".join(argv)


def test_dependencies_exist_and_jaeger_is_optional() -> None:
    for files in [(BASE,), (BASE, INSECURE), (BASE, HA)]:
        services = compose(*files)
        for name, svc in services.items():
            for dep in svc.get("depends_on") or {}:
                assert dep in services, f"{name} depends on unknown service {dep}"
                assert not services[dep].get("profiles"), f"{name} needs optional {dep}"
    assert SERVICES["jaeger"]["profiles"] == ["tracing"]
    assert SERVICES["mooncake-master"]["profiles"] == ["mooncake"]
    optional = [n for n, s in SERVICES.items() if s.get("profiles")]
    assert sorted(optional) == ["jaeger", "mooncake-master"]


def master_flags() -> set[str]:
    """The flags ``mooncake_master`` takes: those ``MasterProcess`` starts it with (run by the
    Mooncake tests), and, where the package is installed, every flag its ``--help`` lists."""
    from pdserve.kvstore.mooncake.library import available, load
    from pdserve.kvstore.mooncake.master import MasterProcess

    if available():
        pytest.skip(available())
    known = {a.split("=")[0] for a in MasterProcess().args()[1:]}
    shown = subprocess.run(
        [load().master_binary(), "--help"], capture_output=True, text=True, timeout=60
    )
    listed = set(re.findall(r"^\s+-(\w+) \(", shown.stdout + shown.stderr, re.M))
    assert {k.removeprefix("--") for k in known} <= listed
    return {f"--{f}" for f in listed}


def test_the_mooncake_profile_names_the_master_the_workers_are_pointed_at() -> None:
    command = SERVICES["mooncake-master"]["command"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in command[1:])
    assert flags["rpc_port"] == "50051" and flags["http_metadata_server_port"] == "8080"
    assert flags["enable_http_metadata_server"] == "true"
    raw = yaml.safe_load((ROOT / BASE).read_text())["services"]
    address = "mooncake://mooncake-master:50051?metadata=http://mooncake-master:8080/metadata"
    assert address in (ROOT / BASE).read_text()  # the usage line at the top
    for worker in ("prefill", "decode"):
        assert '--kvstore "${PDSERVE_KV_STORE:-kvstore:50060}"' in raw[worker]["command"][2]


def test_features_are_on_by_default() -> None:
    def flags(name: str) -> list[str]:
        return argv_of(SERVICES[name]["command"])

    assert {"--policy=kv_aware", "--default-mode=conditional"} <= set(flags("scheduler"))
    assert "--mode=conditional" in flags("router")
    decode, prefill = " ".join(flags("decode")), " ".join(flags("prefill"))
    assert "--role mixed" in decode and "--kvstore kvstore:50060" in decode  # switchable
    assert "--lane long" in prefill
    assert SERVICES["planner"]["scale"] == "1"
    planner = flags("planner")
    assert all(
        any(a.startswith(f"--{f}=") for a in planner)
        for f in ("min-prefill", "max-prefill", "min-decode", "max-decode")
    )


def test_members_run_with_tls_mutual_tls_and_the_token() -> None:
    hosts = {a.split("=", 1)[1] for a in SERVICES["certs-init"]["command"] if "--host=" in a}
    for name in PDSERVE_SERVICES:
        svc = SERVICES[name]
        env = svc["environment"]
        assert "PDSERVE_INSECURE" not in env, name
        assert f"secrets:{SECRETS}:ro" in svc["volumes"], name
        if name == "gateway":  # HTTPS, TLS to the router; no token (a client)
            assert env["PDSERVE_TLS_CERT"] and env["PDSERVE_ROUTER_TLS_CA"]
            assert "PDSERVE_INTERNAL_TOKEN_FILE" not in env
            continue
        if name == "planner":  # serves health only; reaches Redis with its password
            assert module_of(svc) == "services.planner"
            continue
        assert name in MEMBERS
        for var in ("CERT", "KEY", "CA"):
            assert env[f"PDSERVE_TLS_{var}"].startswith(f"{SECRETS}/tls/"), (name, var)
        assert env["PDSERVE_INTERNAL_TOKEN_FILE"] == f"{SECRETS}/tls/internal-token"
        assert env["PDSERVE_TLS_SERVER_NAME"] in hosts  # workers are called by their IP
        assert env["PDSERVE_TLS_CLIENT_AUTH"] == ("0" if name == "router" else "1"), name
    assert SERVICES["router"]["environment"]["PDSERVE_API_KEYS"] == f"{SECRETS}/api-keys.yaml"
    for name in ("router", "gateway", "scheduler", "kvstore"):
        assert name in hosts  # reached by their service name


def test_every_secret_path_is_a_file_certs_init_makes(tmp_path: Path) -> None:
    init_secrets.make_files(tmp_path, ["pdserve-cluster"])
    text = yaml.safe_dump([SERVICES, compose(BASE, HA)])  # commands, env, health checks
    paths = set(re.findall(re.escape(SECRETS) + r"/[\w./-]*\w", text))
    assert len(paths) >= 7
    for path in paths:
        assert (tmp_path / path.removeprefix(SECRETS + "/")).is_file(), path


def test_redis_demands_its_password_with_protected_mode_on() -> None:
    for files in [(BASE,), (BASE, HA)]:
        services = compose(*files)
        nodes = [n for n, s in services.items() if "redis-server" in " ".join(s.get("command", []))]
        assert len(nodes) == (5 if files == (BASE, HA) else 1)
        for name in nodes:
            line = " ".join(services[name]["command"])
            assert "--protected-mode no" not in line and "protected-mode yes" in line, name
            if "--sentinel" in line:  # its config made from the password file
                assert '"requirepass $$pw"' in line and f"{SECRETS}/redis-password" in line
            else:  # requirepass in the generated config file, never the command line
                assert services[name]["command"][1] == f"{SECRETS}/redis.conf", name
            assert "requirepass" not in " ".join(services[name]["command"][:2]), name
            assert "REDISCLI_AUTH" in services[name]["healthcheck"]["test"][1], name
    for name in PDSERVE_SERVICES:
        env = SERVICES[name]["environment"]
        assert env["PDSERVE_REDIS_URL"].startswith("redis://:{password}@redis:6379/")
        assert env["PDSERVE_REDIS_PASSWORD_FILE"] == f"{SECRETS}/redis-password"


def test_redis_command_runs_with_the_generated_config(tmp_path: Path) -> None:
    """The compose Redis command, run by a real redis-server: AUTH needed, the password
    from the generated file admitted."""
    redis = pytest.importorskip("redis")
    from pdserve.deathsig import free_port
    from pdserve.redis_server import find_redis_server

    init_secrets.make_files(tmp_path, [])
    argv = [a.replace(SECRETS, str(tmp_path)) for a in SERVICES["redis"]["command"]]
    port = free_port("127.0.0.1")
    argv = [str(find_redis_server()), *argv[1:], "--port", str(port), "--bind", "127.0.0.1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        password = (tmp_path / "redis-password").read_text().strip()
        authed = redis.Redis(port=port, password=password, socket_timeout=2)
        for _ in range(200):  # until it accepts connections (no sleep: PING times out)
            try:
                assert authed.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server exited"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2).ping()
        assert authed.config_get("protected-mode") == {"protected-mode": "yes"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_containers_are_unprivileged_and_ports_bind_localhost() -> None:
    for name, svc in {**SERVICES, **compose(BASE, HA)}.items():
        user = str(svc.get("user", ""))
        assert user and user.split(":")[0] not in ("0", "root"), name
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


def test_insecure_override_turns_security_off_loudly() -> None:
    services = compose(BASE, INSECURE)
    for name in PDSERVE_SERVICES:
        env = services[name]["environment"]
        assert env["PDSERVE_INSECURE"] == "1", name
        result = run_entrypoint(env, "env")
        assert "INSECURE (PDSERVE_INSECURE=1)" in result.stderr, name
        seen = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
        dropped = ("PDSERVE_TLS_", "PDSERVE_ROUTER_TLS_", "PDSERVE_INTERNAL_TOKEN", "PDSERVE_API_")
        assert not [k for k in seen if k.startswith(dropped)], name
        assert seen["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
    line = " ".join(services["redis"]["command"])
    assert "--protected-mode no" in line and "redis.conf" not in line
    assert argv_of(services["certs-init"]["command"]) == ["true"]


def test_secure_entrypoint_keeps_tls_and_fills_the_redis_password(tmp_path: Path) -> None:
    (tmp_path / "redis-password").write_text("s3cret\n")
    for files in [(BASE,), (BASE, HA)]:
        env = {
            **compose(*files)["scheduler"]["environment"],
            "PDSERVE_REDIS_PASSWORD_FILE": str(tmp_path / "redis-password"),
        }
        result = run_entrypoint(env, "env")
        assert result.returncode == 0 and "INSECURE" not in result.stderr
        seen = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
        assert seen["PDSERVE_TLS_CERT"] == env["PDSERVE_TLS_CERT"]
        assert "{password}" not in seen["PDSERVE_REDIS_URL"]
        assert seen["REDIS_URL"] == seen["PDSERVE_REDIS_URL"]
        assert ":s3cret@" in seen["PDSERVE_REDIS_URL"]


def test_ha_override_points_every_service_at_three_sentinels() -> None:
    services = compose(BASE, HA)
    sentinels = [n for n, s in services.items() if "--sentinel" in " ".join(s.get("command", []))]
    assert sorted(sentinels) == ["sentinel-1", "sentinel-2", "sentinel-3"]
    for name in sentinels:
        script = services[name]["command"][2]
        assert "sentinel monitor pdserve redis 6379 2" in script
        assert '"requirepass $$pw"' in script and '"sentinel auth-pass pdserve $$pw"' in script
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 :][:2] == ["redis", "6379"]
    for name in PDSERVE_SERVICES:
        url = services[name]["environment"]["PDSERVE_REDIS_URL"].replace("{password}", "pw")
        target = parse_sentinel(url)
        assert sorted(h for h, _ in target.sentinels) == sorted(sentinels)
        assert target.service == "pdserve" and target.password == "pw"
        assert target.sentinel_password == "pw"
        assert set(sentinels) <= set(services[name]["depends_on"])


DOCKER_COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose is not installed "
    "(Debian: apt-get install docker-compose; no daemon needed)",
)
@pytest.mark.parametrize("files", [(BASE,), (BASE, INSECURE), (BASE, HA)])
def test_docker_compose_validates_and_agrees(files: tuple[str, ...]) -> None:
    assert DOCKER_COMPOSE is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "OTEL_"))}
    argv = [DOCKER_COMPOSE, *(a for f in files for a in ("-f", f)), "config"]
    out = subprocess.run(
        argv, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=120
    ).stdout
    theirs = yaml.safe_load(out)["services"]
    ours = compose(*files)
    assert set(theirs) == set(ours)
    for name, svc in ours.items():
        assert theirs[name].get("command") == svc.get("command"), name
        assert theirs[name].get("environment", {}) == svc.get("environment", {}), name
        assert set(theirs[name].get("depends_on", {})) == set(svc.get("depends_on", {})), name


def test_entrypoint_refuses_a_password_placeholder_without_its_file() -> None:
    result = run_entrypoint({"PDSERVE_REDIS_URL": "redis://:{password}@redis:6379/0"}, "true")
    assert result.returncode == 64
    assert "PDSERVE_REDIS_PASSWORD_FILE" in result.stderr
    assert ENTRYPOINT.is_file()
