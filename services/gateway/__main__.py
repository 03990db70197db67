"""``python -m services.gateway``: the OpenAI-compatible HTTP front door of a cluster.

Wiring only: flags -> the checkpoint's tokenizer, limits and chat template (no weights) ->
``Gateway`` on an ``AsyncClient`` of the router (TLS with ``--router-tls-*``) -> FastAPI app
on uvicorn (HTTPS with ``--tls-cert``/``--tls-key``) -> serve until
SIGTERM/SIGINT (uvicorn's own handlers: stop accepting, let running requests finish for
``--grace-s``). The listening socket is bound here, so ``--port 0`` picks a free port;
``--port-file`` receives it once the app has started (``--metrics-port-file`` the metrics
port, before it).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

import uvicorn

from pdserve.errors import BindError, InvalidArgumentError
from pdserve.gateway import Gateway, GatewayConfig, create_app
from pdserve.gateway.body import DEFAULT_MAX_BODY_BYTES
from pdserve.gateway.pool import DEFAULT_THREADS
from pdserve.gateway.security import GatewayTls, add_gateway_tls_args, gateway_tls_from_args
from pdserve.gateway.toolparse import PARSERS, CallSyntax
from pdserve.rpc.server import freeze_startup_heap, run_service, write_port_file
from pdserve.telemetry.metrics import GatewayMetrics
from pdserve.telemetry.metrics_http import MetricsServer, start_metrics_server
from pdserve.telemetry.service import MetricsEndpoint, add_telemetry_args

logger = logging.getLogger("pdserve.gateway")

ENV_ROUTER = "PDSERVE_ROUTER"
"""Default of ``--router``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    p.add_argument(
        "--router", default=os.environ.get(ENV_ROUTER),
        help=f"host:port of the Router service (default: ${ENV_ROUTER})",
    )  # fmt: skip
    p.add_argument("--model", type=Path, required=True, help="checkpoint dir (tokenizer + config)")
    p.add_argument("--served-model-name", help="the model name clients use (default: dir name)")
    p.add_argument("--chat-template", type=Path, help="Jinja2 chat template file to use instead")
    p.add_argument(
        "--timeout-s", type=float, default=600.0, help="deadline of each request (0: none)"
    )
    p.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    p.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused (413) without being read (default: 16 MiB)",
    )  # fmt: skip
    p.add_argument(
        "--parse-threads", type=int, default=DEFAULT_THREADS,
        help="threads that parse large bodies, render chat templates and tokenize",
    )  # fmt: skip
    p.add_argument(
        "--allow-unknown-fields", action="store_true",
        help="ignore request fields that neither OpenAI's nor vLLM's schema has (default: a "
        "400 naming the field)",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", choices=PARSERS, default=CallSyntax.HERMES.value,
        help="how answers to tool_choice auto hold their tool calls, and how tools are written "
        "into prompts of chat templates that render none (default: hermes)",
    )  # fmt: skip
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--log-level", default="INFO")
    add_telemetry_args(p, os.environ)
    add_gateway_tls_args(p, os.environ)
    args = p.parse_args(argv)
    if not args.router:
        p.error(f"--router (or ${ENV_ROUTER}) is required")
    for flag in ("max_body_bytes", "parse_threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    try:
        args.tls = gateway_tls_from_args(args)
    except InvalidArgumentError as err:
        p.error(str(err))
    return args


def _metrics(args: argparse.Namespace, metrics: GatewayMetrics) -> MetricsServer | None:
    endpoint = MetricsEndpoint.from_args(args)
    if endpoint.port < 0:
        return None
    server = start_metrics_server(metrics.registry, endpoint.port, args.host)
    if endpoint.port_file is not None:
        write_port_file(endpoint.port_file, server.port)
    return server


async def serve(args: argparse.Namespace) -> None:
    tls: GatewayTls = args.tls
    config = GatewayConfig(
        router=args.router,
        model_dir=args.model,
        served_model_name=args.served_model_name,
        timeout_s=args.timeout_s or None,
        chat_template=args.chat_template,
        router_tls=tls.router,
        max_body_bytes=args.max_body_bytes,
        parse_threads=args.parse_threads,
        allow_unknown_fields=args.allow_unknown_fields,
        tool_call_parser=CallSyntax(args.tool_call_parser),
    )
    gateway = Gateway.load(config)
    metrics = GatewayMetrics()
    metrics_server = _metrics(args, metrics)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:  # exclusive: SO_REUSEADDR, never SO_REUSEPORT
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as err:
        raise BindError.from_os_error(f"{args.host}:{args.port}", err) from err
    port = int(sock.getsockname()[1])

    def ready() -> None:
        logger.info(
            "gateway serving %s://%s:%d/v1 (router %s over %s, model %s as %r, chat template "
            "%s, metrics %s)", tls.scheme, args.host, port, config.router,
            "TLS" if tls.router is not None else "plaintext", config.model_dir,
            config.model_name, gateway.template.origin,
            metrics_server.url if metrics_server else "off",
        )  # fmt: skip
        if args.port_file is not None:
            write_port_file(args.port_file, port)

    app = create_app(gateway, metrics, on_ready=ready)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.log_level.lower(),
            access_log=args.access_log,
            timeout_graceful_shutdown=int(args.grace_s) or None,
            lifespan="on",
            ssl_certfile=tls.cert,
            ssl_keyfile=tls.key,
        )
    )
    freeze_startup_heap()
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        if metrics_server is not None:
            metrics_server.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_service("gateway", serve(args))


if __name__ == "__main__":
    main()
