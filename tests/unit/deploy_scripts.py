"""The image's scripts (deploy/docker: the entry point, the health check, the secrets init),
loaded from the checkout as the image installs them, for the deployment tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"pdserve_deploy_{name}", DOCKER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and annotations look their module up
    spec.loader.exec_module(module)
    return module


init_secrets = _load("init_secrets")
healthcheck = _load("healthcheck")


def run_entrypoint(env: Mapping[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``pdserve-entrypoint ARGV...`` with ``env`` (plus PATH), as a container starts it."""
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, str(ENTRYPOINT), *argv],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
