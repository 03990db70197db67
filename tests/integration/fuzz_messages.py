"""Hypothesis strategies for protobuf messages: any message type, from its descriptor.

``messages(cls)`` sets each field or leaves it unset, with values across the whole range of
its type, the edges weighted in: 0, the largest values, NaN and the infinities, subnormals,
unknown enum numbers, empty and non-ASCII strings, nested messages a few levels deep.
``overrides`` replaces the strategy of chosen fields (by name, wherever they occur), so a
test can steer values towards the paths it wants to reach (a prompt the model accepts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

M = TypeVar("M", bound=Message)
Strategy = st.SearchStrategy[Any]

MAX_DEPTH = 3
MAX_REPEATED = 6

_F = FieldDescriptor


def _ints(lo: int, hi: int) -> Strategy:
    edges = (lo, lo + 1, -1, 0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, hi - 1, hi)
    inside = sorted({v for v in edges if lo <= v <= hi})
    return st.one_of(st.sampled_from(inside), st.integers(0, 1000), st.integers(lo, hi))


FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e-320, 5e-324, 1e308, float("inf"), -float("inf"),
                     float("nan"), -1.0, 1e-300, 2.0]),
    st.floats(allow_nan=True, allow_infinity=True),
)  # fmt: skip
TEXT = st.one_of(
    st.sampled_from(["", "a", "hello world", "é東🙂", "\x00", " ", "a b", "x" * 300]),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=24),
)
BYTES = st.one_of(st.sampled_from([b"", b"\x00", b"\xff" * 8]), st.binary(max_size=48))

_SCALARS: dict[int, Strategy] = {
    _F.TYPE_DOUBLE: FLOATS,
    _F.TYPE_FLOAT: FLOATS,  # beyond float32's range they round to an infinity: fine
    _F.TYPE_INT32: _ints(-(2**31), 2**31 - 1),
    _F.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1),
    _F.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    _F.TYPE_SINT64: _ints(-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: _ints(0, 2**32 - 1),
    _F.TYPE_FIXED32: _ints(0, 2**32 - 1),
    _F.TYPE_UINT64: _ints(0, 2**64 - 1),
    _F.TYPE_FIXED64: _ints(0, 2**64 - 1),
    _F.TYPE_BOOL: st.booleans(),
    _F.TYPE_STRING: TEXT,
    _F.TYPE_BYTES: BYTES,
    _F.TYPE_ENUM: st.integers(-2, 6),  # proto3 enums are open: unknown numbers parse
}


def _value(field: FieldDescriptor, depth: int, overrides: Mapping[str, Strategy]) -> Strategy:
    if field.name in overrides:
        return overrides[field.name]
    if _is_map(field):  # a dict: its entries' key and value fields
        entry = field.message_type.fields_by_name
        return st.dictionaries(
            _value(entry["key"], depth, overrides),
            _value(entry["value"], depth, overrides),
            max_size=MAX_REPEATED,
        )
    if field.type == _F.TYPE_MESSAGE:
        one = _message(field.message_type, depth + 1, overrides)
    else:
        one = _SCALARS[field.type]
    return st.lists(one, max_size=MAX_REPEATED) if _repeated(field) else one


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == _F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _message(
    descriptor: Descriptor, depth: int, overrides: Mapping[str, Strategy]
) -> st.SearchStrategy[Message]:
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(descriptor)
    if depth > MAX_DEPTH:
        return st.just(cls())
    fields = {f.name: st.one_of(st.none(), _value(f, depth, overrides)) for f in descriptor.fields}

    def build(values: dict[str, Any]) -> Message:
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = descriptor.fields_by_name[name]
            if _is_map(field):
                entries = getattr(msg, name)
                for key, item in value.items():
                    if isinstance(item, Message):
                        entries[key].CopyFrom(item)
                    else:
                        entries[key] = item
            elif field.type == _F.TYPE_MESSAGE:
                if _repeated(field):
                    getattr(msg, name).extend(value)
                else:
                    getattr(msg, name).CopyFrom(value)
            elif _repeated(field):
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries(fields).map(build)


def messages(cls: type[M], **overrides: Strategy) -> st.SearchStrategy[M]:
    """Messages of type ``cls``; ``overrides``: field name -> strategy of its value (a list
    for a repeated field, a message for a message field)."""
    strategy: Callable[..., Any] = _message
    return strategy(cls.DESCRIPTOR, 0, overrides)  # type: ignore[no-any-return]
