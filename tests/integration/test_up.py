"""``pdserve up`` as a person runs it: the banner names the router, the OpenAI-compatible HTTP
URL and every service's ``/metrics``, and each of them answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.client import Client
from tests.integration.up_process import UpProcess, pdserve_up

pytestmark = pytest.mark.integration

UP_ARGS = ("--port", "0", "--http-port", "0", "--worker-arg=--dtype=float32",
           "--worker-arg=--threads=1", "--worker-arg=--kv-blocks=256")  # fmt: skip


@pytest.fixture(scope="module")
def up(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    with pdserve_up(tiny_llama_dir, UP_ARGS, tmp_path_factory.mktemp("up-logs")) as running:
        yield running


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
