"""A client request, validated against the model before any other service sees it."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.models.config import ModelConfig
from pdserve.rpc.convert import check_sampling_against, check_token_ids
from pdserve.tokenizer import Tokenizer

MAX_ID_LENGTH = 256
"""Request ids and tenant names longer than this are refused (they end up in Redis keys)."""


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """The model facts the router validates against (read from ``config.json`` only)."""

    vocab_size: int
    max_model_len: int
    """Prompt plus generated tokens at most: the model's ``max_position_embeddings``."""

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelLimits:
        cfg = ModelConfig.from_dir(path)
        return cls(vocab_size=cfg.vocab_size, max_model_len=cfg.max_position_embeddings)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request ready to be placed: tokenized, with validated parameters."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    tenant: str = ""
    skip_special_tokens: bool = True


def _check_name(value: str, field: str) -> str:
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgumentError(field, f"longer than {MAX_ID_LENGTH} characters")
    if any(not c.isprintable() or c.isspace() for c in value):
        raise InvalidArgumentError(field, "must not contain spaces or control characters")
    return value


def prepare_request(
    *,
    text: str | None,
    token_ids: Sequence[int] | None,
    params: SamplingParams,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    request_id: str | None = None,
    tenant: str = "",
    skip_special_tokens: bool = True,
) -> RouteRequest:
    """Tokenize and validate; raises ``InvalidArgumentError`` naming the offending field.

    Exactly one of ``text`` and ``token_ids`` must be given. Field names follow the Router's
    GenerateRequest message (``text``, ``token_ids``, ``sampling.max_tokens``, ...).
    """
    if text is not None and token_ids is not None:
        raise InvalidArgumentError("prompt", "give either text or token_ids, not both")
    if text is not None:
        if not text:
            raise InvalidArgumentError("text", "the prompt must not be empty")
        field = "text"
        ids = tokenizer.encode(text)
    elif token_ids is not None:
        field = "token_ids"
        ids = check_token_ids(token_ids, vocab_size=limits.vocab_size, field=field)
    else:
        raise InvalidArgumentError("prompt", "one of text or token_ids must be set")
    if len(ids) >= limits.max_model_len:
        raise InvalidArgumentError(
            field,
            f"the prompt has {len(ids)} tokens; the model allows fewer than "
            f"{limits.max_model_len} (prompt plus generated tokens)",
        )
    check_sampling_against(
        params,
        vocab_size=limits.vocab_size,
        max_model_len=limits.max_model_len,
        prompt_len=len(ids),
    )
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not request_id:
        raise InvalidArgumentError("request_id", "must not be empty when set")
    return RouteRequest(
        request_id=_check_name(request_id, "request_id"),
        prompt_token_ids=tuple(ids),
        params=params,
        tenant=_check_name(tenant, "tenant"),
        skip_special_tokens=skip_special_tokens,
    )
