"""``TopLogprobs`` and ``PromptLogprobs`` (``pdserve.logprobs``) to and from their messages.

Readers check that the parallel lists agree in length and raise ``InvalidArgumentError``
naming the field otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.errors import InvalidArgumentError
from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.v1 import common_pb2 as pb
from pdserve.v1 import decode_pb2, prefill_pb2


def top_to_proto(top: TopLogprobs) -> pb.TopLogprobs:
    return pb.TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


def tops_to_proto(tops: Iterable[TopLogprobs]) -> list[pb.TopLogprobs]:
    return [top_to_proto(t) for t in tops]


def top_from_proto(msg: pb.TopLogprobs, *, field: str = "top_logprobs") -> TopLogprobs:
    if len(msg.token_ids) != len(msg.logprobs):
        raise InvalidArgumentError(field, "token_ids and logprobs differ in length")
    return TopLogprobs(tuple(msg.token_ids), tuple(msg.logprobs))


def tops_from_proto(
    msgs: Sequence[pb.TopLogprobs], *, field: str = "top_logprobs"
) -> list[TopLogprobs]:
    return [top_from_proto(m, field=f"{field}[{i}]") for i, m in enumerate(msgs)]


def prompt_to_proto(prompt: PromptLogprobs) -> pb.PromptLogprobs:
    return pb.PromptLogprobs(
        token_ids=prompt.token_ids,
        logprobs=prompt.logprobs,
        ranks=prompt.ranks,
        top=tops_to_proto(prompt.top),
    )


def prompt_from_proto(msg: pb.PromptLogprobs, *, field: str = "prompt_logprobs") -> PromptLogprobs:
    n = len(msg.token_ids) - 1
    if len(msg.logprobs) != n or len(msg.ranks) != n or len(msg.top) not in (0, n):
        raise InvalidArgumentError(
            field, f"{len(msg.token_ids)} prompt tokens need {n} logprobs, ranks (and tops)"
        )
    return PromptLogprobs(
        token_ids=list(msg.token_ids),
        logprobs=list(msg.logprobs),
        ranks=list(msg.ranks),
        top=tops_from_proto(msg.top, field=f"{field}.top"),
    )


def prefill_logprobs(
    msg: prefill_pb2.PrefillResponse,
) -> tuple[list[TopLogprobs], PromptLogprobs | None]:
    """The first token's alternatives (none when not asked) and the prompt's logprobs."""
    tops = []
    if msg.HasField("first_top_logprobs"):
        tops.append(top_from_proto(msg.first_top_logprobs, field="first_top_logprobs"))
    prompt = None
    if msg.HasField("prompt_logprobs"):
        prompt = prompt_from_proto(msg.prompt_logprobs)
    return tops, prompt


def chunk_logprobs(
    msg: decode_pb2.DecodeChunk,
) -> tuple[list[TopLogprobs], PromptLogprobs | None]:
    """A worker chunk's alternatives and (a mixed worker's first chunk) prompt logprobs."""
    if msg.top_logprobs and len(msg.top_logprobs) != len(msg.token_ids):
        raise InvalidArgumentError("top_logprobs", "one entry per token, or none")
    prompt = prompt_from_proto(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None
    return tops_from_proto(msg.top_logprobs), prompt
