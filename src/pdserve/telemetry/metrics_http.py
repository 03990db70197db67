"""``/metrics`` over HTTP: one Prometheus exposition server per service registry."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from pdserve.errors import BindError, InvalidArgumentError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint; ``close()`` stops it and joins its thread."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(
    registry: CollectorRegistry, port: int, host: str = "127.0.0.1"
) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a background thread.

    ``port=0`` binds a free port; ``MetricsServer.port`` is the bound one. Close it on shutdown.
    A port another process holds is a ``BindError``.
    """
    if not 0 <= port <= 65535:
        raise InvalidArgumentError("port", f"must be in [0, 65535], got {port}")
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:  # its socket is exclusive: SO_REUSEADDR, never SO_REUSEPORT
        raise BindError.from_os_error(f"http://{host}:{port}/metrics", err) from err
    bound = int(server.server_address[1])
    logger.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(host, bound, server, thread)
