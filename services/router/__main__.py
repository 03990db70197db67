"""``python -m services.router``: the Router gRPC service, the cluster's public entry point.

Wiring only: flags -> telemetry (tracing from ``OTEL_*``, ``/metrics``) -> tokenizer and model
limits (no weights) -> the rollout split and traffic capture from Redis (``--redis-url``) ->
RequestFlow (channels with the cluster's TLS and internal token) -> gRPC server (+ health; with
``--api-keys`` every call needs a client's key, which names its tenant) -> serve until
SIGTERM/SIGINT. ``--port 0`` binds a free port; ``--port-file`` receives the bound port once
the server is serving (``--metrics-port-file`` the metrics port, before it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path

from pdserve.convert import mode_from_name
from pdserve.errors import InvalidArgumentError
from pdserve.router import (
    ChannelPool,
    FlowConfig,
    ModelLimits,
    RequestFlow,
    RequestLimits,
    RequestPreparer,
)
from pdserve.router.capture import Capture, capturing
from pdserve.router.limits import PROMPT_BYTES_PER_TOKEN
from pdserve.router.rollout import RolloutFollower, following
from pdserve.router.scheduler_wait import DEFAULT_SCHEDULER_WAIT_S, WaitPolicy
from pdserve.router.telemetry import RouterTelemetry
from pdserve.rpc.server import (
    DEFAULT_OPTIONS,
    build_server,
    run_service,
    serve_until_signal,
    write_port_file,
)
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import connect
from pdserve.security.apikeys import ApiKeys
from pdserve.security.options import LOOPBACK_HOSTS, add_security_args, security_from_args
from pdserve.telemetry.metrics import RouterMetrics
from pdserve.telemetry.service import (
    MetricsEndpoint,
    ServiceTelemetry,
    add_telemetry_args,
)
from pdserve.telemetry.spans import SERVICE_ROUTER
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import router_pb2_grpc
from services.router.servicer import RouterServicer

logger = logging.getLogger("pdserve.router")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.router", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    p.add_argument(
        "--scheduler",
        required=True,
        help="host:port of the Scheduler service; several replicas comma-separated, asked in "
        "turn (one that cannot be reached is skipped)",
    )
    p.add_argument("--model", type=Path, required=True, help="checkpoint dir (tokenizer + config)")
    p.add_argument(
        "--mode",
        default="conditional",
        choices=["conditional", "disaggregated", "colocated"],
        help="mode asked of the scheduler when no rollout split applies (conditional: the "
        "scheduler decides per request)",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("PDSERVE_REDIS_URL"),
        help="follow the rollout split (pdserve rollout) and traffic capture (pdserve trace "
        "capture) kept in this Redis (default: $PDSERVE_REDIS_URL, which keeps a password off "
        "the command line); unset: --mode only, no capture",
    )
    p.add_argument("--namespace", default="pdserve", help="Redis key prefix of the cluster")
    p.add_argument("--max-channels", type=int, default=64, help="cached worker channels at most")
    p.add_argument(
        "--prefill-attempts",
        type=int,
        default=3,
        help="tries in all of a request whose worker fails before its first token (>= 1)",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=2,
        help="moves at most of a stream whose decode worker fails mid-way to another decode "
        "worker, which resumes after the tokens already sent (0: fail the stream)",
    )
    p.add_argument(
        "--scheduler-wait-s",
        type=float,
        default=DEFAULT_SCHEDULER_WAIT_S,
        help="while no scheduler answers (one restarting), or the survivors of a failed worker "
        "are full, a request waits this long at most for one, then fails (0: at once)",
    )
    p.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--api-keys", type=Path, default=os.environ.get("PDSERVE_API_KEYS") or None,
        help="YAML/JSON file of API keys -> tenant (docs/security.md); every call then needs "
        "'authorization: Bearer KEY' and its tenant is the key's",
    )  # fmt: skip
    add_limit_args(p)
    add_telemetry_args(p, os.environ)
    add_security_args(p, os.environ)
    return p.parse_args(argv)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The per-request limits (``RequestLimits``); each refusal names the field."""
    g = p.add_argument_group("request limits (a request over one is INVALID_ARGUMENT)")
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="token ids of a prompt (default: the model's maximum length)",
    )
    g.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=None,
        help=f"UTF-8 bytes of a text prompt (default: {PROMPT_BYTES_PER_TOKEN} "
        "per token of the model's maximum length)",
    )
    g.add_argument("--max-stop-strings", type=int, default=16, help="stop strings")
    g.add_argument(
        "--max-stop-chars", type=int, default=1024, help="characters of all stop strings together"
    )
    g.add_argument("--max-stop-token-ids", type=int, default=128, help="stop token ids")
    g.add_argument("--max-logit-bias", type=int, default=1024, help="entries of logit_bias")
    g.add_argument("--max-allowed-token-ids", type=int, default=16384, help="allowed token ids")
    g.add_argument(
        "--max-bad-words", type=int, default=128, help="bad words (as text and as token ids)"
    )
    g.add_argument(
        "--max-bad-words-chars",
        type=int,
        default=4096,
        help="characters of the bad words given as text plus token ids of those given as ids",
    )
    g.add_argument(
        "--max-guide-chars",
        type=int,
        default=32768,
        help="characters of a structured-output guide (a JSON schema, regex, grammar or choices)",
    )
    g.add_argument("--max-guided-choices", type=int, default=1024, help="strings of guided_choice")
    g.add_argument("--max-request-id-chars", type=int, default=256)
    g.add_argument("--max-tenant-chars", type=int, default=256)
    g.add_argument("--tokenize-threads", type=int, default=2,
                   help="threads tokenizing long text prompts off the event loop")  # fmt: skip


def request_limits(args: argparse.Namespace, model: ModelLimits) -> RequestLimits:
    """The limits the flags set; a bad value is InvalidArgumentError naming its flag."""
    try:
        return RequestLimits.for_model(
            model.max_model_len,
            max_prompt_tokens=args.max_prompt_tokens,
            max_prompt_bytes=args.max_prompt_bytes,
            max_stop_strings=args.max_stop_strings,
            max_stop_chars=args.max_stop_chars,
            max_stop_token_ids=args.max_stop_token_ids,
            max_logit_bias=args.max_logit_bias,
            max_allowed_token_ids=args.max_allowed_token_ids,
            max_bad_words=args.max_bad_words,
            max_bad_words_chars=args.max_bad_words_chars,
            max_guide_chars=args.max_guide_chars,
            max_guided_choices=args.max_guided_choices,
            max_request_id_chars=args.max_request_id_chars,
            max_tenant_chars=args.max_tenant_chars,
        )
    except InvalidArgumentError as err:
        flag = "--" + err.field.replace("_", "-")
        raise InvalidArgumentError(flag, str(err).removeprefix(f"{err.field}: ")) from err


def server_options(limits: RequestLimits) -> list[tuple[str, int]]:
    """gRPC options: a message larger than ``limits.receive_bytes()`` is refused unparsed."""
    options = dict(DEFAULT_OPTIONS)
    options["grpc.max_receive_message_length"] = limits.receive_bytes()
    return list(options.items())


async def serve(args: argparse.Namespace) -> None:
    security = security_from_args(args, os.environ)
    api_keys = ApiKeys.from_file(args.api_keys) if args.api_keys is not None else None
    if api_keys is None and args.host not in LOOPBACK_HOSTS:
        logger.warning(
            "router listens on %s without --api-keys: any caller is served, as any tenant "
            "it names (see docs/security.md)",
            args.host,
        )
    tokenizer = Tokenizer.from_dir(args.model)
    model_limits = ModelLimits.from_dir(args.model)
    limits = request_limits(args, model_limits)
    metrics = RouterMetrics(model_name=args.model.name)
    telemetry = ServiceTelemetry.start(
        SERVICE_ROUTER, metrics.registry, host=args.host, endpoint=MetricsEndpoint.from_args(args)
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(telemetry.close)  # last: flushes the spans of the final requests
        arms = capture = None
        if args.redis_url:
            redis = connect(args.redis_url)
            stack.push_async_callback(redis.aclose)
            arms = await stack.enter_async_context(
                following(RolloutFollower(redis, KeySpace(args.namespace)))
            )
            capture = await stack.enter_async_context(
                capturing(Capture(redis, KeySpace(args.namespace)))
            )
        flow = RequestFlow(
            scheduler_address=args.scheduler,
            tokenizer=tokenizer,
            channels=ChannelPool(
                max_size=args.max_channels,
                interceptors=telemetry.client_interceptors(),
                security=security,
            ),
            config=FlowConfig(
                mode=mode_from_name(args.mode),
                prefill_attempts=args.prefill_attempts,
                migration_limit=args.migration_limit,
                scheduler_wait=WaitPolicy(bound_s=args.scheduler_wait_s),
            ),
            arms=arms,
            capture=capture,
        )
        stack.push_async_callback(flow.close)
        preparer = RequestPreparer(tokenizer, model_limits, limits, threads=args.tokenize_threads)
        stack.callback(preparer.close)
        servicer = RouterServicer(
            flow,
            preparer,
            RouterTelemetry(metrics, tracer_provider=telemetry.tracer_provider),
            api_keys=api_keys,
        )
        server, port, health = build_server(
            [(router_pb2_grpc.add_RouterServicer_to_server, servicer)],
            port=args.port,
            host=args.host,
            interceptors=telemetry.server_interceptors(),
            security=security,
            auth=api_keys,
            options=server_options(limits),
        )
        await server.start()
        await health.set_serving()
        logger.info(
            "router serving on %s:%d (scheduler %s, mode %s, model %s, metrics %s, %s, %s)",
            args.host, port, args.scheduler, args.mode, args.model, telemetry.metrics_url or "off",
            "TLS" if security.tls.serving else "plaintext",
            "API keys required" if api_keys is not None else "no API keys",
        )  # fmt: skip
        if args.port_file is not None:
            write_port_file(args.port_file, port)
        await serve_until_signal(server, health, args.grace_s)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_service("router", serve(args))


if __name__ == "__main__":
    main()
