"""Conversions of the messages every service shares: sampling, token ids, enums, usage, timing.

Every function that reads a message validates it: a bad value raises
``InvalidArgumentError`` whose ``field`` is the dotted path of the offending proto field
(``sampling.max_tokens``), so a gRPC caller learns exactly what to fix. Proto3 enums are open
(an unknown number survives parsing), so enum readers reject numbers the schema does not name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from pdserve.engine.guide import Guide, GuideKind
from pdserve.engine.outputs import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.timing import Timing
from pdserve.v1 import common_pb2 as pb
from pdserve.v1 import prefill_pb2

_FINISH_TO_PROTO: dict[FinishReason, pb.FinishReason] = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PROTO.items()}

# Wire value -> the lower-case name clients see ("stop", "length", "abort", "error").
FINISH_REASON_NAMES: dict[int, str] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}

MODE_NAMES: dict[pb.Mode, str] = {
    pb.MODE_UNSPECIFIED: "unspecified",
    pb.MODE_DISAGGREGATED: "disaggregated",
    pb.MODE_COLOCATED: "colocated",
    pb.MODE_CONDITIONAL: "conditional",
}
MODES_BY_NAME: dict[str, pb.Mode] = {name: value for value, name in MODE_NAMES.items()}

ROLE_NAMES: dict[pb.WorkerRole, str] = {
    pb.WORKER_ROLE_UNSPECIFIED: "unspecified",
    pb.WORKER_ROLE_PREFILL: "prefill",
    pb.WORKER_ROLE_DECODE: "decode",
    pb.WORKER_ROLE_MIXED: "mixed",
}
ROLES_BY_NAME: dict[str, pb.WorkerRole] = {name: value for value, name in ROLE_NAMES.items()}

_UINT32_MAX = 2**32 - 1


# --- SamplingParams ---------------------------------------------------------------------------


def sampling_from_proto(msg: pb.SamplingParams, *, field: str = "sampling") -> SamplingParams:
    """The domain ``SamplingParams`` of ``msg``; unset optional fields take the defaults.

    Raises ``InvalidArgumentError`` naming ``{field}.{name}`` for any out-of-range value.
    """
    defaults = SamplingParams()
    try:
        return SamplingParams(
            temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
            top_k=int(msg.top_k),
            top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
            seed=int(msg.seed) if msg.HasField("seed") else None,
            max_tokens=int(msg.max_tokens) if msg.HasField("max_tokens") else defaults.max_tokens,
            stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
            stop=tuple(msg.stop),
            ignore_eos=bool(msg.ignore_eos),
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=(
                msg.repetition_penalty
                if msg.HasField("repetition_penalty")
                else defaults.repetition_penalty
            ),
            min_p=msg.min_p,
            min_tokens=int(msg.min_tokens),
            logit_bias={int(t): float(b) for t, b in msg.logit_bias.items()},
            allowed_token_ids=tuple(int(t) for t in msg.allowed_token_ids),
            bad_words=tuple(msg.bad_words),
            bad_words_token_ids=tuple(
                tuple(int(t) for t in w.ids) for w in msg.bad_words_token_ids
            ),
            logprobs=int(msg.logprobs),
            prompt_logprobs=(int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None),
            guide=Guide.from_fields(
                guided_json=msg.guided_json,
                guided_json_object=msg.guided_json_object,
                guided_regex=msg.guided_regex,
                guided_choice=msg.guided_choice,
                guided_grammar=msg.guided_grammar,
            ),
        )
    except InvalidArgumentError as e:
        raise _prefixed(e, field) from e


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The wire form of ``params``; every optional field is set explicitly."""
    msg = pb.SamplingParams(
        temperature=float(params.temperature),
        top_k=int(params.top_k),
        top_p=float(params.top_p),
        max_tokens=int(params.max_tokens),
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        ignore_eos=bool(params.ignore_eos),
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        repetition_penalty=float(params.repetition_penalty),
        min_p=float(params.min_p),
        min_tokens=int(params.min_tokens),
        logit_bias=dict(params.logit_bias),
        allowed_token_ids=list(params.allowed_token_ids),
        bad_words=list(params.bad_words),
        bad_words_token_ids=[pb.TokenIds(ids=w) for w in params.bad_words_token_ids],
        logprobs=int(params.logprobs),
    )
    if params.seed is not None:
        msg.seed = int(params.seed)
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = int(params.prompt_logprobs)
    _guide_to_proto(params.guide, msg)
    return msg


def _guide_to_proto(guide: Guide | None, msg: pb.SamplingParams) -> None:
    if guide is None:
        return
    if guide.kind is GuideKind.JSON:
        msg.guided_json = guide.spec
    elif guide.kind is GuideKind.JSON_OBJECT:
        msg.guided_json_object = True
    elif guide.kind is GuideKind.REGEX:
        msg.guided_regex = guide.spec
    elif guide.kind is GuideKind.CHOICE:
        msg.guided_choice.extend(guide.choices)
    else:
        msg.guided_grammar = guide.spec


def check_sampling_against(
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    prompt_len: int,
    field: str = "sampling",
) -> None:
    """``SamplingParams.check_against`` with the field named by its proto path."""
    try:
        params.check_against(
            vocab_size=vocab_size, max_model_len=max_model_len, prompt_len=prompt_len
        )
    except InvalidArgumentError as e:
        raise _prefixed(e, field) from e


def _prefixed(err: InvalidArgumentError, prefix: str) -> InvalidArgumentError:
    message = str(err).removeprefix(f"{err.field}: ")
    return InvalidArgumentError(f"{prefix}.{err.field}" if prefix else err.field, message)


# --- token ids --------------------------------------------------------------------------------


def check_token_ids(ids: Sequence[int], *, vocab_size: int, field: str) -> list[int]:
    """``ids`` as a list of ints, each in ``[0, vocab_size)``; must not be empty."""
    if not ids:
        raise InvalidArgumentError(field, "must contain at least one token id")
    out = [int(t) for t in ids]
    for i, t in enumerate(out):
        if not 0 <= t < vocab_size:
            raise InvalidArgumentError(
                field, f"token id {t} at position {i} outside [0, {vocab_size})"
            )
    return out


# --- enums ------------------------------------------------------------------------------------


def finish_reason_to_proto(reason: FinishReason | None) -> pb.FinishReason:
    """The wire value of ``reason``; None (not finished) is FINISH_REASON_UNSPECIFIED."""
    if reason is None:
        return pb.FINISH_REASON_UNSPECIFIED
    return _FINISH_TO_PROTO[FinishReason(reason)]


def finish_reason_from_proto(value: int, *, field: str = "finish_reason") -> FinishReason | None:
    """The domain reason of a wire value; None for UNSPECIFIED (still running).

    FINISH_REASON_ERROR has no domain counterpart (a failed request is an exception, not a
    result), so it is rejected like an unknown value.
    """
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    reason = _FINISH_FROM_PROTO.get(int(value))
    if reason is None:
        raise InvalidArgumentError(
            field, f"unexpected finish reason {_enum_label(pb.FinishReason, value)}"
        )
    return reason


def finish_reason_name(value: int, *, field: str = "finish_reason") -> str | None:
    """Lower-case name of a wire finish reason ("stop", ..., "error"); None for UNSPECIFIED."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    name = FINISH_REASON_NAMES.get(int(value))
    if name is None:
        raise InvalidArgumentError(field, f"unknown finish reason value {value}")
    return name


def check_enum(enum_type: EnumTypeWrapper, value: int, *, field: str) -> int:
    """``value`` if ``enum_type`` (a generated enum) names it; else InvalidArgumentError."""
    if int(value) not in {int(v) for v in enum_type.values()}:
        raise InvalidArgumentError(field, f"unknown enum value {value}")
    return int(value)


def mode_from_proto(value: int, *, field: str = "mode") -> pb.Mode:
    """A validated ``Mode`` wire value."""
    return cast(pb.Mode, check_enum(pb.Mode, value, field=field))


def mode_from_name(name: str, *, field: str = "mode") -> pb.Mode:
    """The ``Mode`` wire value of "disaggregated" / "colocated" / "conditional" /
    "unspecified"."""
    value = MODES_BY_NAME.get(name.lower())
    if value is None:
        raise InvalidArgumentError(
            field, f"unknown mode {name!r}; expected one of {sorted(MODES_BY_NAME)}"
        )
    return value


def role_from_proto(value: int, *, field: str = "role") -> pb.WorkerRole:
    """A validated ``WorkerRole`` wire value."""
    return cast(pb.WorkerRole, check_enum(pb.WorkerRole, value, field=field))


def _enum_label(enum_type: EnumTypeWrapper, value: int) -> str:
    try:
        return str(enum_type.Name(value))
    except ValueError:
        return str(value)


# --- Usage / Timing ---------------------------------------------------------------------------


def usage_to_proto(
    *, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> pb.Usage:
    """A ``Usage`` message."""
    return pb.Usage(
        prompt_tokens=_u32(prompt_tokens, "usage.prompt_tokens"),
        completion_tokens=_u32(completion_tokens, "usage.completion_tokens"),
        cached_tokens=_u32(cached_tokens, "usage.cached_tokens"),
    )


def timing_to_proto(t: Timing) -> pb.Timing:
    """The wire form of ``t`` (without the hand-off's ``transfer`` detail)."""
    return pb.Timing(
        queue_ms=t.queue_ms,
        prefill_ms=t.prefill_ms,
        transfer_ms=t.transfer_ms,
        decode_ms=t.decode_ms,
        ttft_ms=t.ttft_ms,
        e2e_ms=t.e2e_ms,
        transfer_bytes=t.transfer_bytes,
        transport=t.transport,
    )


def timing_from_proto(msg: pb.Timing) -> Timing:
    """The domain ``Timing`` of a wire one."""
    return Timing(
        queue_ms=msg.queue_ms,
        prefill_ms=msg.prefill_ms,
        transfer_ms=msg.transfer_ms,
        decode_ms=msg.decode_ms,
        ttft_ms=msg.ttft_ms,
        e2e_ms=msg.e2e_ms,
        transfer_bytes=msg.transfer_bytes,
        transport=msg.transport,
    )


def prefill_timing_from_proto(msg: prefill_pb2.PrefillResponse) -> Timing:
    """The prefill worker's figures in its answer; the transport is where its KV went."""
    return Timing(
        queue_ms=msg.queue_ms,
        prefill_ms=msg.compute_ms,
        transfer_ms=msg.transfer_ms,
        transfer_bytes=msg.transfer_bytes,
        transport=(msg.kv.WhichOneof("location") or "") if msg.HasField("kv") else "",
    )


def timing_to_dict(msg: pb.Timing) -> dict[str, float | int | str]:
    """Every ``Timing`` field by name (unset fields as their zero value)."""
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def _u32(value: int, field: str) -> int:
    if not 0 <= value <= _UINT32_MAX:
        raise InvalidArgumentError(field, f"{value} does not fit uint32")
    return int(value)
