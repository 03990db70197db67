"""Settings declared once: a dataclass field carries its flag (``setting``), and the argparse
flags (``add_flags``), the flags -> dataclass mapping (``from_args``) and the dataclass -> flags
mapping (``to_args``, ``flags_for``) are derived from it.

A field ``kv_lease_s: float = setting(60.0, "help")`` is the flag ``--kv-lease-s`` (its name,
dashed), parsed as its annotation says (``int``, ``float``, ``Path``, ``str``; ``X | None`` as
``X``; a ``StrEnum`` by value), with its default read from ``PDSERVE_KV_LEASE_S`` in the
environment the caller passes. A ``bool`` is a switch: ``--NAME`` when it defaults to False,
``--no-NAME`` when it defaults to True (its environment variable: ``1`` or ``0``). A
``tuple[str, ...]`` is a repeatable flag. A field whose type is a dataclass of settings nests
(its flags join the same parser); any other field is not a flag: ``from_args`` callers give it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pdserve.errors import InvalidArgumentError

T = TypeVar("T")
ENV_PREFIX = "PDSERVE_"
_KEY = "pdserve.setting"


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one field is set from a command line (the metadata ``setting`` attaches)."""

    help: str | None = None
    names: tuple[str, ...] = ()
    """Flag names; empty: ``--`` and the field's name, dashed (``--no-`` for a True switch)."""
    choices: tuple[str, ...] | None = None
    group: str | None = None
    """Title of the ``--help`` section the flag is listed in; None: the parser's own."""
    env: bool = True
    """Whether ``PDSERVE_<FIELD>`` in the environment gives the default."""
    exclusive: str | None = None
    """Flags sharing this name are mutually exclusive on the command line."""
    to: str | None = None
    """What this setting is in another config, ``CONFIG.FIELD`` or ``CONFIG`` (a field of the
    same name): ``engine.num_kv_blocks``, ``transfer`` (``fields_for``)."""


def setting(
    default: T, help: str | None = None, *, flags: tuple[str, ...] = (),
    choices: Sequence[str] | None = None, group: str | None = None, env: bool = True,
    exclusive: str | None = None, factory: Callable[[], T] | None = None,
    to: str | None = None,
) -> T:  # fmt: skip
    """A dataclass field that is a flag (module doc); ``factory`` makes the default instead."""
    flag = Flag(help, flags, None if choices is None else tuple(choices), group, env, exclusive, to)
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={_KEY: flag})
    return dataclasses.field(default=default, metadata={_KEY: flag})


def required(help: str | None = None, *, choices: Sequence[str] | None = None) -> Any:
    """A dataclass field that is a flag without a default (``--model``)."""
    flag = Flag(help, choices=None if choices is None else tuple(choices))
    return dataclasses.field(metadata={_KEY: flag})


@dataclasses.dataclass(frozen=True, slots=True)
class _Setting:
    """One field of a settings class, resolved: its flag, parsed type and default."""

    name: str
    flag: Flag
    kind: type
    default: Any
    many: bool

    @property
    def names(self) -> tuple[str, ...]:
        no = "no-" if self.kind is bool and self.default is True else ""
        return self.flag.names or (f"--{no}{self.name.replace('_', '-')}",)

    def render(self, value: Any) -> list[str]:
        """The flags giving ``value`` (none for a switch at its default, or None)."""
        if value is None or (self.kind is bool and value == self.default):
            return []
        if self.kind is bool:
            return [self.names[0]]
        if self.many:
            return [a for item in value for a in (self.names[0], str(item))]
        return [self.names[0], str(value.value if isinstance(value, enum.Enum) else value)]


def _base(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> X; ``tuple[X, ...]`` -> X, repeated."""
    if isinstance(hint, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _members(cls: type) -> Iterator[tuple[str, _Setting | type]]:
    """The fields of ``cls`` that are settings, in order; a nested settings class as itself."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, many = _base(hints[f.name])
        flag = f.metadata.get(_KEY)
        if flag is not None:
            default = None if f.default is dataclasses.MISSING else f.default
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()  # host_name: this machine's, each time
            yield f.name, _Setting(f.name, flag, kind, default, many)
        elif dataclasses.is_dataclass(kind) and isinstance(kind, type) and settings(kind):
            yield f.name, kind


def settings(cls: type) -> list[_Setting]:
    """Every setting of ``cls``, those of nested settings classes included."""
    return [s for _, x in _members(cls) for s in (settings(x) if isinstance(x, type) else [x])]


def flag_names(cls: type, field: str) -> tuple[str, ...]:
    """The flags of ``cls``'s setting ``field`` (or a nested settings class's)."""
    return next(s.names for s in settings(cls) if s.name == field)


def add_flags(
    parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str], *,
    defaults: Mapping[str, Any] | None = None, choices: Mapping[str, Sequence[str]] | None = None,
) -> None:  # fmt: skip
    """Add ``cls``'s flags; ``defaults`` and ``choices`` override a field's (the environment
    still wins over a default)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for s in settings(cls):
        f = s.flag
        container: Any = parser
        if f.group is not None:  # sections and exclusive groups: made by their first flag
            if f.group not in groups:
                groups[f.group] = parser.add_argument_group(f.group)
            container = groups[f.group]
        if f.exclusive is not None:
            if f.exclusive not in exclusive:
                exclusive[f.exclusive] = container.add_mutually_exclusive_group()
            container = exclusive[f.exclusive]
        default = (defaults or {}).get(s.name, s.default)
        raw = env.get(ENV_PREFIX + s.name.upper()) if f.env else None
        kw: dict[str, Any] = {"dest": s.name, "help": f.help}
        if s.kind is bool:
            default = {"1": True, "0": False}.get(raw or "", default)
            kw["action"] = "store_false" if s.default is True else "store_true"
        elif s.many:
            kw["action"] = "append"
            default = list(default)
        else:
            kw["choices"] = (choices or {}).get(s.name, f.choices)
            if s.kind in (int, float, Path):
                kw["type"] = s.kind
            if raw is not None:
                default = raw  # a string default: argparse parses it as it would the flag
            elif isinstance(default, enum.Enum):
                default = default.value  # as the flag gives it; from_args makes the member
        container.add_argument(*s.names, default=default, **kw)


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``cls`` from the parsed flags of ``add_flags``; ``given``: its fields that are not flags."""
    values: dict[str, Any] = {}
    for name, x in _members(cls):
        value = from_args(x, args) if isinstance(x, type) else getattr(args, name)
        if isinstance(x, _Setting) and x.many:
            value = tuple(value)
        elif isinstance(x, _Setting) and issubclass(x.kind, enum.Enum) and value is not None:
            value = x.kind(value)
        values[name] = value
    return cls(**values, **given)


def check_choices(obj: Any) -> None:
    """Refuse a value outside a setting's choices (argparse checks only the command line, not
    a default from the environment), naming the flag."""
    for s in (x for _, x in _members(type(obj)) if isinstance(x, _Setting)):
        got = getattr(obj, s.name)
        if s.flag.choices is not None and got not in s.flag.choices:
            choices = ", ".join(s.flag.choices)
            raise InvalidArgumentError(s.names[0], f"must be one of {choices}, got {got!r}")


def flags_for(cls: type, **values: Any) -> list[str]:
    """The flags that set these fields of ``cls`` (or of its nested settings classes), in
    declaration order: a child process's command line."""
    known = {s.name: s for s in settings(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise TypeError(f"{cls.__name__} has no settings {sorted(unknown)}")
    return [a for name, s in known.items() if name in values for a in s.render(values[name])]


def _changed(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, x in _members(type(obj)):
        value = getattr(obj, name)
        if isinstance(x, type):
            out.update(_changed(value))
        elif value != x.default:
            out[name] = value
    return out


def to_args(obj: Any) -> list[str]:
    """The flags that rebuild ``obj`` from the declared defaults: ``from_args`` of them gives
    ``obj`` back (its fields that are not flags aside)."""
    return flags_for(type(obj), **_changed(obj))


def fields_for(obj: Any, config: str) -> dict[str, Any]:
    """The fields of ``config`` that ``obj``'s settings (nested ones too) are (declared with
    ``to=``), by that config's names; None values aside (the config's defaults apply)."""
    out: dict[str, Any] = {}
    for name, x in _members(type(obj)):
        value = getattr(obj, name)
        if isinstance(x, type):
            out.update(fields_for(value, config))
        elif x.flag.to is not None and value is not None:
            target, _, field = x.flag.to.partition(".")
            if target == config:
                out[field or name] = value
    return out
