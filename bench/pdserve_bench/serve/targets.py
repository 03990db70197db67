"""Targets: what a serving benchmark sends its requests to, behind one seam (``Target``).

A target streams one greedy completion of a token-id prompt (``ignore_eos``, exactly
``max_tokens`` tokens; up to that many where its ``features`` say so) as ``Chunk``s; the
runner stamps every chunk's arrival itself, so every target is timed by the same code. A
refusal for load raises ``RejectedError``, any other failure ``TargetError``. Here: a pdserve
router (running, or a cluster this process started); ``openai`` has the OpenAI-compatible
HTTP target.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from pdserve import hostmem
from pdserve.client import AsyncClient, Overloaded, PdServeClientError, RetryPolicy
from pdserve.errors import PdServeError
from pdserve_bench.serve.features import PLAIN, Features

if TYPE_CHECKING:
    from pdserve.launcher import Cluster


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed message."""

    token_ids: tuple[int, ...] | None
    """The new tokens, where the target names them (None: it only says how many)."""
    tokens: int
    """How many new tokens it carries (0: a message with only a finish reason or usage)."""
    usage_tokens: int | None = None
    """The target's own count of output tokens so far, where it sends one."""
    cached_tokens: int | None = None
    """Prompt tokens the target served from its prefix cache, where it says so."""


class TargetError(PdServeError):
    """A request failed. ``admitted``: the target had accepted it (not refused, reachable)."""

    def __init__(self, message: str, *, admitted: bool) -> None:
        super().__init__(message)
        self.admitted = admitted


class RejectedError(TargetError):
    """Refused for load before any work: RESOURCE_EXHAUSTED, HTTP 429."""

    def __init__(self, message: str) -> None:
        super().__init__(message, admitted=False)


class TargetDownError(PdServeError):
    """The target can take no more requests (a process of its cluster exited)."""


class Target(Protocol):
    """One server under test. ``label`` names it in every report; ``features`` are the
    fields its requests carry beyond a plain greedy completion."""

    label: str
    features: Features

    async def open(self) -> None:
        """Connect (and learn what it needs, e.g. the model name); called once, first."""
        ...

    async def begin_point(self, rate: float | None) -> None:
        """Called before each point (its offered rate); raises ``TargetDownError`` if the target
        is known to be unusable, so the run goes on without it."""
        ...

    def stream(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        """Greedy completion of ``prompt`` (exactly ``max_tokens`` tokens, EOS ignored)."""
        ...

    def describe(self) -> dict[str, Any]:
        """What it is, for the JSON report."""
        ...

    async def close(self) -> None: ...


NOT_ADMITTED = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,  # not reached (or, before the first token, can't tell)
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
"""Status codes with which a router turns a request away without taking it on."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """A local pdserve cluster the benchmark starts itself (``pdserve.launcher.Cluster``)."""

    mode: str
    """``disaggregated`` or ``colocated``."""
    model: Path
    prefill: int
    decode: int
    """Decode workers; mixed workers unless disaggregated."""
    worker_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    duties: tuple[str, ...] = ()
    """Initial duty of each mixed worker ("" for everything it can)."""
    planner_args: tuple[str, ...] | None = None
    """Start the P:D planner with these flags; None: no planner."""
    lanes: tuple[str, ...] = ()
    """Lane of each prefill worker ("" for any)."""
    backend: str = "torch"
    """The workers' engine: ``torch`` or ``sim`` (its flags are in ``worker_args``)."""

    @property
    def default_label(self) -> str:
        """``pdserve-conditional-1p2m``, say; ``-sim`` at the end for a sim cluster."""
        if self.mode == "colocated":
            label = f"pdserve-colocated-{self.decode}w"
        elif self.mode == "conditional":
            label = f"pdserve-conditional-{self.prefill}p{self.decode}m"
        else:
            label = f"pdserve-disaggregated-{self.prefill}p{self.decode}d"
        return label if self.backend == "torch" else f"{label}-{self.backend}"

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "backend": self.backend,
            "model": str(self.model),
            "prefill": self.prefill if self.mode != "colocated" else 0,
            "decode": self.decode,
            "worker_args": list(self.worker_args),
            "scheduler_args": list(self.scheduler_args),
            "router_args": list(self.router_args),
            "duties": list(self.duties),
            "planner_args": None if self.planner_args is None else list(self.planner_args),
            "lanes": list(self.lanes),
        }


class RouterTarget:
    """A pdserve router, through ``pdserve.client.AsyncClient`` streaming.

    ``cluster``: the local cluster behind it, when this process started one (its processes
    are checked before each point)."""

    def __init__(self, address: str, label: str, *, cluster: Cluster | None = None,
                 spec: ClusterSpec | None = None, features: Features = PLAIN) -> None:  # fmt: skip
        self.label = label
        self.features = features
        self.address = address
        self._cluster = cluster
        self._spec = spec
        # One attempt per request: a retry would hide the failure the benchmark must count.
        # No deadline of the SDK's own: the runner bounds each request by --request-timeout,
        # in real seconds (the SDK's 60 s default cut off streams of time-scaled sim clusters
        # whose --request-timeout, in modelled time, was longer).
        self._client = AsyncClient(address, retry=RetryPolicy(max_attempts=1), timeout=None)
        self._rss_at_close: dict[str, int] | None = None

    async def open(self) -> None:
        pass  # the channel opens on the first call, inside the running loop

    async def begin_point(self, rate: float | None) -> None:
        if self._cluster is None:
            return
        dead = self._cluster.failed()
        if dead:
            names = ", ".join(s.name for s in dead)
            raise TargetDownError(f"{names} exited; last lines of its log:\n{dead[0].log_tail(15)}")

    async def stream(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        started = False
        options = self.features.sdk_options(max_tokens)
        options["max_tokens"], options["temperature"], options["ignore_eos"] = max_tokens, 0.0, True
        stream = self._client.stream(list(prompt), **options)
        try:
            async for delta in stream:
                if delta.finish_reason in ("abort", "error"):
                    raise TargetError(f"finish_reason {delta.finish_reason}", admitted=True)
                usage = delta.usage.completion_tokens if delta.usage is not None else None
                cached = delta.usage.cached_tokens if delta.usage is not None else None
                if delta.token_ids or usage is not None:
                    started = started or bool(delta.token_ids)
                    yield Chunk(tuple(delta.token_ids), len(delta.token_ids), usage, cached)
        except Overloaded as e:
            raise RejectedError(f"RESOURCE_EXHAUSTED: {e.message}") from e
        except PdServeClientError as e:
            admitted = started or e.code not in NOT_ADMITTED
            raise TargetError(f"{e.code.name}: {e.message}", admitted=admitted) from e
        finally:
            await stream.aclose()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "pdserve-router", "address": self.address, "features": self.features.name,
        }  # fmt: skip
        if self._spec is not None:
            out.update(kind="pdserve-cluster", cluster=self._spec.to_json())
        if self._cluster is not None:
            out["rss_mb"] = self._rss_at_close if self._rss_at_close is not None else self._rss()
        return out

    def _rss(self) -> dict[str, int]:
        """Resident memory (MB) of each process of the cluster now."""
        assert self._cluster is not None
        rss = {s.name: hostmem.rss_bytes(s.proc.pid) for s in self._cluster.services
               if s.proc is not None}  # fmt: skip
        return {name: round(b / 1e6) for name, b in rss.items() if b is not None}

    async def close(self) -> None:
        # The cluster stops after this, before the report is written: keep what it held at
        # the end of the run.
        if self._cluster is not None:
            self._rss_at_close = self._rss()
        await self._client.close()
