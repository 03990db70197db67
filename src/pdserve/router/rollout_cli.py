"""``pdserve rollout``: show, shift or roll back the routers' split between serving modes.

    pdserve rollout set disaggregated=10%            # 10% disaggregated, the rest colocated
    pdserve rollout set disaggregated=50% --rest conditional --tenant acme=colocated
    pdserve rollout set disaggregated=0%             # roll back: everything colocated
    pdserve rollout show
    pdserve rollout clear                            # no split: each router's own --mode

The split is stored in Redis and every router that follows it (``--redis-url``) applies it
within a moment (``router.rollout``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Sequence

from redis.exceptions import RedisError

from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.router.rollout import ARMS, Rollout, parse_shares, read_rollout, write_rollout
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import connect


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve rollout",
        description="the routers' traffic split between serving modes (arms)",
    )
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--namespace", default="pdserve")
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("set", help="set the split: ARM=PERCENT ... (arms: " + ", ".join(ARMS) + ")")
    s.add_argument("shares", nargs="*", metavar="ARM=PERCENT")
    s.add_argument("--rest", default="colocated", choices=ARMS, help="arm of the remaining share")
    s.add_argument(
        "--tenant", action="append", default=[], metavar="TENANT=ARM",
        help="send every request of TENANT to ARM (repeatable)",
    )  # fmt: skip
    sub.add_parser("show", help="print the split")
    sub.add_parser("clear", help="remove the split (each router uses its --mode)")
    return p


def _tenants(specs: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for spec in specs:
        tenant, sep, arm = spec.partition("=")
        if not sep or not tenant:
            raise InvalidArgumentError("--tenant", f"expected TENANT=ARM, got {spec!r}")
        out[tenant] = arm
    return out


async def _run(args: argparse.Namespace) -> str:
    redis = connect(args.redis_url)
    keys = KeySpace(args.namespace)
    try:
        if args.action == "show":
            current = await read_rollout(redis, keys)
            return (
                "no split (each router uses its --mode)" if current is None else current.describe()
            )
        if args.action == "clear":
            await write_rollout(redis, keys, None)
            return "split removed: each router uses its --mode"
        rollout = Rollout(parse_shares(args.shares), args.rest, _tenants(args.tenant))
        stored = await write_rollout(redis, keys, rollout)
        assert stored is not None
        return "split set, " + stored.describe()
    finally:
        await redis.aclose()


def main_rollout(argv: Sequence[str]) -> int:
    """Entry of ``pdserve rollout``."""
    args = _parser().parse_args(list(argv))
    try:
        print(asyncio.run(_run(args)))
    except (OSError, RedisError) as e:
        raise WorkerUnavailableError(f"cannot reach {args.redis_url}: {e}") from e
    return 0
