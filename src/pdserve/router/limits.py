"""Bounds on what one request may ask of the router, so that its cost is bounded.

Every field whose size a client chooses has a limit (``RequestLimits``, set by the router's
flags): the prompt (token ids, or text in UTF-8 bytes), the stop strings (how many, and their
characters together), the stop token ids, the logit bias entries, the allowed token ids, the
bad words (how many, and their characters and token ids together), a structured-output guide
(the characters of its schema, regex or grammar; or how many choices, and their characters
together), the request id and the tenant. A request over one is
INVALID_ARGUMENT naming the field. ``check_message`` checks a ``GenerateRequest`` by counts
alone, before any repeated field is copied into Python objects.

``max_message_bytes`` bounds the message of a request within every limit; the router's gRPC
receive limit (``receive_bytes``) is a generous multiple of it: a request over a limit by any
realistic factor (a 60,000-word prompt to a 4K-token model) is still parsed, and refused by
the check that names its field and the limit, while gRPC refuses a message beyond it
(RESOURCE_EXHAUSTED, which the SDK raises as ``RequestTooLarge``) before it is parsed, so
that one call's memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve.rpc.sizes import MAX_MESSAGE_BYTES
from pdserve.v1 import router_pb2

PROMPT_BYTES_PER_TOKEN = 16
"""Default text prompt bound, in UTF-8 bytes per token of the model's maximum length: well
above what real text takes per token (about 4 for English, 3-6 for CJK), so that a prompt it
refuses would have been too long in tokens anyway."""

# Bytes of protobuf framing per field at most: a tag and a length varint.
_FRAMING = 6
_UINT32_BYTES = 5  # a uint32 as a varint, at most
_BIAS_ENTRY_BYTES = _FRAMING + 1 + _UINT32_BYTES + 1 + 4  # a map entry: key varint, float
_UTF8_CHAR_BYTES = 4
_SCALARS_BYTES = 128  # sampling's numbers and flags, with their tags
_SLACK_BYTES = 4096
RECEIVE_FACTOR = 4
"""``receive_bytes``: how many times the largest request within the limits the router
receives, so that an oversize one is refused naming its field rather than unparsed."""
RECEIVE_FLOOR_BYTES = 4 * 1024 * 1024
"""``receive_bytes`` at least (gRPC's own default), whatever the model's length."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask at most (see the module docstring)."""

    max_prompt_tokens: int
    """Token ids of a prompt given as ids (the model refuses more anyway)."""
    max_prompt_bytes: int
    """UTF-8 bytes of a prompt given as text."""
    max_stop_strings: int = 16
    max_stop_chars: int = 1024
    """Characters of all stop strings together."""
    max_stop_token_ids: int = 128
    max_logit_bias: int = 1024
    """Entries of ``logit_bias``."""
    max_allowed_token_ids: int = 16384
    max_bad_words: int = 128
    """Bad words, as text and as token ids together."""
    max_bad_words_chars: int = 4096
    """Characters of the bad words given as text plus token ids of those given as ids."""
    max_guide_chars: int = 32768
    """Characters of a guide: its JSON schema, regex or grammar, or all its choices."""
    max_guided_choices: int = 1024
    """Strings of ``guided_choice``."""
    max_request_id_chars: int = 256
    max_tenant_chars: int = 256

    def __post_init__(self) -> None:
        for name in (
            "max_prompt_tokens", "max_prompt_bytes", "max_stop_strings", "max_stop_chars",
            "max_stop_token_ids", "max_logit_bias", "max_allowed_token_ids", "max_bad_words",
            "max_bad_words_chars", "max_guide_chars", "max_guided_choices",
            "max_request_id_chars", "max_tenant_chars",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(name, f"must be an integer >= 1, got {value!r}")

    @classmethod
    def for_model(
        cls,
        max_model_len: int,
        *,
        max_prompt_tokens: int | None = None,
        max_prompt_bytes: int | None = None,
        **others: int,
    ) -> RequestLimits:
        """The defaults for a model of ``max_model_len`` tokens, with ``others`` overridden."""
        return cls(
            max_prompt_tokens=max_prompt_tokens or max_model_len,
            max_prompt_bytes=max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_model_len,
            **others,
        )

    def max_message_bytes(self) -> int:
        """A bound on the serialized ``GenerateRequest`` of a request within these limits."""
        prompt = max(self.max_prompt_bytes, _UINT32_BYTES * self.max_prompt_tokens) + _FRAMING
        stops = _UTF8_CHAR_BYTES * self.max_stop_chars + _FRAMING * self.max_stop_strings
        stop_ids = _UINT32_BYTES * self.max_stop_token_ids + _FRAMING
        controls = (
            _BIAS_ENTRY_BYTES * self.max_logit_bias
            + _UINT32_BYTES * self.max_allowed_token_ids
            + _FRAMING
            # A word as text or as a TokenIds message: framing each, <= 5 bytes a char or id.
            + 2 * _FRAMING * self.max_bad_words
            + max(_UTF8_CHAR_BYTES, _UINT32_BYTES) * self.max_bad_words_chars
        )
        # One guide: its text, or its choices with their framing.
        guide = _UTF8_CHAR_BYTES * self.max_guide_chars + _FRAMING * self.max_guided_choices
        names = _UTF8_CHAR_BYTES * (self.max_request_id_chars + self.max_tenant_chars)
        total = (
            prompt + stops + stop_ids + controls + guide + names
            + 3 * _FRAMING + _SCALARS_BYTES + _SLACK_BYTES
        )  # fmt: skip
        return -(-total // 1024) * 1024

    def receive_bytes(self) -> int:
        """The router's gRPC receive limit (see the module docstring): ``RECEIVE_FACTOR``
        times ``max_message_bytes``, at least ``RECEIVE_FLOOR_BYTES``, at most
        ``MAX_MESSAGE_BYTES`` unless the limits themselves need more."""
        tight = self.max_message_bytes()
        generous = max(RECEIVE_FACTOR * tight, RECEIVE_FLOOR_BYTES)
        return max(tight, min(generous, MAX_MESSAGE_BYTES))

    # -- checks by size; each names the GenerateRequest field -----------------------------------

    def check_prompt_tokens(self, count: int, field: str = "token_ids") -> None:
        if count > self.max_prompt_tokens:
            raise InvalidArgumentError(
                field, f"{count} token ids; this router takes {self.max_prompt_tokens} at most"
            )

    def check_prompt_text(self, text: str, field: str = "text") -> None:
        # Characters first: never more than the bytes, and free to count.
        size = len(text) if len(text) > self.max_prompt_bytes else len(text.encode())
        if size > self.max_prompt_bytes:
            raise InvalidArgumentError(
                field,
                f"{size} or more UTF-8 bytes; this router takes {self.max_prompt_bytes} at most",
            )

    def check_stop_count(self, count: int, field: str = "sampling.stop") -> None:
        if count > self.max_stop_strings:
            raise InvalidArgumentError(
                field, f"{count} stop strings; this router takes {self.max_stop_strings}"
            )

    def check_stops(self, stop: Sequence[str], field: str = "sampling.stop") -> None:
        self.check_stop_count(len(stop), field)
        chars = sum(len(s) for s in stop)
        if chars > self.max_stop_chars:
            raise InvalidArgumentError(
                field,
                f"{chars} characters of stop strings; this router takes {self.max_stop_chars} "
                "in all",
            )

    def check_stop_token_ids(self, count: int, field: str = "sampling.stop_token_ids") -> None:
        if count > self.max_stop_token_ids:
            raise InvalidArgumentError(
                field, f"{count} stop token ids; this router takes {self.max_stop_token_ids}"
            )

    def check_controls(self, logit_bias: int, allowed_token_ids: int) -> None:
        """The entries of ``logit_bias`` and the ``allowed_token_ids``, by count."""
        if logit_bias > self.max_logit_bias:
            raise InvalidArgumentError(
                "sampling.logit_bias",
                f"{logit_bias} entries; this router takes {self.max_logit_bias}",
            )
        if allowed_token_ids > self.max_allowed_token_ids:
            raise InvalidArgumentError(
                "sampling.allowed_token_ids",
                f"{allowed_token_ids} token ids; this router takes {self.max_allowed_token_ids}",
            )

    def check_bad_word_count(self, count: int) -> None:
        """Bad words as text and as token ids together."""
        if count > self.max_bad_words:
            raise InvalidArgumentError(
                "sampling.bad_words",
                f"{count} bad words (as text and as token ids); this router takes "
                f"{self.max_bad_words}",
            )

    def check_bad_words(self, words: Sequence[str], token_ids: Sequence[Sized]) -> None:
        """The bad words' count, then their characters and token ids together."""
        self.check_bad_word_count(len(words) + len(token_ids))
        size = sum(len(w) for w in words) + sum(len(w) for w in token_ids)
        if size > self.max_bad_words_chars:
            raise InvalidArgumentError(
                "sampling.bad_words" if words else "sampling.bad_words_token_ids",
                f"{size} characters and token ids of bad words; this router takes "
                f"{self.max_bad_words_chars} in all",
            )

    def check_guide(self, field: str, chars: int) -> None:
        """A guide's characters (``field``: its GenerateRequest field): its text's, or all
        its choices' (their count first: ``check_choice_count``)."""
        if chars > self.max_guide_chars:
            raise InvalidArgumentError(
                field, f"{chars} characters; this router takes {self.max_guide_chars} in a guide"
            )

    def check_choice_count(self, count: int) -> None:
        if count > self.max_guided_choices:
            raise InvalidArgumentError(
                "sampling.guided_choice",
                f"{count} choices; this router takes {self.max_guided_choices}",
            )

    def check_name(self, value: str, field: str) -> str:
        """A request id or tenant: bounded, printable, no spaces (they end up in Redis keys)."""
        limit = self.max_tenant_chars if field == "tenant" else self.max_request_id_chars
        if len(value) > limit:
            raise InvalidArgumentError(field, f"longer than {limit} characters")
        if any(not c.isprintable() or c.isspace() for c in value):
            raise InvalidArgumentError(field, "must not contain spaces or control characters")
        return value


def check_message(
    request: router_pb2.GenerateRequest, limits: RequestLimits, *, tenant: str
) -> None:
    """Check every size-bounded field of ``request`` by its count or length, before anything
    copies a repeated field out of it. ``tenant``: the one in force (metadata or field)."""
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        limits.check_prompt_tokens(len(request.token_ids.ids))
    elif which == "text":
        limits.check_prompt_text(request.text)
    if request.HasField("sampling"):
        s = request.sampling
        limits.check_stop_token_ids(len(s.stop_token_ids))
        limits.check_stop_count(len(s.stop))  # before the strings are copied out
        limits.check_stops(s.stop)
        limits.check_controls(len(s.logit_bias), len(s.allowed_token_ids))
        for name in ("guided_json", "guided_regex", "guided_grammar"):
            limits.check_guide(f"sampling.{name}", len(getattr(s, name)))
        limits.check_choice_count(len(s.guided_choice))  # before the strings are copied out
        limits.check_guide("sampling.guided_choice", sum(len(c) for c in s.guided_choice))
        limits.check_bad_word_count(len(s.bad_words) + len(s.bad_words_token_ids))
        limits.check_bad_words(s.bad_words, [w.ids for w in s.bad_words_token_ids])
    if request.HasField("request_id"):
        limits.check_name(request.request_id, "request_id")
    limits.check_name(tenant, "tenant")
