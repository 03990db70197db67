"""Building a GenerateRequest from keyword arguments, and the retry policy of the clients."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack, cast

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

    Structured output takes one of vLLM's ``guided_*`` keywords: ``guided_json`` (a JSON
    schema, as a dict or its JSON text), ``guided_json_object=True`` (any JSON object:
    OpenAI's ``response_format`` ``json_object``), ``guided_regex``, ``guided_choice`` (a list
    of strings) or ``guided_grammar`` (EBNF); the workers compile it and refuse one that does
    not compile, naming its field (``sampling.guided_regex``).
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
    guided_json: Mapping[str, Any] | str | None
    guided_json_object: bool
    guided_regex: str | None
    guided_choice: Sequence[str] | None
    guided_grammar: str | None
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
    _guide(sampling, options)
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


_GUIDES = ("guided_json", "guided_json_object", "guided_regex", "guided_choice", "guided_grammar")


def _guide(sampling: common_pb2.SamplingParams, options: RequestOptions) -> None:
    """The structured-output keyword of ``options``, if any, into ``sampling``: one at most,
    ``guided_json`` as JSON text, ``guided_choice`` as a list (not one string)."""
    given = [name for name in _GUIDES if options.get(name)]
    if len(given) > 1:
        raise InvalidRequest(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"sampling.{given[1]}: only one of {', '.join(_GUIDES)} may be set; got {given[0]} too",
        )
    schema = options.get("guided_json")
    if isinstance(schema, Mapping):
        try:
            schema = json.dumps(schema, ensure_ascii=False)
        except (TypeError, ValueError) as err:
            raise InvalidRequest(
                grpc.StatusCode.INVALID_ARGUMENT, f"sampling.guided_json: is not JSON: {err}"
            ) from None
    choices = options.get("guided_choice") or ()
    if isinstance(choices, str):
        raise InvalidRequest(
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.guided_choice: must be a list of strings, not one string",
        )
    sampling.guided_json = schema or ""
    sampling.guided_json_object = bool(options.get("guided_json_object"))
    sampling.guided_regex = options.get("guided_regex") or ""
    sampling.guided_choice.extend(choices)
    sampling.guided_grammar = options.get("guided_grammar") or ""


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
