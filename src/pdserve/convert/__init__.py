"""Conversions between ``pdserve.v1`` messages and the engine-level types every layer shares.

Every function that reads a message validates it: a bad value raises
``InvalidArgumentError`` whose ``field`` is the dotted path of the offending proto field
(``sampling.max_tokens``), so a gRPC caller learns exactly what to fix. Proto3 enums are open
(an unknown number survives parsing), so enum readers reject numbers the schema does not name.

``common``: what every service shares (sampling, token ids, enums, usage, timing), re-exported
here. ``logprobs``: the top and prompt logprobs every layer carries. ``kv``: the KV handle and
the hand-off's measurements (``pdserve.transfer``'s types).

This package sits above the engine and the transfer library and below every package that
calls or serves a gRPC service. The conversions of one package's own types live with it
(``kvstore.convert``, ``prefix.convert``, ``client.convert``); the answers of the worker,
router and scheduler services, which only their servicers build, live above them in
``pdserve.adapters``.
"""

from __future__ import annotations

from pdserve.convert.common import (
    FINISH_REASON_NAMES,
    MODE_NAMES,
    MODES_BY_NAME,
    ROLE_NAMES,
    ROLES_BY_NAME,
    check_enum,
    check_sampling_against,
    check_token_ids,
    finish_reason_from_proto,
    finish_reason_name,
    finish_reason_to_proto,
    mode_from_name,
    mode_from_proto,
    prefill_timing_from_proto,
    role_from_proto,
    sampling_from_proto,
    sampling_to_proto,
    timing_from_proto,
    timing_to_dict,
    timing_to_proto,
    usage_to_proto,
)

__all__ = [
    "FINISH_REASON_NAMES",
    "MODES_BY_NAME",
    "MODE_NAMES",
    "ROLES_BY_NAME",
    "ROLE_NAMES",
    "check_enum",
    "check_sampling_against",
    "check_token_ids",
    "finish_reason_from_proto",
    "finish_reason_name",
    "finish_reason_to_proto",
    "mode_from_name",
    "mode_from_proto",
    "prefill_timing_from_proto",
    "role_from_proto",
    "sampling_from_proto",
    "sampling_to_proto",
    "timing_from_proto",
    "timing_to_dict",
    "timing_to_proto",
    "usage_to_proto",
]
