"""A client request, validated against the model before any other service sees it.

``prepare_request`` does it in the caller's thread. ``RequestPreparer`` does it for the
router's event loop, which must never be held for long by one request: a long text prompt is
tokenized on a small pool of threads, with the GIL released (tokenizing 100 KB of text takes
tens of milliseconds, during which every other stream would stall).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pdserve.convert import check_sampling_against, check_token_ids
from pdserve.engine.controls import tokenize_bad_words
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.models.config import ModelConfig
from pdserve.request_key import RequestKey
from pdserve.router.limits import RequestLimits
from pdserve.tokenizer import Tokenizer

INLINE_TOKENIZE_CHARS = 2048
"""Text prompts up to this many characters are tokenized on the event loop (about a
millisecond); longer ones on the preparer's threads."""


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
    """The caller's id (or one made up for it): what answers and spans show."""
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    tenant: str = ""
    skip_special_tokens: bool = True

    @property
    def key(self) -> RequestKey:
        """The request's identity: its id within its tenant. Downstream services get its
        ``scoped_id`` as their ``request_id`` (``pdserve.request_key``)."""
        return RequestKey(self.tenant, self.request_id)


@dataclass(frozen=True, slots=True)
class _Checked:
    """A request whose every field but the prompt's tokens is valid."""

    field: str
    """The prompt's field: ``text`` or ``token_ids``."""
    text: str | None
    token_ids: list[int] | None
    request_id: str
    tenant: str


def _check(
    text: str | None,
    token_ids: Sequence[int] | None,
    params: SamplingParams,
    model: ModelLimits,
    limits: RequestLimits,
    request_id: str | None,
    tenant: str,
) -> _Checked:
    if text is not None and token_ids is not None:
        raise InvalidArgumentError("prompt", "give either text or token_ids, not both")
    if text is None and token_ids is None:
        raise InvalidArgumentError("prompt", "one of text or token_ids must be set")
    ids: list[int] | None = None
    if text is not None:
        if not text:
            raise InvalidArgumentError("text", "the prompt must not be empty")
        limits.check_prompt_text(text)
    elif token_ids is not None:
        limits.check_prompt_tokens(len(token_ids))
        ids = check_token_ids(token_ids, vocab_size=model.vocab_size, field="token_ids")
    limits.check_stops(params.stop)
    limits.check_stop_token_ids(len(params.stop_token_ids))
    limits.check_controls(len(params.logit_bias), len(params.allowed_token_ids))
    limits.check_bad_words(params.bad_words, params.bad_words_token_ids)
    if params.guide is not None:  # compiled by the workers (docs/sampling.md)
        limits.check_choice_count(len(params.guide.choices))
        limits.check_guide(f"sampling.{params.guide.kind.field}", params.guide.size)
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not request_id:
        raise InvalidArgumentError("request_id", "must not be empty when set")
    else:
        limits.check_name(request_id, "request_id")
    return _Checked(
        field="text" if text is not None else "token_ids",
        text=text,
        token_ids=ids,
        request_id=request_id,
        tenant=limits.check_name(tenant, "tenant"),
    )


def _route_request(
    checked: _Checked,
    ids: list[int],
    params: SamplingParams,
    model: ModelLimits,
    skip_special_tokens: bool,
) -> RouteRequest:
    if len(ids) >= model.max_model_len:
        raise InvalidArgumentError(
            checked.field,
            f"the prompt has {len(ids)} tokens; the model allows fewer than "
            f"{model.max_model_len} (prompt plus generated tokens)",
        )
    check_sampling_against(
        params, vocab_size=model.vocab_size, max_model_len=model.max_model_len, prompt_len=len(ids)
    )
    return RouteRequest(
        request_id=checked.request_id,
        prompt_token_ids=tuple(ids),
        params=params,
        tenant=checked.tenant,
        skip_special_tokens=skip_special_tokens,
    )


def prepare_request(
    *,
    text: str | None,
    token_ids: Sequence[int] | None,
    params: SamplingParams,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    request_limits: RequestLimits | None = None,
    request_id: str | None = None,
    tenant: str = "",
    skip_special_tokens: bool = True,
) -> RouteRequest:
    """Tokenize and validate; raises ``InvalidArgumentError`` naming the offending field.

    Exactly one of ``text`` and ``token_ids`` must be given. Field names follow the Router's
    GenerateRequest message (``text``, ``token_ids``, ``sampling.max_tokens``, ...).
    ``request_limits`` defaults to ``RequestLimits.for_model`` of the model.
    """
    req_limits = request_limits or RequestLimits.for_model(limits.max_model_len)
    checked = _check(text, token_ids, params, limits, req_limits, request_id, tenant)
    params = tokenize_bad_words(params, tokenizer)  # a few short strings: inline
    ids = checked.token_ids if checked.text is None else tokenizer.encode(checked.text)
    assert ids is not None  # _check sets one of the two
    return _route_request(checked, ids, params, limits, skip_special_tokens)


class RequestPreparer:
    """``prepare_request`` for an event loop: the same checks, long texts tokenized on
    ``threads`` threads (a bound: more such prompts wait their turn). ``close()`` at the end."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model: ModelLimits,
        limits: RequestLimits | None = None,
        *,
        threads: int = 2,
        inline_chars: int = INLINE_TOKENIZE_CHARS,
    ) -> None:
        if threads < 1:
            raise InvalidArgumentError("threads", f"must be >= 1, got {threads}")
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits or RequestLimits.for_model(model.max_model_len)
        self.inline_chars = inline_chars
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def prepare(
        self,
        *,
        text: str | None,
        token_ids: Sequence[int] | None,
        params: SamplingParams,
        request_id: str | None = None,
        tenant: str = "",
        skip_special_tokens: bool = True,
    ) -> RouteRequest:
        """See ``prepare_request``."""
        checked = _check(text, token_ids, params, self.model, self.limits, request_id, tenant)
        params = tokenize_bad_words(params, self.tokenizer)  # a few short strings: inline
        if checked.text is None:
            ids = checked.token_ids
        elif len(checked.text) <= self.inline_chars:
            ids = self.tokenizer.encode(checked.text)
        else:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._pool, self._encode_long, checked.text)
        assert ids is not None  # _check sets one of the two
        return _route_request(checked, ids, params, self.model, skip_special_tokens)

    def _encode_long(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, release_gil=True)

    def close(self) -> None:
        """Stop the threads; tokenizations still queued are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)
