"""The workers on the EngineBackend seam: ``--backend`` and the flags each backend refuses,
the native KV handle through the protocol, and prefill/decode workers that ask a backend for
what it cannot do failing by field, while what it can do hands over and decodes in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.backends import TENSORRT_LLM, TORCH, NativeKV
from pdserve.convert.kv import handle_from_proto, handle_to_proto
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.handoff import DecodeConnector, HandoffRoute, PrefillConnector
from pdserve.kvstore.client import KVStoreClient
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.transfer.base import KVLocation, TransportKind
from pdserve.v1 import common_pb2
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.options import WorkerOptions, options_from_args, worker_parser
from pdserve.worker.prefill import PrefillWorker
from pdserve.worker.runtime import trtllm_config
from tests.unit.backends.conftest import open_backend, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def parse(*flags: str) -> WorkerOptions:
    parser = worker_parser("w", None, roles=[WorkerRole.DECODE], default_max_wait_ms=0.0, env={})
    return options_from_args(parser.parse_args(["--model", "/m", *flags]))


def test_backend_flag_defaults_to_torch_and_reads_the_environment() -> None:
    assert parse().backend == TORCH
    assert parse("--backend", "tensorrt-llm").backend == TENSORRT_LLM
    parser = worker_parser(
        "w", None, roles=[WorkerRole.DECODE], default_max_wait_ms=0.0,
        env={"PDSERVE_BACKEND": "tensorrt-llm"},
    )  # fmt: skip
    assert options_from_args(parser.parse_args(["--model", "/m"])).backend == TENSORRT_LLM
    with pytest.raises(SystemExit):
        parse("--backend", "onnx")


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (("--transport", "native"), "--transport"),
        (("--backend", "tensorrt-llm", "--transport", "shm"), "--transport"),
        (("--backend", "tensorrt-llm", "--host-lease", "/tmp/lease"), "--host-lease"),
        (("--backend", "tensorrt-llm", "--prefix-reuse"), "--prefix-reuse"),
        (("--backend", "tensorrt-llm", "--trtllm-kv-fraction", "1.5"), "--trtllm-kv-fraction"),
        (("--backend", "sim"), "--sim-profile"),
        (("--sim-profile", "roofline:h100:llama-3-8b"), "--sim-profile"),
        (("--backend", "sim", "--sim-profile", "roofline:tpu:llama-3-8b"), "--sim-profile"),
        (("--backend", "sim", "--sim-profile", "roofline:h100:gpt-5"), "--sim-profile"),
        (("--backend", "sim", "--sim-profile", "roofline:h100:llama-3-70b"), "--sim-profile"),
        (("--backend", "sim", "--sim-profile", "fitted:/nonexistent.json"), "--sim-profile"),
        (("--backend", "sim", "--sim-profile", "guess"), "--sim-profile"),
        (
            (
                "--backend",
                "sim",
                "--sim-profile",
                "roofline:h100:qwen2-7b",
                "--sim-time-scale",
                "0",
            ),
            "--sim-time-scale",
        ),
        (
            (
                "--backend",
                "sim",
                "--sim-profile",
                "roofline:a100:qwen2-7b",
                "--sim-time-scale",
                "-2",
            ),
            "--sim-time-scale",
        ),
        (
            ("--backend", "sim", "--sim-profile", "roofline:h100:qwen2-7b", "--sim-link", "pigeon"),
            "--sim-link",
        ),
        (
            (
                "--backend",
                "sim",
                "--sim-profile",
                "roofline:h100:qwen2-7b",
                "--transport",
                "native",
            ),
            "--transport",
        ),
    ],
)
def test_flags_a_backend_cannot_honour_are_refused(flags: tuple[str, ...], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse(*flags)
    assert err.value.field == field


def test_sim_flags_are_kept(tmp_path: Path) -> None:
    opts = parse(
        "--backend", "sim", "--sim-profile", "roofline:a100:llama-3-8b:tp2",
        "--sim-time-scale", "4", "--sim-link", "tcp-25",
    )  # fmt: skip
    assert (opts.backend, opts.sim_profile) == ("sim", "roofline:a100:llama-3-8b:tp2")
    assert (opts.sim_time_scale, opts.sim_link) == (4.0, "tcp-25")


def test_a_config_json_without_a_needed_field_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 100}')
    with pytest.raises(InvalidArgumentError) as err:
        parse("--backend", "sim", "--sim-profile", f"roofline:h100:{config}")
    assert err.value.field == "--sim-profile" and "num_attention_heads" in str(err.value)


def test_tensorrt_llm_settings_from_the_shared_flags(tiny_llama_dir: Path) -> None:
    opts = parse(
        "--backend", "tensorrt-llm", "--max-num-seqs", "16", "--block-size", "64",
        "--kv-blocks", "100", "--trtllm-transceiver", "NIXL", "--trtllm-kv-fraction", "0.3",
        "--transport", "native",
    )  # fmt: skip
    cfg = trtllm_config(opts)
    assert (cfg.max_num_seqs, cfg.block_size, cfg.kv_max_tokens) == (16, 64, 6400)
    assert (cfg.transceiver, cfg.free_gpu_memory_fraction) == ("NIXL", 0.3)
    # A budget in bytes becomes one in tokens: K and V of 4 layers x 2 heads x 32 in float32.
    by_bytes = parse("--model", str(tiny_llama_dir), "--backend", "tensorrt-llm",
                     "--dtype", "float32", "--kv-cache-bytes", str(2048 * 1024))  # fmt: skip
    assert trtllm_config(by_bytes).kv_max_tokens == 2048 * 1024 // (2 * 4 * 2 * 32 * 4)


def test_native_handle_round_trips_through_the_protocol() -> None:
    native = NativeKV(TENSORRT_LLM, 77, (5,), b"\x00state", (9, 8))
    kv = KVLocation.of_native("r1", 40, "tensorrt-llm/abc-bfloat16", native)
    handle = handle_to_proto(kv)
    assert handle.WhichOneof("location") == "native"
    back = handle_from_proto(common_pb2.KVHandle.FromString(handle.SerializeToString()))
    assert back == kv and back.kind is TransportKind.NATIVE
    broken_handles = {
        "kv.native.backend": common_pb2.NativeLocation(first_gen_tokens=[5]),
        "kv.native.first_gen_tokens": common_pb2.NativeLocation(backend="x"),
    }
    for field, broken in broken_handles.items():
        bad = common_pb2.KVHandle(request_id="r", native=broken)
        with pytest.raises(InvalidArgumentError) as err:
            handle_from_proto(bad)
        assert err.value.field == field


def test_workers_hand_over_natively_and_refuse_transports(
    fake_tensorrt_llm: Path, tiny_llama_dir: Path
) -> None:
    """A prefill and a decode worker on the tensorrt-llm backend (two engines): the hand-off is
    native, the tokens those of a whole request; pdserve's transports are refused by field."""
    prompt = (7, 300, 41, 1000, 5, 5, 12, 99, 1500)

    async def body() -> None:
        async with (
            open_backend(TENSORRT_LLM, tiny_llama_dir) as p_engine,
            open_backend(TENSORRT_LLM, tiny_llama_dir) as d_engine,
        ):
            store = KVStoreClient("127.0.0.1:1", timeout_s=1)  # never dialled: nothing is stored
            prefill = PrefillWorker(p_engine, PrefillConnector(p_engine, store, host="h"))
            decode = DecodeWorker(d_engine, DecodeConnector(d_engine, host="h"))
            try:
                whole = [t async for o in d_engine.generate(EngineRequest("w", prompt, GREEDY))
                         for t in o.new_token_ids]  # fmt: skip
                result = await prefill.prefill(EngineRequest("r", prompt, GREEDY))
                assert result.kv is not None and result.kv.kind is TransportKind.NATIVE
                assert result.transfer is not None and result.transfer.transport == "native"
                first = (result.first_token_id, result.first_logprob)
                deltas = [
                    d
                    async for d in decode.decode(
                        EngineRequest("r", prompt, GREEDY), first, result.kv
                    )
                ]
                assert [first[0], *(t for d in deltas for t in d.token_ids)] == whole
                assert deltas[-1].timing is not None and deltas[-1].timing.transport == "native"
                for transport in ("store", "direct", "shm"):
                    with pytest.raises(InvalidArgumentError) as err:
                        await prefill.prefill(
                            EngineRequest("x", prompt, GREEDY), HandoffRoute(transport=transport)
                        )
                    assert err.value.field == "transport"
                stored = KVLocation(TransportKind.STORE, "s", len(prompt), 10, decode.fingerprint,
                                    address="127.0.0.1:1", key="kv/s")  # fmt: skip
                with pytest.raises(InvalidArgumentError) as err:
                    async for _ in decode.decode(EngineRequest("s", prompt, GREEDY), first, stored):
                        pass
                assert err.value.field == "kv.location"
            finally:
                await prefill.close()
                await decode.close()
                await store.close()

    run(body)


def test_a_torch_prefill_worker_refuses_native(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            store = KVStoreClient("127.0.0.1:1", timeout_s=1)
            prefill = PrefillWorker(engine, PrefillConnector(engine, store, host="h"))
            try:
                with pytest.raises(InvalidArgumentError) as err:
                    await prefill.prefill(
                        EngineRequest("x", (5, 6, 7), GREEDY), HandoffRoute(transport="native")
                    )
                assert err.value.field == "transport"
            finally:
                await prefill.close()
                await store.close()

    run(body)
