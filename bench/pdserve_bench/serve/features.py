"""What a target's requests carry beyond a plain greedy completion (``--features NAME``).

A serving benchmark sends the same prompts to every target; a target given ``--features``
adds request fields that cost the server work, so the run shows that cost side by side with
the same endpoint's plain requests (report: "cost of the features"). The fields are the ones
OpenAI's and vLLM's ``/v1/completions`` take, and the same through pdserve's SDK:

* ``plain``: nothing added (greedy, ``ignore_eos``, exactly ``max_tokens`` tokens);
* ``json-schema``: ``response_format`` ``json_schema`` with ``RECORD_SCHEMA``, a typical
  record (a bounded string, an integer in a range, an enum, a boolean, a short array of short
  strings). The grammar ends the answer when the object closes, so an answer may be shorter
  than ``max_tokens`` (it is one of the mix's lengths at most) and is not held to it;
* ``penalties``: presence, frequency and repetition penalties and ``min_tokens`` equal to
  ``max_tokens``: the sampler's per-token logits processing on every step of every request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.client import RequestOptions
from pdserve.errors import InvalidArgumentError

RECORD_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "active", "tags"],
    "additionalProperties": False,
}
"""The ``json-schema`` feature's schema: every string and array bounded, so an answer ends
within a few dozen tokens and a cut-off (``max_tokens`` first) is rare."""

PRESENCE_PENALTY = 0.5
FREQUENCY_PENALTY = 0.5
REPETITION_PENALTY = 1.1


@dataclass(frozen=True, slots=True)
class Features:
    """A named set of request fields (see the module docstring)."""

    name: str
    summary: str
    schema: Mapping[str, Any] | None = None
    """A JSON schema the answer must follow (``response_format``; the SDK's ``guided_json``)."""
    penalties: Mapping[str, float] = field(default_factory=dict)
    """Penalties by the name the OpenAI body and the SDK's keywords share."""
    min_tokens_is_max: bool = False
    """Send ``min_tokens`` equal to the request's ``max_tokens``."""

    @property
    def exact_length(self) -> bool:
        """An answer must have exactly ``max_tokens`` tokens (False: a grammar may end it)."""
        return self.schema is None

    @property
    def salt(self) -> str:
        """What sets this target's prompt tokens apart from a plain target's (``Load.plan``)."""
        return "" if self.name == "plain" else self.name

    def _shared(self, max_tokens: int) -> dict[str, Any]:
        """The fields both APIs name alike."""
        out: dict[str, Any] = dict(self.penalties)
        if self.min_tokens_is_max:
            out["min_tokens"] = max_tokens
        return out

    def openai_fields(self, max_tokens: int) -> dict[str, Any]:
        """The fields added to a ``/v1/completions`` body."""
        out = self._shared(max_tokens)
        if self.schema is not None:
            out["response_format"] = {
                "type": "json_schema", "json_schema": {"name": "record", "schema": self.schema},
            }  # fmt: skip
        return out

    def sdk_options(self, max_tokens: int) -> RequestOptions:
        """The same fields as the pdserve SDK's request keywords."""
        options = RequestOptions(**self._shared(max_tokens))  # type: ignore[typeddict-item]
        if self.schema is not None:
            options["guided_json"] = self.schema
        return options


PLAIN = Features("plain", "nothing added")
JSON_SCHEMA = Features(
    "json-schema",
    "response_format json_schema (a bounded record; the answer ends with the object)",
    schema=RECORD_SCHEMA,
)
PENALTIES = Features(
    "penalties",
    f"presence {PRESENCE_PENALTY}, frequency {FREQUENCY_PENALTY}, repetition "
    f"{REPETITION_PENALTY} penalties and min_tokens = max_tokens",
    penalties={
        "presence_penalty": PRESENCE_PENALTY,
        "frequency_penalty": FREQUENCY_PENALTY,
        "repetition_penalty": REPETITION_PENALTY,
    },
    min_tokens_is_max=True,
)

FEATURES: dict[str, Features] = {f.name: f for f in (PLAIN, JSON_SCHEMA, PENALTIES)}


def get_features(name: str) -> Features:
    """The features called ``name``; a clear error naming the known ones otherwise."""
    try:
        return FEATURES[name]
    except KeyError:
        raise InvalidArgumentError(
            "features", f"unknown features {name!r}; one of {sorted(FEATURES)}"
        ) from None
