"""A request body, from the socket to a validated request model, at a bounded cost.

``read_body`` reads at most ``max_bytes`` (``--max-body-bytes``): a ``Content-Length`` above it
is refused from the headers, a body without one (chunked) as soon as it passes the limit;
either way with 413 and without reading the rest.

``parse_body`` turns the bytes into a request model, or a 400 naming the parameter at fault:

* the bytes must be UTF-8 and JSON (``NaN``/``Infinity`` are not JSON, a number of more than
  4300 digits is refused rather than converted);
* the body may hold at most ``max_values`` JSON values and ``MAX_CONTAINERS`` objects and
  arrays, so that what comes after the parse (schema validation, chat template, tokenizer)
  has a bounded amount of work;
* every string must be Unicode text: a lone surrogate (``"\\ud800"``) can be neither encoded
  for the router nor tokenized, so it is refused naming where it is (``messages[0].content``);
* the schema is checked strictly (``protocol``): a boolean is not an integer.

A 400 about the body as a whole (not JSON, too many values) has ``param`` null and code
``invalid_body``; every other 400 names its parameter.

Parsing runs on the gateway's worker threads for a large body (``pool``), so it must leave
the GIL to the event loop often. The C parser holds it from start to end but for the hooks it
calls (one per object and number here, between which the interpreter hands the GIL over); a
body that may hold more than ``FAST_VALUES`` values (its commas and brackets, strings' own
included, bound their count) is parsed by the json module's Python scanner instead, which
returns to the interpreter between values (a string is still one call) and counts the values
and containers, stopping at the bounds. Millions of small containers would also keep the
cyclic garbage collector busy inside one long C call.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from pdserve.gateway.errors import TOO_LARGE, GatewayError, bad_request

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

MIB = 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 16 * MIB
MAX_CONTAINERS = 50_000
"""JSON objects and arrays in one body at most."""
FAST_VALUES = 50_000
"""Bodies that may hold more values than this are parsed by the Python scanner."""
BODY_CODE = "invalid_body"
"""``code`` of a 400 about the body as a whole (not JSON, too many values): ``param`` is
null or the top-level parameter holding most of it."""

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LONE_SURROGATE = (
    "a lone surrogate (a \\ud800-\\udfff escape not in a pair), which is not a character: "
    "strings must be valid Unicode"
)
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


class BodyGone(Exception):  # noqa: N818 - reads as what happened
    """The client disconnected while sending the body."""


def too_large(limit: int) -> GatewayError:
    """The 413 of a body over ``limit`` bytes; the connection is closed after it, so the rest
    of the body is never read."""
    return GatewayError(
        TOO_LARGE,
        f"The request body is larger than {limit} bytes, the most this server takes.",
        code="request_too_large",
        close=True,
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or ``too_large`` as soon as it is known to pass ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect as err:
        raise BodyGone() from err
    return b"".join(chunks)


def _body_error(message: str, param: str | None = None) -> GatewayError:
    return bad_request(param, message, code=BODY_CODE)


class _NotJsonError(Exception):
    """A value the JSON grammar does not allow, met by a hook."""


def _refuse_constant(name: str) -> Any:
    raise _NotJsonError(f"{name} is not a JSON value")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError as err:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise _NotJsonError(f"a number of {len(text)} digits is too long") from err


def _float(text: str) -> float:
    return float(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)


def _hooks() -> dict[str, Any]:
    return {"object_pairs_hook": _object, "parse_int": _int, "parse_float": _float,
            "parse_constant": _refuse_constant}  # fmt: skip


class _CountingDecoder(json.JSONDecoder):
    """The Python scanner, stopping past ``max_values`` values or ``MAX_CONTAINERS``
    objects and arrays: strings and numbers are counted as they are read, every value as its
    container ends (``true``, ``false`` and ``null`` have no hook)."""

    def __init__(self, max_values: int) -> None:
        super().__init__(**_hooks())
        self.max_values = max_values
        self.scalars = 0
        self.values = 0
        self.containers = 0
        # The pieces the json module is made of (not in its typing stubs).
        decoder: Any = json.decoder
        self.parse_string = self._scalar(decoder.scanstring)  # the C one: a string is one call
        self.parse_int = self._scalar(_int)
        self.parse_float = self._scalar(_float)
        self.parse_object = self._container(decoder.JSONObject)
        self.parse_array = self._container(decoder.JSONArray)
        self.scan_once = getattr(json.scanner, "py_make_scanner")(self)  # noqa: B009

    def _too_many(self) -> _NotJsonError:
        return _NotJsonError(f"more than {self.max_values} JSON values")

    def _scalar(self, parse: Callable[..., T]) -> Callable[..., T]:
        def counted(*args: Any) -> T:
            self.scalars += 1
            if self.scalars > self.max_values:
                raise self._too_many()
            return parse(*args)

        return counted

    def _container(self, parse: Callable[..., tuple[Any, int]]) -> Callable[..., tuple[Any, int]]:
        def counted(*args: Any) -> tuple[Any, int]:
            value, end = parse(*args)
            self.containers += 1
            self.values += len(value)
            if self.containers > MAX_CONTAINERS:
                raise _NotJsonError(f"more than {MAX_CONTAINERS} JSON objects and arrays")
            if self.values > self.max_values:
                raise self._too_many()
            return value, end

        return counted


def parse_json(raw: bytes, max_values: int) -> Any:
    """The JSON value of ``raw`` (UTF-8); a 400 if it is none or holds more than
    ``max_values`` values (see the module docstring)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _body_error(f"the body is not UTF-8: {err.reason} at byte {err.start}") from err
    bound = raw.count(b",") + raw.count(b"{") + raw.count(b"[") + 1
    if bound <= min(FAST_VALUES, max_values):
        decoder = json.JSONDecoder(**_hooks())
    else:
        decoder = _CountingDecoder(max_values)
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as err:
        raise _body_error(f"the body is not valid JSON: {err.msg} at character {err.pos}") from err
    except _NotJsonError as err:
        raise _body_error(f"the body is not valid JSON: {err}") from err
    except RecursionError as err:
        raise _body_error("the body is not valid JSON: nested too deeply") from err


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def check_strings(value: Any) -> None:
    """A 400 naming the first string (or key) holding a lone surrogate. Iterative, so that a
    deep body costs no recursion."""
    stack: list[tuple[str, Any]] = [("", value)]  # paths are made of keys already checked
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):  # a path "" is a key "" (no parameter to name)
                message = f"holds {_LONE_SURROGATE}"
                raise bad_request(path, message) if path else _body_error(message)
        elif isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):  # no parameter can be named by it
                    shown = key.encode(errors="replace").decode()
                    message = f"the key {shown!r} holds {_LONE_SURROGATE}"
                    raise bad_request(path, message) if path else _body_error(message)
                stack.append((_path(path, key), child))
        elif isinstance(item, list):
            stack.extend(
                (_path(path, i), child)
                for i, child in enumerate(item)
                if isinstance(child, str | dict | list)
            )


def param_of(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "role")`` -> ``messages[0].role``; union member tags that pydantic
    adds (``list[int]``, ``str``) end the path."""
    path = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


def parse_body(raw: bytes, model: type[M], max_values: int) -> M:
    """``raw`` as a ``model`` request, or a 400 naming the parameter at fault."""
    return validate(parse_object(raw, max_values), model)


def parse_object(raw: bytes, max_values: int) -> dict[str, Any]:
    """``raw`` as a JSON object whose strings are all Unicode text, or a 400."""
    value = parse_json(raw, max_values)
    if not isinstance(value, dict):
        raise _body_error(f"the body must be a JSON object, not {type(value).__name__}")
    if _SURROGATE_ESCAPE.search(raw):  # the only way to write one (raw ones are not UTF-8)
        check_strings(value)
    return value


def validate(value: dict[str, Any], model: type[M]) -> M:
    """``value`` (``parse_object``'s) as a ``model`` request, or a 400 naming the parameter."""
    try:
        return model.model_validate(value)
    except ValidationError as err:
        errors = err.errors(include_url=False, include_input=False)
        param = param_of(tuple(errors[0]["loc"]))
        raise bad_request(param, _union_message(errors, param) or errors[0]["msg"]) from err


def _union_message(errors: list[Any], param: str | None) -> str | None:
    """For a value that matches no member of a union: the members (pydantic's first error
    would name only the first)."""
    tags: list[str] = []
    for error in errors:
        if param_of(tuple(error["loc"])) == param:
            for part in error["loc"]:
                if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part):
                    tags += [] if part in tags else [part]
    return f"must be one of {', '.join(tags)}" if len(tags) > 1 else None
