"""Typed error hierarchy shared by the library and the services.

Library code raises these; the gRPC boundary (``pdserve.rpc``) maps each class to one status
code via ``grpc_code``. The names are gRPC ``StatusCode`` member names, kept as strings so that
the engine can raise them without importing grpc.
"""

from __future__ import annotations

import errno


class PdServeError(Exception):
    """Base of every error pdserve raises on purpose."""

    grpc_code: str = "INTERNAL"


class InvalidArgumentError(PdServeError, ValueError):
    """A caller-supplied value is invalid. ``field`` names the offending field."""

    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelLoadError(PdServeError):
    """A checkpoint directory is missing a file or describes an unsupported model."""

    grpc_code = "FAILED_PRECONDITION"


class KVPayloadMismatchError(PdServeError):
    """A KV payload was produced by another model, dtype or cache layout."""

    grpc_code = "FAILED_PRECONDITION"


class UnknownRequestError(PdServeError, KeyError):
    """A request id that the component does not (or no longer) hold."""

    grpc_code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message.
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(PdServeError):
    """A request id that is already in flight."""

    grpc_code = "ALREADY_EXISTS"


class CapacityError(PdServeError):
    """No worker, block or byte budget can take the request right now."""

    grpc_code = "RESOURCE_EXHAUSTED"


class WorkerUnavailableError(PdServeError):
    """A worker or dependency is gone or not reachable."""

    grpc_code = "UNAVAILABLE"


class HandedBackError(WorkerUnavailableError):
    """A worker handed a running request back (``EngineBackend.hand_back``): it left the
    request's phase (a planner's move), it did not fail. The router continues the request
    elsewhere without counting a failure (``router.failover``), by the ``MARK`` its details
    start with."""

    MARK = "handed back: "

    def __init__(self, why: str) -> None:
        super().__init__(self.MARK + why)


class BindError(PdServeError):
    """A server cannot listen on its address: another process holds the port, or the address
    is not one of this host's. A service meeting it exits (``pdserve.rpc.server.run_service``)."""

    grpc_code = "UNAVAILABLE"

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address

    @classmethod
    def from_os_error(cls, address: str, err: OSError) -> BindError:
        """The error of a failed ``bind()``, saying in words what its errno means."""
        if err.errno == errno.EADDRINUSE:
            return cls(address, "another process holds this port")
        return cls(address, err.strerror or str(err))


class KVTransferError(PdServeError):
    """A KV hand-off timed out, broke or failed its checksum."""

    grpc_code = "UNAVAILABLE"


class UnauthenticatedError(PdServeError):
    """The caller presented no valid credential (API key, internal token, certificate)."""

    grpc_code = "UNAUTHENTICATED"


class PermissionDeniedError(PdServeError):
    """The caller is known but may not do this (a capability that does not verify, ...)."""

    grpc_code = "PERMISSION_DENIED"


class CapabilityError(PermissionDeniedError):
    """A KV handle's capability does not match the hand-off it names: the caller did not get
    the handle from the hand-off's writer (a guessed name or generation)."""


class RequestFailedError(PdServeError):
    """The engine could not go on with one request: its step failed (a forward pass that
    raised, logits that were not finite). The engine and its other requests carry on."""

    grpc_code = "INTERNAL"


class FeatureUnavailableError(PdServeError):
    """The request needs what this deployment lacks: an optional package that is not
    installed (the message names the extra that brings it)."""

    grpc_code = "FAILED_PRECONDITION"
