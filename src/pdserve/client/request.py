"""Building a GenerateRequest from keyword arguments, and the retry policy of the clients."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack, cast

import grpc

from pdserve.client.errors import InvalidRequest
from pdserve.v1 import common_pb2, router_pb2

TENANT_METADATA_KEY = "x-pdserve-tenant"

DEFAULT_TIMEOUT_S = 60.0
"""The clients' default deadline of one call (the whole of it, a stream included)."""

_UINT32 = 2**32
_UINT64 = 2**64


def _in_range(value: int, upper: int, field: str) -> int:
    # Values the wire type cannot carry fail here with the field's name; everything else is
    # validated by the router, which knows the model's limits.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < upper:
        raise InvalidRequest(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{field}: must be an integer in [0, {upper}), got {value!r}",
        )
    return value


class RequestOptions(TypedDict, total=False):
    """The keyword arguments of ``Client.generate``/``stream`` that shape the request.

    Unset (or ``None``) sampling parameters take the server's defaults (temperature 1,
    max_tokens 16); ``temperature=0`` is greedy. The logits controls carry vLLM's names and
    meanings (``docs/sampling.md``); ``bad_words`` are tokenized by the router.
    """

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    min_p: float | None
    min_tokens: int | None
    logit_bias: Mapping[int, float] | None
    allowed_token_ids: Sequence[int] | None
    bad_words: Sequence[str] | None
    bad_words_token_ids: Sequence[Sequence[int]] | None
    logprobs: int | None
    """The most likely alternatives to return at each output token (``Delta.top_logprobs``),
    at most 20; the sampled token's logprob comes with every token anyway."""
    prompt_logprobs: int | None
    """Return each prompt token's logprob and rank with this many alternatives
    (``Delta.prompt_logprobs`` on the first delta), at most 20."""
    request_id: str | None
    skip_special_tokens: bool
    """Default True."""


def build_request(
    prompt: str | Sequence[int], **options: Unpack[RequestOptions]
) -> router_pb2.GenerateRequest:
    """The wire request; ``None`` leaves a parameter to the server's default."""
    unknown = options.keys() - RequestOptions.__optional_keys__
    if unknown:  # ``**options`` would otherwise swallow a misspelt keyword silently
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
    max_tokens = options.get("max_tokens")
    temperature = options.get("temperature")
    top_p = options.get("top_p")
    top_k = options.get("top_k")
    seed = options.get("seed")
    sampling = common_pb2.SamplingParams(
        stop=list(options.get("stop", ())),
        stop_token_ids=[
            _in_range(t, _UINT32, "sampling.stop_token_ids")
            for t in options.get("stop_token_ids", ())
        ],
        ignore_eos=options.get("ignore_eos", False),
    )
    if max_tokens is not None:
        sampling.max_tokens = _in_range(max_tokens, _UINT32, "sampling.max_tokens")
    if top_k is not None:
        sampling.top_k = _in_range(top_k, _UINT32, "sampling.top_k")
    if seed is not None:
        sampling.seed = _in_range(seed, _UINT64, "sampling.seed")
    if temperature is not None:
        sampling.temperature = float(temperature)
    if top_p is not None:
        sampling.top_p = float(top_p)
    _logits_controls(sampling, options)
    request = router_pb2.GenerateRequest(
        sampling=sampling, skip_special_tokens=options.get("skip_special_tokens", True)
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Sequence):
        ids = cast(Sequence[int], prompt)
        request.token_ids.ids.extend(_in_range(t, _UINT32, "token_ids") for t in ids)
    else:
        raise InvalidRequest(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prompt: must be a str or a sequence of token ids, got {type(prompt).__name__}",
        )
    request_id = options.get("request_id")
    if request_id is not None:
        request.request_id = request_id
    return request


def _logits_controls(sampling: common_pb2.SamplingParams, options: RequestOptions) -> None:
    """The logits controls of ``options`` into ``sampling`` (``None`` leaves each unset)."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        value = options.get(name)
        if value is not None:
            setattr(sampling, name, float(value))  # type: ignore[arg-type]
    min_tokens = options.get("min_tokens")
    if min_tokens is not None:
        sampling.min_tokens = _in_range(min_tokens, _UINT32, "sampling.min_tokens")
    for token, bias in (options.get("logit_bias") or {}).items():
        sampling.logit_bias[_in_range(token, _UINT32, "sampling.logit_bias")] = float(bias)
    sampling.allowed_token_ids.extend(
        _in_range(t, _UINT32, "sampling.allowed_token_ids")
        for t in options.get("allowed_token_ids") or ()
    )
    logprobs = options.get("logprobs")
    if logprobs is not None:
        sampling.logprobs = _in_range(logprobs, _UINT32, "sampling.logprobs")
    prompt_logprobs = options.get("prompt_logprobs")
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = _in_range(prompt_logprobs, _UINT32, "sampling.prompt_logprobs")
    sampling.bad_words.extend(options.get("bad_words") or ())
    for word in options.get("bad_words_token_ids") or ():
        sampling.bad_words_token_ids.add(
            ids=[_in_range(t, _UINT32, "sampling.bad_words_token_ids") for t in word]
        )


def metadata(tenant: str | None, api_key: str | None = None) -> tuple[tuple[str, str], ...]:
    """Call metadata: the tenant and the API key (``authorization: Bearer KEY``), when given.
    A router with API keys takes the tenant from the key and ignores the tenant sent."""
    out = ((TENANT_METADATA_KEY, tenant),) if tenant else ()
    return (*out, ("authorization", f"Bearer {api_key}")) if api_key else out


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` if it is None (no limit) or a number of seconds > 0."""
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0
    ):
        raise ValueError(f"timeout must be a number of seconds > 0, or None; got {timeout!r}")
    return timeout


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of UNAVAILABLE before the first token: bounded, with jittered exponential backoff.

    Only UNAVAILABLE is retried, and only while no token has reached the caller: then the
    router has not produced anything yet (and has released what it reserved), so a retry is
    safe. Once a token has arrived, an error is the caller's to handle.
    """

    max_attempts: int = 3
    """Tries in total, the first included (1 disables retries)."""
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0

    def backoff_s(self, attempt: int) -> float:
        """Sleep before try number ``attempt + 1`` (``attempt`` counts from 1)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        # Full jitter: clients that failed together do not all come back together.
        return random.uniform(0.0, base)

    def should_retry(
        self, code: grpc.StatusCode, attempt: int, *, started: bool, time_left_s: float | None
    ) -> float | None:
        """The backoff before retrying, or None when the error must be raised."""
        if code is not grpc.StatusCode.UNAVAILABLE or started or attempt >= self.max_attempts:
            return None
        delay = self.backoff_s(attempt)
        if time_left_s is not None and delay >= time_left_s:
            return None
        return delay
