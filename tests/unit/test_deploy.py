"""The compose file starts each service with flags that service really accepts."""

from __future__ import annotations

import importlib
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.scheduling import WorkerRole
from pdserve.worker.options import options_from_args, worker_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
WORKER_ROLES = {"services.prefill": WorkerRole.PREFILL, "services.decode": WorkerRole.DECODE}


def argv_of(command: list[str]) -> list[str]:
    """The argv a container runs; ``sh -c "exec ..."`` is unwrapped, $(hostname -i) faked."""
    if command[:2] == ["sh", "-c"]:
        line = command[2].replace('"$$(hostname -i)"', "10.0.0.7")
        args = shlex.split(line)
        return args[1:] if args[0] == "exec" else args
    return list(command)


PDSERVE_SERVICES = [n for n, s in SERVICES.items() if s.get("image") == "pdserve:latest"]


@pytest.mark.parametrize("name", PDSERVE_SERVICES)
def test_service_command_parses(name: str) -> None:
    argv = argv_of(SERVICES[name]["command"])
    if argv[:2] == ["python", "-m"]:
        module, args = argv[2], argv[3:]
        if module in WORKER_ROLES:
            parser = worker_parser(
                module, None, roles=[WORKER_ROLES[module]], default_max_wait_ms=0.0, env={}
            )
            options = options_from_args(parser.parse_args(args))
            assert options.role == WORKER_ROLES[module]
            assert options.kvstore is not None and options.kvstore.startswith("kvstore:")
            assert options.address(50070).startswith("10.0.0.7:")
        else:
            main = importlib.import_module(f"{module}.__main__")
            main.parse_args(args)
    else:  # model-init: `test -f ... || pdserve model init DIR --preset P`
        assert "pdserve model init /models/demo-small --preset small" in " ".join(argv)


def test_dependencies_exist() -> None:
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on") or {}
        for dep in deps:
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"


def test_workers_reach_redis_and_kvstore() -> None:
    env = COMPOSE["x-pdserve"]["environment"]
    assert env["PDSERVE_REDIS_URL"].startswith("redis://redis:")
    assert "--redis-url=redis://redis:6379/0" in SERVICES["scheduler"]["command"]
