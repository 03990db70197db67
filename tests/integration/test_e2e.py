"""The whole system as separate processes: Redis, router, scheduler, KV store and workers.

One disaggregated cluster (2 prefill + 2 decode workers) serves the module; greedy outputs are
checked token for token against the in-process ``Engine`` on the same checkpoint and dtype,
streamed text against the tokenizer, and after every test nothing may be left behind: no KV
store entry, no busy KV block on any worker, no reservation in Redis.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import grpc
import pytest
import redis

from pdserve.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    Delta,
    InvalidRequest,
    RetryPolicy,
)
from pdserve.client.cli import main_generate
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import GenerationResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.models.demo import init_checkpoint
from pdserve.status import main_status
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import (
    common_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

pytestmark = pytest.mark.integration

MAX_LEN = 256
"""max_position_embeddings of the test checkpoint: small, so over-long prompts are cheap."""
WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "512",
               "--heartbeat-interval-s", "0.2")  # fmt: skip
NUM_REQUESTS = 32
SCHED_ARGS: tuple[str, ...] = ()
IDLE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Case:
    prompt: str | tuple[int, ...]
    max_tokens: int
    stop: tuple[str, ...] = ()


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(
        tmp_path_factory.mktemp("e2e_model"),
        "tiny",
        dtype="float32",
        max_position_embeddings=MAX_LEN,
    )


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    with Cluster(
        model_dir, num_prefill=2, num_decode=2, worker_args=WORKER_ARGS, scheduler_args=SCHED_ARGS
    ) as c:
        yield c


def _base_cases(vocab_size: int) -> list[Case]:
    rng = random.Random(1234)
    corpus = resources.files("pdserve.models.corpus")
    words = corpus.joinpath("words.txt").read_text(encoding="utf-8").split()
    sentences = [
        s for s in corpus.joinpath("unicode.txt").read_text(encoding="utf-8").splitlines() if s
    ]
    cases: list[Case] = []
    for i in range(NUM_REQUESTS - 4):
        max_tokens = rng.choice([1, 2, 5, 9, 17, 24, 32])
        if i % 7 == 3:  # a prompt given as token ids
            prompt: str | tuple[int, ...] = tuple(
                rng.randrange(vocab_size) for _ in range(rng.randint(1, 90))
            )
        elif i % 3 == 0:  # multi-byte UTF-8 text
            prompt = " ".join(rng.sample(sentences, rng.randint(1, 3)))
        else:
            prompt = " ".join(rng.choices(words, k=rng.choice([1, 3, 12, 40, 110])))
        cases.append(Case(prompt, max_tokens))
    return cases


def _stop_from(text: str) -> str | None:
    """A stop string that occurs in the middle of ``text``, to cut it there."""
    for start in range(2, max(2, len(text) - 3)):
        piece = text[start : start + 3]
        if piece.strip() and "\ufffd" not in piece:
            return piece
    return None


@pytest.fixture(scope="module")
def workload(model_dir: Path) -> list[tuple[Case, GenerationResult]]:
    """The requests and what the engine alone, in this process, answers to each (greedy)."""
    engine = Engine.from_pretrained(model_dir, dtype="float32")
    cases = _base_cases(engine.model_config.vocab_size)
    results = engine.generate([c.prompt for c in cases], [_params(c) for c in cases])
    # Four more requests end on a stop string taken from a longer answer.
    stop_cases: list[Case] = []
    for case, result in zip(cases, results, strict=True):
        stop = _stop_from(result.text) if case.max_tokens >= 9 else None
        if stop is not None and len(stop_cases) < 4:
            stop_cases.append(Case(case.prompt, case.max_tokens, (stop,)))
    assert len(stop_cases) == 4, "the workload needs four answers long enough for a stop string"
    results += engine.generate([c.prompt for c in stop_cases], [_params(c) for c in stop_cases])
    engine.check_no_leaks()
    return list(zip(cases + stop_cases, results, strict=True))


def _params(case: Case) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=case.max_tokens, stop=case.stop)


# -- helpers -------------------------------------------------------------------------------------


async def _stream_all(address: str, cases: list[Case]) -> list[list[Delta]]:
    async def one(client: AsyncClient, case: Case) -> list[Delta]:
        deltas: list[Delta] = []
        async with client.stream(
            case.prompt, max_tokens=case.max_tokens, temperature=0, stop=case.stop
        ) as stream:
            async for delta in stream:
                deltas.append(delta)
        return deltas

    async with AsyncClient(address, timeout=120) as client:
        return list(await asyncio.gather(*(one(client, c) for c in cases)))


def _idle_problems(cluster: Cluster) -> list[str]:
    assert cluster.redis_url is not None
    problems: list[str] = []
    with grpc.insecure_channel(cluster.kvstore_address) as channel:
        stat = kvstore_pb2_grpc.KVStoreStub(channel).Stat(
            kvstore_pb2.StatRequest(key=""), timeout=5
        )
    if stat.num_entries:
        problems.append(f"KV store holds {stat.num_entries} entries ({stat.used_bytes} bytes)")
    beats = read_heartbeats(cluster.redis_url, cluster.namespace)
    if len(beats) != len(cluster.workers()):
        problems.append(f"{len(beats)} heartbeats for {len(cluster.workers())} workers")
    for w in beats:
        if w.kv_blocks_free != w.kv_blocks_total or w.running_seqs or w.reservations:
            problems.append(
                f"{w.id}: {w.kv_blocks_free}/{w.kv_blocks_total} blocks free, "
                f"{w.running_seqs} running, reservations {w.reservations}"
            )
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        ns = cluster.namespace
        records = list(client.scan_iter(match=f"{ns}:reservation:*"))
        if records:
            problems.append(f"reservation records left in Redis: {records}")
        for key in client.scan_iter(match=f"{ns}:resv:*"):
            if client.zcard(key):
                problems.append(f"{key!r} still holds {client.zrange(key, 0, -1)}")
    finally:
        client.close()
    return problems


def wait_idle(cluster: Cluster) -> None:
    """Poll (bounded) until nothing is held anywhere; fail with what is left otherwise."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while problems := _idle_problems(cluster):
        if time.monotonic() > deadline:
            pytest.fail("cluster not idle:\n" + "\n".join(problems))
        time.sleep(0.1)


def _check_against_reference(
    case: Case, ref: GenerationResult, deltas: list[Delta], tokenizer: Tokenizer
) -> None:
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == ref.token_ids, f"token mismatch for {case}"
    # The first token arrives alone, as the first chunk; only the last chunk is final.
    assert len(deltas[0].token_ids) == 1 and deltas[0].request_id
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    last = deltas[-1]
    assert last.finish_reason == ref.finish_reason.value
    assert last.usage is not None and last.timing is not None
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert last.usage.completion_tokens == len(tokens)
    assert last.timing.e2e_ms >= last.timing.ttft_ms > 0
    text = "".join(d.text for d in deltas)
    assert text == ref.text
    full = tokenizer.decode(tokens)
    if case.stop:
        assert text == full[: full.index(case.stop[0])]
    else:
        assert text == full


# -- tests ---------------------------------------------------------------------------------------


def test_concurrent_greedy_requests_match_the_engine(
    cluster: Cluster, workload: list[tuple[Case, GenerationResult]], tokenizer: Tokenizer
) -> None:
    cases = [case for case, _ in workload]
    assert len(cases) == NUM_REQUESTS
    streams = asyncio.run(_stream_all(cluster.router_address, cases))
    for (case, ref), deltas in zip(workload, streams, strict=True):
        _check_against_reference(case, ref, deltas, tokenizer)
    # The unary method gives the same answers as the stream.
    with Client(cluster.router_address, timeout=60) as client:
        for (case, ref), deltas in list(zip(workload, streams, strict=True))[:4]:
            done = client.generate(
                case.prompt, max_tokens=case.max_tokens, temperature=0, stop=case.stop
            )
            assert done.token_ids == ref.token_ids
            assert done.text == "".join(d.text for d in deltas)
            assert done.finish_reason == ref.finish_reason.value
            assert done.usage is not None and deltas[-1].usage is not None
            # cached_tokens may differ: the second time round the prompt is in a prefix cache.
            assert done.usage.prompt_tokens == deltas[-1].usage.prompt_tokens
            assert done.usage.completion_tokens == len(ref.token_ids)
    wait_idle(cluster)


def test_colocated_mode_gives_the_same_greedy_tokens(
    model_dir: Path, workload: list[tuple[Case, GenerationResult]], tokenizer: Tokenizer
) -> None:
    with Cluster(
        model_dir,
        mode="colocated",
        num_decode=1,
        worker_args=WORKER_ARGS,
        scheduler_args=SCHED_ARGS,
    ) as colocated:
        assert [w.role for w in colocated.workers()] == ["mixed"]
        streams = asyncio.run(_stream_all(colocated.router_address, [c for c, _ in workload]))
        for (case, ref), deltas in zip(workload, streams, strict=True):
            _check_against_reference(case, ref, deltas, tokenizer)
            assert deltas[-1].timing is not None and deltas[-1].timing.transfer_bytes == 0
        wait_idle(colocated)


BAD_REQUESTS: list[tuple[str, dict[str, object], str]] = [
    ("", {}, "text"),
    ([], {}, "token_ids"),
    ([0, 5, 2048], {}, "token_ids"),  # id == vocab size
    ("hello", {"max_tokens": 0}, "sampling.max_tokens"),
    ("hello", {"max_tokens": 2**32 - 1}, "sampling.max_tokens"),  # fits the wire, not the model
    ("hello", {"max_tokens": MAX_LEN}, "sampling.max_tokens"),  # prompt + max_tokens > MAX_LEN
    (list(range(1, MAX_LEN + 1)), {"max_tokens": 1}, "token_ids"),  # prompt alone too long
    ("word " * MAX_LEN, {"max_tokens": 1}, "text"),
    ("hello", {"temperature": -0.5}, "sampling.temperature"),
    ("hello", {"top_p": 0.0}, "sampling.top_p"),
    ("hello", {"stop_token_ids": [4096]}, "sampling.stop_token_ids"),
    ("hello", {"stop": [""]}, "sampling.stop"),
    ("hello", {"request_id": "has space"}, "request_id"),
    ("hello", {"tenant": "x" * 1000}, "tenant"),
    # The router's per-request limits (its defaults).
    ("hello", {"stop": ["x"] * 17}, "sampling.stop"),
    ("hello", {"stop": ["y" * 1025]}, "sampling.stop"),
    ("hello", {"stop_token_ids": [1] * 129}, "sampling.stop_token_ids"),
    ("hello", {"request_id": "r" * 257}, "request_id"),
    ("é" * (8 * MAX_LEN + 1), {}, "text"),  # over 16 bytes per token of the model's length
]


@pytest.mark.parametrize(("prompt", "options", "field"), BAD_REQUESTS)
def test_bad_input_is_invalid_argument_naming_the_field(
    cluster: Cluster, prompt: object, options: dict[str, object], field: str
) -> None:
    with Client(cluster.router_address, timeout=30) as client:
        for call in (client.generate, lambda *a, **kw: list(client.stream(*a, **kw))):
            with pytest.raises(InvalidRequest) as info:
                call(prompt, **options)
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.field == field, info.value.message


def test_values_the_wire_cannot_carry_fail_in_the_client(cluster: Cluster) -> None:
    with Client(cluster.router_address) as client:
        with pytest.raises(InvalidRequest) as info:
            client.generate("hello", max_tokens=2**40)
        assert info.value.field == "sampling.max_tokens"
        with pytest.raises(InvalidRequest) as info:
            client.generate("hello", max_tokens=-1)
        assert info.value.field == "sampling.max_tokens"


def test_sampling_values_at_their_edges_are_served(cluster: Cluster) -> None:
    """Values that once killed an engine thread: now greedy, or the best token kept."""
    edges: list[dict[str, object]] = [
        {"temperature": 1e-320},
        {"temperature": 5e-324, "top_k": 2**32 - 1},
        {"temperature": 1.0, "top_p": 1e-300, "seed": 2**63 - 1},
        {"temperature": 0.7, "top_p": 5e-324, "seed": 0},
    ]
    with Client(cluster.router_address, timeout=60) as client:
        greedy = client.generate("edge", max_tokens=6, temperature=0, ignore_eos=True)
        for options in edges:
            done = client.generate("edge", max_tokens=6, ignore_eos=True, **options)  # type: ignore[arg-type]
            assert done.token_ids == greedy.token_ids, options
        # A sampling run with a huge temperature completes too (a uniform draw).
        wide = client.generate("edge", max_tokens=6, ignore_eos=True, temperature=1e308)
        assert len(wide.token_ids) == 6
    wait_idle(cluster)


def test_oversized_messages_are_refused_before_they_are_parsed(cluster: Cluster) -> None:
    # Over the router's receive bound (4 MiB for this model; RequestLimits.receive_bytes).
    huge = [
        router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[2**31] * 1_000_000)),
        router_pb2.GenerateRequest(
            text="hi", sampling=common_pb2.SamplingParams(stop=["stop"] * 1_000_000)
        ),
    ]
    with grpc.insecure_channel(cluster.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        for request in huge:
            with pytest.raises(grpc.RpcError) as info:
                router.GenerateUnary(request, timeout=30)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in info.value.details()
        # Below the size bound but over a count: refused by count, naming the field.
        with pytest.raises(grpc.RpcError) as info:
            router.GenerateUnary(
                router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[7] * 300)),
                timeout=30,
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("token_ids:")
    wait_idle(cluster)


def test_raw_requests_with_bad_oneof_and_enum_values(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.router_address) as channel:
        router = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            router.GenerateUnary(router_pb2.GenerateRequest(), timeout=10)  # no prompt at all
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("prompt:")
    # Proto3 enums are open: an out-of-range number parses and must be refused by the reader.
    with grpc.insecure_channel(cluster.scheduler_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            scheduler.Assign(
                scheduler_pb2.AssignRequest(request_id="r", prompt_tokens=3, max_tokens=3, mode=99),  # type: ignore[arg-type]
                timeout=10,
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "mode" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(role=42), timeout=10)  # type: ignore[arg-type]
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "role" in info.value.details()
        listed = scheduler.ListWorkers(
            scheduler_pb2.ListWorkersRequest(role=common_pb2.WORKER_ROLE_DECODE), timeout=10
        )
        assert len(listed.workers) == 2
    wait_idle(cluster)


def test_tiny_deadline_is_deadline_exceeded_and_leaves_nothing_behind(cluster: Cluster) -> None:
    with Client(cluster.router_address, retry=RetryPolicy(max_attempts=1)) as client:
        with pytest.raises(DeadlineExceeded) as info:
            client.generate(
                "a request that cannot finish in a millisecond", max_tokens=64, timeout=0.001
            )
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(DeadlineExceeded):
            list(client.stream("the same, streamed", max_tokens=64, timeout=0.001))
        wait_idle(cluster)
        # The system keeps serving.
        done = client.generate("still serving", max_tokens=3, temperature=0, ignore_eos=True)
        assert done.finish_reason == "length" and len(done.token_ids) == 3
    wait_idle(cluster)


@pytest.mark.parametrize("received", [1, 4])
def test_cancelling_mid_stream_frees_blocks_and_store_entry(
    cluster: Cluster, received: int
) -> None:
    async def cancel_after(n: int) -> list[Delta]:
        deltas: list[Delta] = []
        async with (
            AsyncClient(cluster.router_address, timeout=60) as client,
            client.stream(
                "a long answer that we stop listening to",
                max_tokens=200,
                temperature=0,
                ignore_eos=True,
            ) as stream,
        ):
            async for delta in stream:
                deltas.append(delta)
                if len(deltas) == n:
                    break  # leaving the block cancels the call
        return deltas

    deltas = asyncio.run(cancel_after(received))
    assert len(deltas) == received and not deltas[-1].finished
    wait_idle(cluster)


def test_cli_generate_and_status(
    cluster: Cluster,
    workload: list[tuple[Case, GenerationResult]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    case, ref = next((c, r) for c, r in workload if isinstance(c.prompt, str) and not c.stop)
    argv = [case.prompt, "--router", cluster.router_address, "--temperature", "0",
            "--max-tokens", str(case.max_tokens)]  # fmt: skip
    assert main_generate(argv) == 0
    assert capsys.readouterr().out == ref.text + "\n"
    choice = [case.prompt, "--router", cluster.router_address, "--choice", "yes", "--choice", "no"]
    assert main_generate(choice) == 0
    assert capsys.readouterr().out in ("yes\n", "no\n")  # the guide held on a real cluster

    assert cluster.redis_url is not None
    assert main_status(["--redis-url", cluster.redis_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    roles = sorted(line.split()[1] for line in lines[1:])
    assert roles == ["decode", "decode", "prefill", "prefill"]
    for w in cluster.workers():
        assert any(w.address in line for line in lines)
    wait_idle(cluster)


# Last: it cuts requests wherever its deadlines fall; a leak it finds must not fail the tests above.
def test_deadlines_at_every_stage_leave_nothing_behind(cluster: Cluster) -> None:
    """Deadlines spread from 2 ms to 400 ms cut requests during Assign, prefill, the KV
    hand-off and decode; whichever it is, every resource must come back."""

    async def run() -> list[BaseException | None]:
        async def one(client: AsyncClient, i: int) -> BaseException | None:
            try:
                await client.generate(
                    " ".join(["word"] * 150), max_tokens=60, ignore_eos=True, timeout=0.002 * 1.6**i
                )
            except DeadlineExceeded as e:
                return e
            return None

        async with AsyncClient(cluster.router_address, retry=RetryPolicy(max_attempts=1)) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(12))))

    outcomes = asyncio.run(run())
    assert isinstance(outcomes[0], DeadlineExceeded)  # 2 ms is never enough
    wait_idle(cluster)
