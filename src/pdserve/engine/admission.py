"""What ``Engine.add_request`` checks before a request touches the scheduler.

Each check raises ``InvalidArgumentError`` naming the field, so a bad request fails alone and
nothing of it is queued or allocated. They read only the model's limits, not engine state.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.tokenizer import Tokenizer


def prompt_ids(
    prompt: str | Seq[int], tokenizer: Tokenizer, vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt's token ids: text is tokenized, ids are range-checked; either must leave room
    for at least one generated token within ``max_model_len``."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("prompt", "must not be empty")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        _check_vocab("prompt_token_ids", ids, vocab_size)
    if len(ids) >= max_model_len:
        raise InvalidArgumentError(
            "prompt", f"{len(ids)} tokens; the model's maximum length is {max_model_len}"
        )
    return ids


def resumed_ids(
    generated: Seq[int], params: SamplingParams, kv: KVPayload | None, vocab_size: int
) -> list[int]:
    """The output tokens a migrated request brings (``[]`` for a new one); they must leave
    some of ``max_tokens`` to generate, and come without an imported KV."""
    ids = [int(t) for t in generated]
    if not ids:
        return ids
    if kv is not None:
        raise InvalidArgumentError("generated", "a resumed request brings no KV")
    _check_vocab("generated", ids, vocab_size)
    if len(ids) >= params.max_tokens:
        raise InvalidArgumentError(
            "generated", f"{len(ids)} tokens leave nothing of max_tokens {params.max_tokens}"
        )
    return ids


def check_import(
    layout: KVLayout,
    kv: KVPayload,
    token_ids: list[int],
    first: tuple[int, float] | None,
    vocab_size: int,
) -> None:
    """A hand-off fits this engine: same layout, one KV row per prompt token, and the first
    token the prefill side sampled."""
    layout.check_compatible(kv.layout)
    if kv.num_tokens != len(token_ids):
        raise InvalidArgumentError(
            "kv", f"payload holds {kv.num_tokens} tokens but the prompt has {len(token_ids)}"
        )
    if first is None or not 0 <= first[0] < vocab_size:
        raise InvalidArgumentError(
            "first_token", "a valid first token must come with an imported KV"
        )


def _check_vocab(field: str, ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError(field, f"token {bad} outside [0, {vocab_size})")
