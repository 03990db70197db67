"""Fuzz every RPC's request message against a real cluster (router, scheduler, KV store, one
prefill and one decode worker, Redis), started once for the module.

Requests are generated with hypothesis (``fuzz_messages``): random messages of each type,
messages steered towards what the services accept (so that they reach the engines), and raw
random bytes. Every answer must be OK or a clean status: never UNKNOWN, INTERNAL, a traceback
or a hang. Afterwards every process is alive and healthy and nothing is held: no KV block on a
worker, no reservation in Redis, no KV store entry or pending write, no shm hand-off.

What the fuzzer itself acquires as a client is handed back as a client would: reservations it
got from ``Scheduler.Assign`` are released, hand-offs it got from ``Prefill`` are decoded,
entries it stored with ``KVStore.Put`` are deleted.

``PDSERVE_FUZZ_EXAMPLES`` (default 20) sets the random examples per test (each test covers
a service's RPCs); the default keeps the module under a minute on two cores.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdserve.kvstore.chunks import split
from pdserve.kvstore.wire import encode
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.models.demo import init_checkpoint
from pdserve.service_process import healthy
from pdserve.transfer.janitor import SHM_DIR, holds_hand_off, parse_owner_pid
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    kvstore_pb2,
    prefill_pb2,
    router_pb2,
    scheduler_pb2,
)
from tests.integration.fuzz_messages import FLOATS, TEXT, messages

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "20"))
MAX_LEN = 96
"""max_position_embeddings of the checkpoint: every accepted request is short."""
VOCAB = 2048
CALL_TIMEOUT_S = 30.0
WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
               "--heartbeat-interval-s", "0.2", "--janitor-interval-s", "0.5")  # fmt: skip
CLEAN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    # A hand-off to an address that is no KV endpoint, a store entry that went away.
    grpc.StatusCode.UNAVAILABLE,
}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Fuzzed:
    """The cluster under fuzz, a channel per address, and what the fuzzer holds."""

    cluster: Cluster
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    reservations: set[str] = field(default_factory=set)
    stored: set[tuple[str, str]] = field(default_factory=set)
    """(address, key) of entries the fuzzer's own Puts stored."""
    pushed: set[str] = field(default_factory=set)
    """Keys of hand-offs the decode worker's inbox took from the fuzzer's Pushes."""
    answers: dict[str, set[str]] = field(default_factory=dict)
    """Method -> status codes seen (for the report of a failure)."""

    def channel(self, address: str) -> grpc.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.insecure_channel(address)
        return self.channels[address]

    @property
    def prefill(self) -> str:
        return self.cluster.workers("prefill")[0].address

    @property
    def decode(self) -> str:
        return self.cluster.workers("decode")[0].address

    @property
    def fingerprint(self) -> str:
        """The KV fingerprint of the workers' model, from their heartbeats."""
        assert self.cluster.redis_url is not None
        (fp,) = {w.model_fingerprint for w in read_heartbeats(self.cluster.redis_url)}
        return fp

    def call(
        self,
        address: str,
        method: str,
        request: Any,
        *,
        streaming: bool = False,
        request_stream: bool = False,
    ) -> tuple[grpc.StatusCode, bytes | list[bytes]]:
        """Send ``request`` (a message, raw bytes, or a list for a request stream) to
        ``method``; the status and the raw answer. Fails the test on an unclean status."""
        raw = [_raw(r) for r in request] if request_stream else _raw(request)
        ch = self.channel(address)
        code, answer, details = grpc.StatusCode.OK, b"", ""
        try:
            if request_stream:
                answer = ch.stream_unary(method)(iter(raw), timeout=CALL_TIMEOUT_S)
            elif streaming:
                answer = list(ch.unary_stream(method)(raw, timeout=CALL_TIMEOUT_S))
            else:
                answer = ch.unary_unary(method)(raw, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            code, details = err.code(), err.details() or ""  # type: ignore[attr-defined]
        self.answers.setdefault(method, set()).add(code.name)
        assert code in CLEAN, f"{method} answered {code.name}: {details}\nrequest: {request!r}"
        assert "Traceback" not in details and not details.startswith("internal error"), details
        assert "engine failed" not in details, details
        return code, answer


def _raw(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    model = init_checkpoint(
        tmp_path_factory.mktemp("fuzz_model"), "tiny", dtype="float32",
        max_position_embeddings=MAX_LEN,
    )  # fmt: skip
    with Cluster(model, worker_args=WORKER_ARGS, log_level="WARNING") as c:
        f = Fuzzed(c)
        try:
            yield f
        finally:
            for ch in f.channels.values():
                ch.close()


# -- strategies steered towards what the services accept ------------------------------------------

VALID_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
TOKEN_IDS = st.one_of(
    VALID_IDS,
    st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1)), max_size=40),
)
SMALL_MAX_TOKENS = st.one_of(st.integers(1, 6), st.sampled_from([0, MAX_LEN, 2**32 - 1]))
PRINTABLE = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=6)


@st.composite
def valid_sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    """Parameters the router accepts, their edges included."""
    msg = common_pb2.SamplingParams(
        max_tokens=draw(st.integers(1, 6)),
        top_k=draw(st.sampled_from([0, 1, 5, VOCAB, 2**32 - 1])),
        ignore_eos=draw(st.booleans()),
        stop=draw(st.lists(PRINTABLE, max_size=3)),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
    )
    temperature = draw(st.one_of(st.none(), st.sampled_from([0.0, 5e-324, 1e-320, 1e-5, 0.7,
                                                             1.0, 3.0, 1e308])))  # fmt: skip
    if temperature is not None:
        msg.temperature = temperature
    top_p = draw(st.one_of(st.none(), st.sampled_from([5e-324, 1e-300, 0.1, 0.9, 1.0])))
    if top_p is not None:
        msg.top_p = top_p
    seed = draw(st.one_of(st.none(), st.sampled_from([0, 1, 2**63 - 1])))
    if seed is not None:
        msg.seed = seed
    return msg


SAMPLING = st.one_of(
    valid_sampling(),
    messages(
        common_pb2.SamplingParams,
        max_tokens=SMALL_MAX_TOKENS,
        stop=st.lists(TEXT, max_size=4),
        stop_token_ids=st.lists(st.integers(0, VOCAB + 2), max_size=4),
    ),
)
WORDS = st.lists(st.sampled_from(["the", "cat", "é", "東京", "🙂", " ", "\n", "sat"]),
                 min_size=1, max_size=20).map(" ".join)  # fmt: skip
NAMES = st.one_of(st.just(""), st.text("abcdef-_0123456789", min_size=1, max_size=12), TEXT)


def _prompt_variants() -> st.SearchStrategy[router_pb2.GenerateRequest]:
    plausible = st.builds(
        lambda text, ids, which, sampling, rid, tenant, skip: _generate_request(
            text if which else None, ids, sampling, rid, tenant, skip
        ),
        st.one_of(WORDS, TEXT), TOKEN_IDS, st.booleans(), SAMPLING,
        st.one_of(st.none(), NAMES), NAMES, st.booleans(),
    )  # fmt: skip
    return st.one_of(plausible, messages(router_pb2.GenerateRequest, sampling=SAMPLING))


def _generate_request(
    text: str | None,
    ids: list[int],
    sampling: common_pb2.SamplingParams,
    rid: str | None,
    tenant: str,
    skip: bool,
) -> router_pb2.GenerateRequest:
    msg = router_pb2.GenerateRequest(sampling=sampling, tenant=tenant, skip_special_tokens=skip)
    if text is not None:
        msg.text = text
    else:
        msg.token_ids.ids.extend(ids)
    if rid is not None:
        msg.request_id = f"fz-{rid}"  # never the id of a request of another example
    return msg


def _unique(prefix: str) -> st.SearchStrategy[str]:
    return st.integers(0, 2**40).map(lambda n: f"{prefix}-{time.monotonic_ns()}-{n}")


# -- router ----------------------------------------------------------------------------------------


@FUZZ
@given(request=_prompt_variants(), streaming=st.booleans())
@example(  # explicit examples always run: each method is reached for sure
    request=router_pb2.GenerateRequest(
        text="the cat",
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=1e-320, stop=["a"]),
    ),
    streaming=True,
)
@example(
    request=router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(max_tokens=2, top_p=1e-300, seed=2**63 - 1)),
    streaming=False,
)  # fmt: skip
def test_router_generate(
    fuzzed: Fuzzed, request: router_pb2.GenerateRequest, streaming: bool
) -> None:
    method = "/pdserve.v1.Router/" + ("Generate" if streaming else "GenerateUnary")
    code, answer = fuzzed.call(fuzzed.cluster.router_address, method, request, streaming=streaming)
    if code is not grpc.StatusCode.OK:
        return
    if streaming:
        assert isinstance(answer, list)
        reason = router_pb2.GenerateChunk.FromString(answer[-1]).finish_reason
    else:
        assert isinstance(answer, bytes)
        reason = router_pb2.GenerateResponse.FromString(answer).finish_reason
    assert reason != common_pb2.FINISH_REASON_UNSPECIFIED


# -- scheduler ---------------------------------------------------------------------------------


@FUZZ
@given(
    assign=messages(scheduler_pb2.AssignRequest, max_tokens=SMALL_MAX_TOKENS),
    release=messages(scheduler_pb2.ReleaseRequest),
    renew=messages(scheduler_pb2.RenewRequest),
    listing=messages(scheduler_pb2.ListWorkersRequest),
)
@example(
    assign=scheduler_pb2.AssignRequest(request_id="fz-assign", prompt_tokens=5, max_tokens=5),
    release=scheduler_pb2.ReleaseRequest(reservation_id="fz-none", prefill_only=True),
    renew=scheduler_pb2.RenewRequest(reservation_id="fz-none"),
    listing=scheduler_pb2.ListWorkersRequest(),
)
def test_scheduler(
    fuzzed: Fuzzed,
    assign: scheduler_pb2.AssignRequest,
    release: scheduler_pb2.ReleaseRequest,
    renew: scheduler_pb2.RenewRequest,
    listing: scheduler_pb2.ListWorkersRequest,
) -> None:
    address = fuzzed.cluster.scheduler_address
    code, answer = fuzzed.call(address, "/pdserve.v1.Scheduler/Assign", assign)
    if code is grpc.StatusCode.OK:
        assert isinstance(answer, bytes)
        fuzzed.reservations.add(scheduler_pb2.Assignment.FromString(answer).reservation_id)
    fuzzed.call(address, "/pdserve.v1.Scheduler/Renew", renew)
    fuzzed.call(address, "/pdserve.v1.Scheduler/Release", release)
    fuzzed.call(address, "/pdserve.v1.Scheduler/ListWorkers", listing)


# -- workers -----------------------------------------------------------------------------------


@st.composite
def prefill_requests(draw: st.DrawFn) -> prefill_pb2.PrefillRequest:
    """Mostly what a router sends; ``decode_address`` "decode" stands for the real one."""
    transports = ["", "auto", "store", "direct", "shm", "recompute"]
    return prefill_pb2.PrefillRequest(
        request_id=draw(_unique("fz-prefill")),
        prompt_token_ids=draw(TOKEN_IDS),
        sampling=draw(SAMPLING),
        tenant=draw(NAMES),
        reservation_id=draw(NAMES),
        decode_address=draw(st.one_of(st.just("decode"), st.just("127.0.0.1:1"), TEXT)),
        decode_host=draw(st.one_of(st.sampled_from([socket.gethostname(), ""]), TEXT)),
        transport=draw(st.one_of(st.sampled_from(transports), TEXT)),
    )


@FUZZ
@given(request=st.one_of(prefill_requests(), messages(prefill_pb2.PrefillRequest)))
@example(
    request=prefill_pb2.PrefillRequest(
        request_id="fz-prefill-shm",
        prompt_token_ids=list(range(3, 40)),
        sampling=common_pb2.SamplingParams(max_tokens=3),
        decode_address="decode",
        decode_host=socket.gethostname(),
        transport="shm",
    )
)
@example(
    request=prefill_pb2.PrefillRequest(
        request_id="fz-prefill-store", prompt_token_ids=[9, 8, 7],
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.5), transport="store",
    )
)  # fmt: skip
def test_prefill(fuzzed: Fuzzed, request: prefill_pb2.PrefillRequest) -> None:
    if request.decode_address == "decode":
        request.decode_address = fuzzed.decode
    code, answer = fuzzed.call(fuzzed.prefill, "/pdserve.v1.Prefill/Prefill", request)
    if code is not grpc.StatusCode.OK:
        return
    assert isinstance(answer, bytes)
    response = prefill_pb2.PrefillResponse.FromString(answer)
    if response.HasField("kv"):  # the router's part: the decode worker takes the hand-off
        decode = decode_pb2.DecodeRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            first_token_id=response.first_token_id,
            first_logprob=response.first_logprob,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2),
            kv=response.kv,
            tenant=request.tenant,
        )
        fuzzed.call(fuzzed.decode, "/pdserve.v1.Decode/Decode", decode, streaming=True)


@st.composite
def decode_requests(draw: st.DrawFn) -> decode_pb2.DecodeRequest:
    """Mostly what a router sends (a handle saying "recompute", of the worker's model)."""
    prompt = draw(TOKEN_IDS)
    recompute = common_pb2.KVHandle(
        num_tokens=len(prompt),
        model_fingerprint=FINGERPRINT,
        recompute=common_pb2.RecomputeLocation(reason=draw(TEXT)),
    )
    return decode_pb2.DecodeRequest(
        request_id=draw(_unique("fz-decode")),
        prompt_token_ids=prompt,
        first_token_id=draw(st.integers(0, VOCAB + 1)),
        first_logprob=draw(FLOATS),
        sampling=draw(SAMPLING),
        kv=draw(st.one_of(st.just(recompute), messages(common_pb2.KVHandle))),
        tenant=draw(NAMES),
    )


FINGERPRINT = "the decode worker's"
"""Stands for the decode worker's model fingerprint (read from its heartbeat)."""


@FUZZ
@given(
    request=st.one_of(decode_requests(), messages(decode_pb2.DecodeRequest)),
    prefetch=messages(decode_pb2.PrefetchRequest),
    cached=messages(decode_pb2.CachedPrefixRequest),
)
@example(
    request=decode_pb2.DecodeRequest(
        request_id="fz-decode-recompute", prompt_token_ids=[4, 5, 6], first_token_id=7,
        sampling=common_pb2.SamplingParams(max_tokens=4),
        kv=common_pb2.KVHandle(num_tokens=3, model_fingerprint=FINGERPRINT,
                               recompute=common_pb2.RecomputeLocation(reason="fuzz")),
    ),
    prefetch=decode_pb2.PrefetchRequest(),
    cached=decode_pb2.CachedPrefixRequest(kv_fingerprint="x", block_size=8,
                                          block_hashes=[b"\0" * 16]),
)  # fmt: skip
def test_decode(
    fuzzed: Fuzzed,
    request: decode_pb2.DecodeRequest,
    prefetch: decode_pb2.PrefetchRequest,
    cached: decode_pb2.CachedPrefixRequest,
) -> None:
    if request.kv.model_fingerprint == FINGERPRINT:
        request.kv.model_fingerprint = fuzzed.fingerprint
    fuzzed.call(fuzzed.decode, "/pdserve.v1.Decode/Decode", request, streaming=True)
    fuzzed.call(fuzzed.decode, "/pdserve.v1.Decode/Prefetch", prefetch)
    fuzzed.call(fuzzed.decode, "/pdserve.v1.Decode/CachedPrefix", cached)


# -- KV store (the store, and the decode worker's own endpoint) ---------------------------------


@st.composite
def valid_puts(draw: st.DrawFn) -> list[bytes]:
    """A chunk stream as a client sends it, with a random lease, size claim, cache flag."""
    chunks = list(
        split(
            draw(st.binary(max_size=96)),
            key=draw(_unique("fz-put")),
            header=draw(st.binary(max_size=16)),
            lease_s=draw(st.one_of(st.sampled_from([0.0, 0.5, 30.0]), FLOATS)),
            chunk_bytes=draw(st.integers(1, 64)),
            cache=draw(st.booleans()),
        )
    )
    claim = draw(st.one_of(st.none(), st.sampled_from([0, 1, 2**31, 2**64 - 1])))
    if claim is not None:  # a false total size (2 GiB of junk announced, ...)
        chunks[0].total_bytes = claim
    return [encode(c) for c in chunks]


RANDOM_PUTS = st.lists(
    messages(kvstore_pb2.KVChunk, key=_unique("fz-kv"), lease_s=FLOATS), min_size=1, max_size=3
)


@FUZZ
@given(
    target=st.sampled_from(["kvstore", "decode"]),
    chunks=st.one_of(valid_puts(), RANDOM_PUTS),
    get=messages(kvstore_pb2.GetRequest),
    lookup=messages(kvstore_pb2.LookupRequest),
    delete=messages(kvstore_pb2.DeleteRequest),
    stat=messages(kvstore_pb2.StatRequest),
)
@example(
    target="kvstore",
    chunks=[encode(c) for c in split(b"x" * 50, key="fz-put-example", lease_s=5.0,
                                     chunk_bytes=16)],
    get=kvstore_pb2.GetRequest(key="fz-put-example"),
    lookup=kvstore_pb2.LookupRequest(), delete=kvstore_pb2.DeleteRequest(),
    stat=kvstore_pb2.StatRequest(key="fz-put-example"),
)  # fmt: skip
def test_kvstore(
    fuzzed: Fuzzed,
    target: str,
    chunks: list[kvstore_pb2.KVChunk] | list[bytes],
    get: kvstore_pb2.GetRequest,
    lookup: kvstore_pb2.LookupRequest,
    delete: kvstore_pb2.DeleteRequest,
    stat: kvstore_pb2.StatRequest,
) -> None:
    if target == "decode":  # the decode worker takes layer streams by Push, nothing else
        address = fuzzed.decode
        code, answer = fuzzed.call(address, "/pdserve.v1.Decode/Push", chunks, request_stream=True)
        if code is grpc.StatusCode.OK:
            assert isinstance(answer, bytes)
            fuzzed.pushed.add(kvstore_pb2.PutResponse.FromString(answer).key)
        fuzzed.call(address, "/pdserve.v1.Decode/Drop", delete)
        fuzzed.call(address, "/pdserve.v1.Decode/InboxStat", decode_pb2.InboxStatRequest())
        return
    address = fuzzed.cluster.kvstore_address
    code, answer = fuzzed.call(address, "/pdserve.v1.KVStore/Put", chunks, request_stream=True)
    if code is grpc.StatusCode.OK:
        assert isinstance(answer, bytes)
        fuzzed.stored.add((address, kvstore_pb2.PutResponse.FromString(answer).key))
    fuzzed.call(address, "/pdserve.v1.KVStore/Get", get, streaming=True)
    fuzzed.call(address, "/pdserve.v1.KVStore/Lookup", lookup)
    fuzzed.call(address, "/pdserve.v1.KVStore/Delete", delete)
    fuzzed.call(address, "/pdserve.v1.KVStore/Stat", stat)


# -- health, and raw bytes to every method ---------------------------------------------------

UNARY = [
    ("router", "/pdserve.v1.Router/GenerateUnary"),
    ("scheduler", "/pdserve.v1.Scheduler/Assign"),
    ("scheduler", "/pdserve.v1.Scheduler/Release"),
    ("scheduler", "/pdserve.v1.Scheduler/Renew"),
    ("scheduler", "/pdserve.v1.Scheduler/ListWorkers"),
    ("prefill", "/pdserve.v1.Prefill/Prefill"),
    ("decode", "/pdserve.v1.Decode/Prefetch"),
    ("decode", "/pdserve.v1.Decode/CachedPrefix"),
    ("kvstore", "/pdserve.v1.KVStore/Lookup"),
    ("kvstore", "/pdserve.v1.KVStore/Delete"),
    ("kvstore", "/pdserve.v1.KVStore/Stat"),
    ("decode", "/grpc.health.v1.Health/Check"),
]
SERVER_STREAMS = [
    ("router", "/pdserve.v1.Router/Generate"),
    ("decode", "/pdserve.v1.Decode/Decode"),
    ("kvstore", "/pdserve.v1.KVStore/Get"),
]


def _address(f: Fuzzed, service: str) -> str:
    c = f.cluster
    return {
        "router": c.router_address, "scheduler": c.scheduler_address,
        "kvstore": c.kvstore_address, "prefill": f.prefill, "decode": f.decode,
    }[service]  # fmt: skip


@FUZZ
@given(
    check=messages(health_pb2.HealthCheckRequest),
    target=st.sampled_from(["router", "scheduler", "kvstore", "prefill", "decode"]),
)
def test_health(fuzzed: Fuzzed, check: health_pb2.HealthCheckRequest, target: str) -> None:
    code, answer = fuzzed.call(_address(fuzzed, target), "/grpc.health.v1.Health/Check", check)
    if code is grpc.StatusCode.OK:  # a service this server hosts
        assert isinstance(answer, bytes)
        status = health_pb2.HealthCheckResponse.FromString(answer).status
        assert status == health_pb2.HealthCheckResponse.SERVING


@FUZZ
@given(
    method=st.sampled_from([*UNARY, *SERVER_STREAMS]),
    raw=st.one_of(st.binary(max_size=64), st.just(b"\x0a\x02\xff\xfe")),
    put=st.lists(st.binary(max_size=32), min_size=1, max_size=3),
)
def test_raw_bytes(fuzzed: Fuzzed, method: tuple[str, str], raw: bytes, put: list[bytes]) -> None:
    service, path = method
    fuzzed.call(_address(fuzzed, service), path, raw, streaming=(service, path) in SERVER_STREAMS)
    code, answer = fuzzed.call(
        fuzzed.cluster.kvstore_address, "/pdserve.v1.KVStore/Put", put, request_stream=True
    )
    if code is grpc.StatusCode.OK:
        assert isinstance(answer, bytes)
        key = kvstore_pb2.PutResponse.FromString(answer).key
        fuzzed.stored.add((fuzzed.cluster.kvstore_address, key))


# -- afterwards ----------------------------------------------------------------------------------


def test_everything_survived_and_nothing_is_held(fuzzed: Fuzzed) -> None:
    """Runs last (file order): every process up and SERVING, nothing held anywhere."""
    c = fuzzed.cluster
    assert not c.failed(), [s.name for s in c.failed()]
    assert all(healthy(s.address) for s in c.services)
    for reservation in fuzzed.reservations:
        fuzzed.call(c.scheduler_address, "/pdserve.v1.Scheduler/Release",
                    scheduler_pb2.ReleaseRequest(reservation_id=reservation))  # fmt: skip
    for address, key in fuzzed.stored:
        fuzzed.call(address, "/pdserve.v1.KVStore/Delete", kvstore_pb2.DeleteRequest(key=key))
    for key in fuzzed.pushed:
        fuzzed.call(fuzzed.decode, "/pdserve.v1.Decode/Drop", kvstore_pb2.DeleteRequest(key=key))
    deadline = time.monotonic() + 30
    while problems := _held(fuzzed):
        assert time.monotonic() < deadline, "still held after the fuzz:\n" + "\n".join(problems)
        time.sleep(0.1)  # polling other processes: nothing to wait on
    # The explicit examples made every kind of call succeed at least once.
    for method in ("Router/Generate", "Router/GenerateUnary", "Scheduler/Assign",
                   "Prefill/Prefill", "Decode/Decode", "KVStore/Put", "KVStore/Get"):  # fmt: skip
        assert "OK" in fuzzed.answers[f"/pdserve.v1.{method}"], method
    print("answers by method:", {m: sorted(codes) for m, codes in fuzzed.answers.items()})


def _held(f: Fuzzed) -> list[str]:
    c = f.cluster
    assert c.redis_url is not None
    problems: list[str] = []
    _, raw = f.call(c.kvstore_address, "/pdserve.v1.KVStore/Stat", kvstore_pb2.StatRequest())
    assert isinstance(raw, bytes)
    t = kvstore_pb2.StatResponse.FromString(raw)
    if t.num_entries - t.num_cache_entries or t.num_writing or t.reserved_bytes:
        problems.append(
            f"kvstore: {t.num_entries} entries ({t.num_cache_entries} cache), "
            f"{t.num_writing} writing, {t.reserved_bytes} bytes reserved"
        )
    _, raw = f.call(f.decode, "/pdserve.v1.Decode/InboxStat", decode_pb2.InboxStatRequest())
    assert isinstance(raw, bytes)
    inbox = decode_pb2.InboxStatResponse.FromString(raw)
    if inbox.num_entries or inbox.num_writing or inbox.used_bytes:
        problems.append(
            f"decode inbox: {inbox.num_entries} entries, {inbox.num_writing} arriving, "
            f"{inbox.used_bytes} bytes"
        )
    for w in read_heartbeats(c.redis_url, c.namespace):
        if w.kv_blocks_free != w.kv_blocks_total or w.running_seqs or w.reservations or w.draining:
            problems.append(
                f"{w.id}: {w.kv_blocks_free}/{w.kv_blocks_total} blocks free, "
                f"{w.running_seqs} running, {w.reservations}, draining={w.draining}"
            )
    client = redis.Redis.from_url(c.redis_url)
    try:
        ns = c.namespace
        if records := list(client.scan_iter(match=f"{ns}:reservation:*")):
            problems.append(f"reservation records in Redis: {records[:5]}")
        for key in client.scan_iter(match=f"{ns}:resv:*"):
            if client.zcard(key):
                problems.append(f"{key!r} holds {client.zrange(key, 0, -1)[:5]}")
    finally:
        client.close()
    pids = {s.proc.pid for s in c.services if s.proc is not None}
    shm = [p.name for p in SHM_DIR.glob("pdserve-kv-*")
           if parse_owner_pid(p.name) in pids and holds_hand_off(p)]  # fmt: skip
    if shm:
        problems.append(f"shm hand-offs left: {shm}")
    return problems
