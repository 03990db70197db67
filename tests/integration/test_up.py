"""``pdserve up`` as a person runs it: the banner names the router, the OpenAI-compatible HTTP
URL and every service's ``/metrics``, and each of them answers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.client import Client
from tests.integration.up_process import UpProcess, pdserve_up

pytestmark = pytest.mark.integration

UP_ARGS = ("--port", "0", "--http-port", "0", "--worker-arg=--dtype=float32",
           "--worker-arg=--threads=1", "--worker-arg=--kv-blocks=256",
           "--gateway-arg=--allow-unknown-fields")  # fmt: skip


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's own runtime dir, where ``pdserve up`` publishes how to reach it."""
    return tmp_path_factory.mktemp("runtime")


@pytest.fixture(scope="module")
def up(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, runtime: Path
) -> Iterator[UpProcess]:
    logs = tmp_path_factory.mktemp("up-logs")
    env = {"PDSERVE_RUNTIME_DIR": str(runtime)}
    with pdserve_up(tiny_llama_dir, UP_ARGS, logs, env) as running:
        yield running


def test_a_bare_status_finds_the_running_cluster(up: UpProcess, runtime: Path) -> None:
    env = {**os.environ, "PDSERVE_RUNTIME_DIR": str(runtime)}
    env.pop("REDIS_URL", None)
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "status"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"pdserve up (pid {up.proc.pid}): router at {up.router}" in done.stdout
    roles = sorted(line.split()[1] for line in done.stdout.splitlines()[2:])
    assert roles == ["mixed", "prefill"]  # the default conditional cluster's two workers


def test_banner_names_every_endpoint(up: UpProcess) -> None:
    assert up.router and up.http_url is not None, "\n".join(up.banner)
    # The default cluster is conditional: a prefill worker and a mixed one.
    assert set(up.metrics) == {"kvstore", "scheduler", "prefill-0", "mixed-0", "router",
                               "gateway"}  # fmt: skip
    for url in up.metrics.values():
        assert "# TYPE" in httpx.get(url).text


def test_http_and_grpc_give_the_same_tokens(up: UpProcess, tiny_llama_dir: Path) -> None:
    assert up.http_url is not None
    with openai.OpenAI(base_url=f"{up.http_url}/v1", api_key="unused", max_retries=0) as oai:
        (model,) = oai.models.list().data
        assert model.id == tiny_llama_dir.name
        answer = oai.completions.create(
            model=model.id, prompt="Hello there", max_tokens=8, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
    with Client(up.router, timeout=60) as client:
        expected = client.generate("Hello there", max_tokens=8, temperature=0)
    assert answer.choices[0].model_extra is not None
    assert answer.choices[0].model_extra["token_ids"] == expected.token_ids
    assert answer.choices[0].text == expected.text


def test_gateway_args_reach_the_gateway(up: UpProcess) -> None:
    """``--gateway-arg=--allow-unknown-fields``: a field of a client's own is ignored, where
    the gateway's default is a 400 naming it."""
    assert up.http_url is not None
    body = {"prompt": "Hello there", "max_tokens": 2, "x_client_trace": "abc"}
    reply = httpx.post(f"{up.http_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
