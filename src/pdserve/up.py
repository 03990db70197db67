"""``pdserve up``: start a local cluster (``pdserve.launcher.Cluster``), print how to use it,
and stop it on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from pdserve.backends import BACKEND_NAMES, SIM, TENSORRT_LLM, TORCH
from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.mooncake.library import load as load_mooncake
from pdserve.launcher import KV_STORES, MODES, Cluster, default_model
from pdserve.scheduling.redis_url import redacted
from pdserve.security.up import INSECURE_WARNING, add_up_security_args, how_to_call
from pdserve.sim.flags import DEFAULT_LINK, sim_flags
from pdserve.sim.flags import DEFAULT_PROFILE as DEFAULT_SIM_PROFILE
from pdserve.supervisor import RestartPolicy
from pdserve.telemetry.service import describe_telemetry
from pdserve.up_state import UpState, publish, runtime_dir

DEFAULT_HTTP_PORT = 8000


def up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description="start a local pdserve cluster")
    p.add_argument("--model", type=Path, help="checkpoint dir (default: the demo model)")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "base"],
                   help="demo model size when --model is not given")  # fmt: skip
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1,
                   help="decode workers (mixed unless --mode disaggregated)")  # fmt: skip
    p.add_argument("--mode", default="conditional", choices=MODES,
                   help="conditional: prefill + mixed workers, the scheduler choosing colocated "
                   "or disaggregated per request")  # fmt: skip
    p.add_argument("--backend", default=TORCH, choices=BACKEND_NAMES,
                   help="the workers' engine: torch (pdserve's own), tensorrt-llm (a GPU "
                   "with TensorRT-LLM installed; see docs/backends.md) or sim (modelled "
                   "accelerators; see docs/simulation.md)")  # fmt: skip
    p.add_argument("--sim-profile", default=DEFAULT_SIM_PROFILE,
                   help="with --backend sim: the timing model, roofline:ACCEL:MODEL[:tpN] or "
                   "fitted:FILE (default: %(default)s)")  # fmt: skip
    p.add_argument(
        "--sim-time-scale",
        type=float,
        default=1.0,
        help="with --backend sim: every modelled second lasts this many real ones",
    )
    p.add_argument("--sim-link", default=DEFAULT_LINK,
                   help="with --backend sim: the modelled link of hand-offs (nvlink, rdma-400, "
                   "rdma-200, tcp-25, same-host)")  # fmt: skip
    p.add_argument(
        "--kv-store",
        default="embedded",
        choices=KV_STORES,
        help="the KV store: pdserve's KV store service (embedded), or a Mooncake "
        "Store whose mooncake_master this starts (needs pdserve[mooncake])",
    )
    p.add_argument(
        "--mooncake-segment",
        default="256MiB",
        metavar="BYTES",
        help="with --kv-store mooncake: memory each worker lends the store",
    )
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="an existing Redis (default: $REDIS_URL, else embedded)")  # fmt: skip
    p.add_argument("--port", type=int, default=50051, help="router port (0: any free port)")
    p.add_argument(
        "--http-port", type=int, default=DEFAULT_HTTP_PORT,
        help="OpenAI-compatible HTTP gateway port (0: any free port)",
    )  # fmt: skip
    p.add_argument("--no-http", action="store_true", help="start no HTTP gateway")
    p.add_argument("--log-dir", type=Path, help="service logs (default: a temporary dir)")
    p.add_argument("--no-host-lease", dest="host_lease", action="store_false",
                   help="let the workers' engines run at once on this host's cores instead of "
                   "taking turns (decode steps first)")  # fmt: skip
    p.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="stop the whole cluster when a service dies instead of restarting it",
    )
    p.add_argument("--max-restarts", type=int, default=RestartPolicy().crash_loop_restarts,
                   metavar="N", help="restarts of one service within a minute before it is "
                   "given up (default: %(default)s)")  # fmt: skip
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="extra worker flag, repeatable: --worker-arg=--dtype=float32")  # fmt: skip
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="extra HTTP gateway flag, repeatable: "
                   "--gateway-arg=--allow-unknown-fields")  # fmt: skip
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="send traces to this OTLP gRPC collector (Jaeger: http://localhost:4317)",
    )
    p.add_argument(
        "--trace-file",
        type=Path,
        metavar="PATH",
        help="append every span to this JSON-lines file (pdserve trace report)",
    )
    p.add_argument(
        "--metrics-base-port",
        type=int,
        default=0,
        metavar="PORT",
        help="/metrics ports PORT, PORT+1, ... in start order (default: free ports)",
    )
    add_up_security_args(p)
    return p


def main_up(argv: Sequence[str]) -> int:
    """``pdserve up``: start a cluster, print how to use it, stop it on Ctrl-C or SIGTERM."""
    args = up_parser().parse_args(list(argv))
    if args.router_client_auth and args.tls is None:
        raise InvalidArgumentError("--router-client-auth", "needs --tls DIR")
    if args.kv_store == "mooncake":
        load_mooncake("--kv-store")  # without the package: refused now, naming the extra
    if args.tls is None:
        print(INSECURE_WARNING, file=sys.stderr, flush=True)
    worker_args = [*args.worker_arg, *sim_worker_args(args)]
    model = args.model if args.model is not None else default_model(args.preset)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = Cluster(
        model, num_prefill=args.prefill, num_decode=args.decode, mode=args.mode,
        redis_url=args.redis_url, router_port=args.port, log_dir=args.log_dir,
        worker_args=worker_args, trace_file=args.trace_file,
        otlp_endpoint=args.otlp_endpoint, metrics_base_port=args.metrics_base_port,
        host_lease=args.host_lease, backend=args.backend, supervise=args.restart,
        restart_policy=RestartPolicy(crash_loop_restarts=args.max_restarts),
        announce=lambda line: print(f"pdserve up: {line}", file=sys.stderr, flush=True),
        http_port=None if args.no_http else args.http_port, gateway_args=args.gateway_arg,
        tls_dir=args.tls, router_client_auth=args.router_client_auth, api_keys=args.api_keys,
        kv_store=args.kv_store, mooncake_segment=args.mooncake_segment,
        # TensorRT-LLM compiles and loads each worker's engine at start: minutes, not seconds.
        startup_timeout_s=900.0 if args.backend == TENSORRT_LLM else 180.0,
    )  # fmt: skip
    check_ports(cluster, args)
    print(f"starting pdserve ({args.mode}, {args.backend}, model {model}) ...", flush=True)
    with cluster:
        address = cluster.router_address
        state = publish(
            UpState(
                pid=os.getpid(), router=address, redis_url=cluster.redis_url or "",
                namespace=cluster.namespace, http_url=None if args.no_http else cluster.http_url,
                log_dir=str(cluster.log_dir),
            ),
            runtime_dir(),
        )  # fmt: skip
        try:
            return _serve(cluster, args, model, address, stop)
        finally:
            state.unlink(missing_ok=True)


def _serve(
    cluster: Cluster, args: argparse.Namespace, model: Path, address: str, stop: threading.Event
) -> int:
    """Greet, then watch the children until Ctrl-C/SIGTERM (``stop``) or a fatal exit."""
    telemetry = describe_telemetry(cluster.metrics_urls(), cluster.child_env(), cluster.log_dir)
    http = ""
    if not args.no_http:
        ca = cluster.certs.ca if cluster.certs is not None else None
        http = _http_lines(cluster.http_url, model.name, ca, api_key=args.api_keys is not None)
    print(
        f"\npdserve is up: router at {address} (redis {redacted(cluster.redis_url or '')}, "
        f"logs in {cluster.log_dir})\n{http}\ntry it:\n{how_to_call(cluster, address)}\n\n"
        f"{telemetry}\n\n"
        "Ctrl-C stops everything.",
        flush=True,
    )
    while not stop.wait(0.5):  # also a check of the children twice a second
        if cluster.supervisor is not None:
            if cluster.supervisor.fatal.is_set():
                gone = ", ".join(cluster.supervisor.given_up())
                print(f"pdserve up: {gone} keeps dying; stopping", file=sys.stderr)
                return 1
            continue
        dead = cluster.failed()
        if dead:
            for s in dead:
                print(
                    f"pdserve up: {s.name} exited unexpectedly:\n{s.log_tail()}",
                    file=sys.stderr,
                )
            return 1
    print("stopping ...", flush=True)
    return 0


def check_ports(cluster: Cluster, args: argparse.Namespace) -> None:
    """Refuse, before anything starts, a fixed port that another process holds, naming the
    flag that chose it (every service binds 127.0.0.1 here)."""
    wanted = [("--port", args.port)]
    if cluster.http_port:
        wanted.append(("--http-port", cluster.http_port))
    base = cluster.metrics_base_port
    if base:
        wanted += [("--metrics-base-port", base + i) for i in range(cluster.num_services)]
    for flag, port in wanted:
        if port and not _port_free(port):
            zero = "free ports" if flag == "--metrics-base-port" else "any free port"
            raise InvalidArgumentError(
                flag, f"port {port} is already in use; choose another with {flag} (0: {zero})"
            )


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on ``host:port`` (a port in TIME_WAIT counts as free, as it does for
    the services, which bind with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def sim_worker_args(args: argparse.Namespace) -> list[str]:
    """The sim flags for the workers, checked here first so that a bad one stops ``up``
    before anything starts; none unless ``--backend sim``."""
    if args.backend != SIM:
        return []
    from pdserve.sim.backend import SimOptions

    SimOptions.parse(args.sim_profile, args.sim_time_scale, args.sim_link)
    return sim_flags(args.sim_profile, args.sim_time_scale, args.sim_link)


def _http_lines(url: str, model: str, ca: Path | None = None, *, api_key: bool = False) -> str:
    """The banner's lines on the gateway: its URL and a curl request (trusting the cluster's
    CA ``ca`` over HTTPS, with the caller's key from ``$PDSERVE_API_KEY`` when keys are on)."""
    body = f'{{"model": "{model}", "prompt": "Once upon a time", "max_tokens": 32}}'
    flags = f" --cacert {ca}" if ca is not None else ""
    if api_key:
        flags += ' -H "Authorization: Bearer $PDSERVE_API_KEY"'
    return (
        f"OpenAI-compatible HTTP API at {url}/v1 (model {model!r}):\n"
        f"  curl {url}/v1/completions{flags} -H 'Content-Type: application/json' -d '{body}'\n"
    )
