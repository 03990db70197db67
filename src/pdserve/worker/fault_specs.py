"""The ``--fault`` flag of the worker services: failures injected on purpose, for fault tests.

A value is ``corrupt``, ``stall:N`` (hand-offs: ``SendFaults``), ``nan`` or ``step`` (the
engine: ``EngineFaults``), each optionally ``@PREFIX`` so that only request ids starting with
PREFIX are hit. No flag: no faults, and nothing of this runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.faults import EngineFaults
from pdserve.errors import InvalidArgumentError
from pdserve.transfer.faults import SendFaults


def parse_faults(specs: Sequence[str]) -> SendFaults | None:
    """The hand-off faults of ``--fault`` values (see ``parse_engine_faults`` for the grammar).
    For fault tests; none: None."""
    corrupt: str | None = None
    stall: str | None = None
    after = 1
    for name, arg, prefix in _fault_specs(specs):
        if name == "corrupt":
            corrupt = prefix
        elif name == "stall":
            stall, after = prefix, int(arg)
    if corrupt is None and stall is None:
        return None
    return SendFaults(corrupt_prefix=corrupt, stall_prefix=stall, stall_after_layers=after)


def parse_engine_faults(specs: Sequence[str]) -> EngineFaults | None:
    """The engine faults of ``--fault`` values: ``corrupt``, ``stall:N`` (hand-offs), ``nan``
    or ``step`` (``EngineFaults``), each optionally ``@PREFIX`` (only request ids starting
    with PREFIX). For fault tests; none: None."""
    nan: str | None = None
    step: str | None = None
    for name, _, prefix in _fault_specs(specs):
        if name == "nan":
            nan = prefix
        elif name == "step":
            step = prefix
    if nan is None and step is None:
        return None
    return EngineFaults(nan_prefix=nan, step_prefix=step)


def _fault_specs(specs: Sequence[str]) -> list[tuple[str, str, str]]:
    """(name, argument, prefix) of each ``--fault`` value, checked."""
    parsed = []
    for spec in specs:
        kind, _, prefix = spec.partition("@")
        name, _, arg = kind.partition(":")
        if not (name in ("corrupt", "nan", "step") and not arg) and not (
            name == "stall" and arg.isdigit()
        ):
            raise InvalidArgumentError(
                "--fault",
                f"expected corrupt, stall:N, nan or step, then @PREFIX or nothing; got {spec!r}",
            )
        parsed.append((name, arg, prefix))
    return parsed
