"""``--sim-profile``: which timing model prices a sim engine's steps, and for which model."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve.sim.fitted import Fitted
from pdserve.sim.shapes import ModelShape, accelerator, model
from pdserve.sim.timing import PROFILE_FLAG, Roofline, TimingModel


@dataclass(frozen=True, slots=True)
class SimProfile:
    """A parsed ``--sim-profile``: the timing model, the model it prices, and the KV tokens
    the modelled devices hold (None where unknown: a fitted profile; the engine's own KV
    sizing applies)."""

    spec: str
    timing: TimingModel
    model: ModelShape
    kv_tokens: int | None

    @property
    def on_threads(self) -> dict[int, TimingModel]:
        """Step times on each thread count measured: a fitted CPU profile's, on all of its
        threads and on the shares of a split (``Fitted.shares``). Empty where nothing was
        measured on shares: the modelled device is not split (an accelerator is not)."""
        fitted = self.timing
        if not isinstance(fitted, Fitted) or not fitted.shares:
            return {}
        return {f.threads: f for f in (fitted, *fitted.shares)}


PROFILE_FORMS = (
    "roofline:<accelerator>:<model>",
    "roofline:<accelerator>:<model>:tp<N>",
    "fitted:<file.json>",
)
_TP = re.compile(r"tp(\d+)")


def parse_profile(spec: str, flag: str = PROFILE_FLAG) -> SimProfile:
    """Parse ``roofline:<accelerator>:<model>[:tp<N>]`` (model: a built-in name or a
    config.json path, which may itself hold ':') or ``fitted:<file.json>``."""
    forms = "; accepted: " + ", ".join(PROFILE_FORMS)
    kind, sep, rest = spec.partition(":")
    if kind == "fitted" and rest:
        fitted = Fitted.load(rest, flag=flag)
        return SimProfile(spec, fitted, fitted.model, None)
    if kind == "roofline" and rest:
        acc_name, sep, model_part = rest.partition(":")
        tp = 1
        head, colon, last = model_part.rpartition(":")
        match = _TP.fullmatch(last)
        if colon and match:
            model_part, tp = head, int(match.group(1))
        if not acc_name or not sep or not model_part:
            raise InvalidArgumentError(flag, f"{spec!r} names no accelerator or model{forms}")
        if tp < 1:
            raise InvalidArgumentError(flag, f"{spec!r}: tp must be >= 1{forms}")
        roofline = Roofline(accelerator(acc_name, flag), model(model_part, flag), tp)
        return SimProfile(spec, roofline, roofline.model, roofline.kv_capacity_tokens(flag=flag))
    raise InvalidArgumentError(flag, f"unknown simulation profile {spec!r}{forms}")
