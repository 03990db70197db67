"""What a structured-output request constrains its output to: a ``Guide``.

One guide per request, of one of vLLM's kinds (``GuideKind``), each carried on the wire and
in the SDK under vLLM's field name (``guided_json``, ``guided_json_object``, ``guided_regex``,
``guided_choice``, ``guided_grammar``); OpenAI's ``response_format`` maps onto the first two.
This module only describes and validates a guide (no grammar library): ``engine.guided``
compiles and enforces it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdserve.errors import InvalidArgumentError

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""The schema a ``json_object`` guide compiles to: any JSON object (OpenAI's JSON mode makes
the model write an object, not any JSON value)."""
MAX_SCHEMA_DEPTH = 128
"""Objects and arrays nested in a ``guided_json`` schema at most: its compile time grows
steeply with the depth (seconds at a few hundred levels), and real schemas stay far below."""


class GuideKind(StrEnum):
    """What the output must be."""

    JSON = "json"
    """A JSON value valid against a JSON schema."""
    JSON_OBJECT = "json_object"
    """Any JSON object (OpenAI's ``response_format`` ``json_object``)."""
    REGEX = "regex"
    """A text the regular expression matches whole."""
    CHOICE = "choice"
    """Exactly one of the given strings."""
    GRAMMAR = "grammar"
    """A sentence of an EBNF grammar (xgrammar's dialect, GBNF-like; the start rule is
    ``root``)."""

    @property
    def field(self) -> str:
        """The request field that carries a guide of this kind (vLLM's name)."""
        return f"guided_{self.value}"


GUIDE_FIELDS = tuple(kind.field for kind in GuideKind)
"""The request fields of the guides, in the order of ``GuideKind``."""


@dataclass(frozen=True, slots=True)
class Guide:
    """A request's structured-output constraint (hashable: the compile cache's key).

    ``spec`` is the schema's JSON text (``JSON``), the regular expression (``REGEX``) or the
    grammar (``GRAMMAR``); empty for ``JSON_OBJECT`` and ``CHOICE``, whose strings are in
    ``choices``. Build one with ``json_schema``, ``json_object``, ``regex``, ``choice`` or
    ``grammar``; a bad value is ``InvalidArgumentError`` naming the guide's field.
    """

    kind: GuideKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuideKind):
            raise InvalidArgumentError("guide", f"unknown kind {self.kind!r}")
        name = self.kind.field
        if not isinstance(self.spec, str):
            raise InvalidArgumentError(name, f"must be a string, got {type(self.spec).__name__}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind is GuideKind.CHOICE:
            if self.spec or not self.choices:
                raise InvalidArgumentError(name, "must be a non-empty list of strings")
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise InvalidArgumentError(name, "every choice must be a non-empty string")
            return
        if self.choices:
            raise InvalidArgumentError(name, "takes no choices")
        if self.kind is GuideKind.JSON_OBJECT:
            if self.spec:
                raise InvalidArgumentError(name, "takes no schema (use guided_json)")
            return
        if not self.spec:
            raise InvalidArgumentError(name, "must not be empty")
        if self.kind is GuideKind.JSON:
            try:
                schema = json.loads(self.spec)
            except ValueError as err:
                raise InvalidArgumentError(name, f"is not JSON: {err}") from None
            except RecursionError:  # nested beyond Python's own limit
                schema = None
            if schema is None or _depth(schema) > MAX_SCHEMA_DEPTH:
                raise InvalidArgumentError(
                    name, f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep"
                )
            if not isinstance(schema, dict | bool):
                raise InvalidArgumentError(
                    name, f"must be a JSON schema (an object), got {type(schema).__name__}"
                )

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any]) -> Guide:
        """The output is JSON valid against ``schema`` (its JSON text, or a mapping)."""
        if isinstance(schema, Mapping):
            try:
                schema = json.dumps(schema, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError) as err:
                raise InvalidArgumentError("guided_json", f"is not JSON: {err}") from None
        return cls(GuideKind.JSON, schema)

    @classmethod
    def json_object(cls) -> Guide:
        """The output is a JSON object."""
        return cls(GuideKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Guide:
        """The output matches ``pattern`` whole."""
        return cls(GuideKind.REGEX, pattern)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> Guide:
        """The output is one of ``choices``."""
        if isinstance(choices, str):
            raise InvalidArgumentError("guided_choice", "must be a list of strings, not one")
        return cls(GuideKind.CHOICE, choices=tuple(choices))

    @classmethod
    def grammar(cls, ebnf: str) -> Guide:
        """The output is a sentence of the EBNF grammar ``ebnf`` (start rule ``root``)."""
        return cls(GuideKind.GRAMMAR, ebnf)

    @classmethod
    def from_fields(
        cls,
        *,
        guided_json: str = "",
        guided_json_object: bool = False,
        guided_regex: str = "",
        guided_choice: Iterable[str] = (),
        guided_grammar: str = "",
    ) -> Guide | None:
        """The guide the request fields (vLLM's names) give; None when none is set. More than
        one set is ``InvalidArgumentError`` naming the second."""
        choices = tuple(guided_choice)
        given = {
            GuideKind.JSON: bool(guided_json),
            GuideKind.JSON_OBJECT: bool(guided_json_object),
            GuideKind.REGEX: bool(guided_regex),
            GuideKind.CHOICE: bool(choices),
            GuideKind.GRAMMAR: bool(guided_grammar),
        }
        kinds = [kind for kind, is_set in given.items() if is_set]
        if len(kinds) > 1:
            raise InvalidArgumentError(
                kinds[1].field,
                f"only one of {', '.join(GUIDE_FIELDS)} may be set; got {kinds[0].field} too",
            )
        if not kinds:
            return None
        if kinds[0] is GuideKind.CHOICE:
            return cls.choice(choices)
        specs = {
            GuideKind.JSON: guided_json,
            GuideKind.REGEX: guided_regex,
            GuideKind.GRAMMAR: guided_grammar,
        }
        return cls(kinds[0], specs.get(kinds[0], ""))

    # -- what it compiles to ---------------------------------------------------------------
    @property
    def size(self) -> int:
        """Characters of the spec or of all the choices (what the router bounds)."""
        return len(self.spec) + sum(len(c) for c in self.choices)

    def ebnf(self) -> str:
        """A ``CHOICE`` guide as an EBNF grammar (``root ::= "a" | "b"``), which is how the
        grammar library (and TensorRT-LLM) takes it; JSON string escapes are its escapes."""
        if self.kind is not GuideKind.CHOICE:
            raise ValueError(f"a {self.kind} guide is not a choice")
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)


def _depth(value: object) -> int:
    """How deeply objects and arrays nest in parsed JSON ``value`` (0 for a scalar); without
    recursion, so any depth Python parsed is measured."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in item)
    return deepest
