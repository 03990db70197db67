"""A router stand-in on a real gRPC socket, with the router's own API-key check.

It serves the Router service as far as the gateway's unit tests need: ``GetModelInfo`` (the
gateway's key check), and ``GenerateUnary``/``Generate`` answering one token ``ok`` (id 7, logprob
-0.5, finish ``length``) to any request, or the pieces of ``reply`` (ids 7, 8, ...; streamed one
chunk each) with ``finish``: with ``sampling.logprobs = k`` a token's alternatives are its id
and the next ones (logprobs -0.5, -1.5, ...), with ``prompt_logprobs = k`` every prompt token after
the first has logprob -2 and rank 2 and alternatives ids 20, 21, ... (a text prompt's ids are
1 and then 100, 101, ... per word). Keys are checked by the real ``AuthInterceptor`` over a real
``ApiKeys``; ``max_receive_bytes`` sets gRPC's own bound on a request message, whose refusal
("Received message larger than max") is RESOURCE_EXHAUSTED, as at the real router. Calls are
counted per method.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.security.apikeys import ApiKeys
from pdserve.security.auth import AuthInterceptor
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

KEY = "k-unit-test-0123456789"


@dataclass
class StubRouter(router_pb2_grpc.RouterServicer):
    max_model_len: int
    max_prompt_tokens: int
    calls: Counter[str] = field(default_factory=Counter)
    requests: list[router_pb2.GenerateRequest] = field(default_factory=list)
    reply: list[str] = field(default_factory=lambda: ["ok"])
    """The answer's text, one token a piece."""
    finish: int = common_pb2.FINISH_REASON_LENGTH

    async def GetModelInfo(self, request: Any, context: Any) -> router_pb2.ModelInfo:  # noqa: N802
        self.calls["GetModelInfo"] += 1
        return router_pb2.ModelInfo(
            max_model_len=self.max_model_len, max_prompt_tokens=self.max_prompt_tokens,
            tenant="t",
        )  # fmt: skip

    def _usage(self, request: router_pb2.GenerateRequest) -> common_pb2.Usage:
        prompt = len(request.token_ids.ids) or len(request.text.split())
        return common_pb2.Usage(prompt_tokens=prompt, completion_tokens=len(self.reply))

    def _answer(self, request: router_pb2.GenerateRequest) -> dict[str, Any]:
        sampling = request.sampling
        k = sampling.logprobs
        ids = [7 + i for i in range(len(self.reply))]
        out: dict[str, Any] = {
            "text": "".join(self.reply), "token_ids": ids, "logprobs": [-0.5] * len(ids),
            "usage": self._usage(request), "finish_reason": self.finish,
            "request_id": request.request_id,
        }  # fmt: skip
        if k:
            out["top_logprobs"] = [_top(i, k, -0.5) for i in ids]
        if sampling.HasField("prompt_logprobs"):
            ids = list(request.token_ids.ids) or [1, *range(100, 100 + len(request.text.split()))]
            n, pk = len(ids) - 1, sampling.prompt_logprobs
            out["prompt_logprobs"] = common_pb2.PromptLogprobs(
                token_ids=ids, logprobs=[-2.0] * n, ranks=[2] * n,
                top=[_top(20, pk, -1.0) for _ in range(n)] if pk else [],
            )  # fmt: skip
        return out

    async def GenerateUnary(self, request: Any, context: Any) -> router_pb2.GenerateResponse:  # noqa: N802
        self.calls["GenerateUnary"] += 1
        self.requests.append(request)
        return router_pb2.GenerateResponse(**self._answer(request))

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        self.calls["Generate"] += 1
        self.requests.append(request)
        whole = self._answer(request)
        last = len(self.reply) - 1
        for i, piece in enumerate(self.reply):
            chunk = {"text": piece, "token_ids": whole["token_ids"][i : i + 1], "logprobs": [-0.5]}
            if "top_logprobs" in whole:
                chunk["top_logprobs"] = whole["top_logprobs"][i : i + 1]
            if i == 0:
                chunk.update({k: v for k, v in whole.items()
                              if k in ("request_id", "prompt_logprobs")})  # fmt: skip
            if i == last:
                chunk.update(usage=whole["usage"], finish_reason=whole["finish_reason"])
            yield router_pb2.GenerateChunk(**chunk)


def _top(first: int, k: int, best: float) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(
        token_ids=list(range(first, first + k)), logprobs=[best - i for i in range(k)]
    )


async def start_stub(
    stub: StubRouter, *, keys: bool = True, max_receive_bytes: int = 4 * 1024 * 1024
) -> tuple[grpc.aio.Server, str]:
    """Serve ``stub`` on a free loopback port; (server, address)."""
    interceptors = [AuthInterceptor(ApiKeys.parse({"keys": {KEY: "t"}}))] if keys else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", max_receive_bytes)],
    )
    router_pb2_grpc.add_RouterServicer_to_server(stub, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
