"""The Router service's answers as the client SDK reads them: ``GenerateChunk`` -> ``Delta``,
``GenerateResponse`` -> ``Completion``, ``Usage`` -> ``Usage``, ``ModelInfo`` -> ``ModelInfo``
(``pdserve.client.results``).

The server's side of the same messages is ``adapters.router``."""

from __future__ import annotations

from typing import TypeVar

from pdserve.client.results import Completion, Delta, ModelInfo, Usage
from pdserve.convert.common import finish_reason_name, timing_from_proto
from pdserve.convert.logprobs import prompt_from_proto, tops_from_proto
from pdserve.v1 import common_pb2, router_pb2


def usage_from_proto(msg: common_pb2.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens)


_Result = TypeVar("_Result", Delta, Completion)


def _read(
    result: type[_Result], msg: router_pb2.GenerateChunk | router_pb2.GenerateResponse
) -> _Result:
    # The two messages carry the same fields, as do the two results.
    return result(
        text=msg.text,
        token_ids=list(msg.token_ids),
        logprobs=list(msg.logprobs),
        finish_reason=finish_reason_name(msg.finish_reason),
        usage=usage_from_proto(msg.usage) if msg.HasField("usage") else None,
        timing=timing_from_proto(msg.timing) if msg.HasField("timing") else None,
        request_id=msg.request_id,
        top_logprobs=tops_from_proto(msg.top_logprobs),
        prompt_logprobs=(
            prompt_from_proto(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None
        ),
    )


def delta_from_proto(msg: router_pb2.GenerateChunk) -> Delta:
    """One streamed ``Router.Generate`` chunk."""
    return _read(Delta, msg)


def completion_from_proto(msg: router_pb2.GenerateResponse) -> Completion:
    """The ``Router.GenerateUnary`` answer."""
    return _read(Completion, msg)


def model_info_from_proto(msg: router_pb2.ModelInfo) -> ModelInfo:
    """The ``Router.GetModelInfo`` answer."""
    return ModelInfo(msg.max_model_len, msg.max_prompt_tokens, msg.tenant)
