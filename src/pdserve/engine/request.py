"""``EngineRequest``: one request as everything below the router sees it.

The adapters build it once from the protobuf message; the worker roles, the hand-off
connectors and the engine backends take it and pass it on unchanged, down to the engine. What
only one step needs travels beside it (a hand-off's decode worker and transport, a prefill's
first token and KV, a migrated request's tokens), never inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request: who asked, what to compute, and under which reservation."""

    request_id: str
    """The id the engine keeps the request by: from the router, ``RequestKey.scoped_id``
    (unique across tenants); from a caller that calls a worker directly, its own id."""
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    tenant: str = ""
    """The prefix-cache namespace: equal prompts of different tenants share no KV blocks."""
    reservation_id: str = ""
    """The scheduler's reservation the request runs under ("" for none); an engine lists it
    in its capacity's ``tags`` while the request is admitted."""
    deadline: float | None = None
    """When the caller stops waiting, on ``time.monotonic``'s clock; None: no deadline."""
