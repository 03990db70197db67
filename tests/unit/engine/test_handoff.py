"""KV hand-off: export on engine A, import on engine B, decode on B == A alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.kv_tensors import as_tensor
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import KVPayloadMismatchError
from tests.unit.engine.test_parity import prompts_of, run_collect

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prefill_and_export(
    engine: Engine, rid: str, prompt: list[int], hook: object = None
) -> tuple[tuple[int, float], KVPayload]:
    # The prefill side samples only the first token, then holds the prompt's KV for export.
    first_only = dataclasses.replace(PARAMS, max_tokens=1)
    engine.add_request(rid, prompt, first_only, hold_kv=True, layer_hook=hook)  # type: ignore[arg-type]
    first: tuple[int, float] | None = None
    while engine.has_unfinished():
        for o in engine.step():
            first = (o.new_token_ids[0], o.new_logprobs[0])
    assert first is not None
    payload = engine.export_kv(rid)
    engine.release_kv(rid)
    engine.check_no_leaks()
    return first, payload


@pytest.mark.parametrize("block_sizes", [(16, 16), (8, 32)])
def test_export_import_continues_exactly(
    tiny_llama_dir: Path, block_sizes: tuple[int, int]
) -> None:
    a = Engine.from_pretrained(tiny_llama_dir, dtype="float32", block_size=block_sizes[0])
    b = Engine.from_pretrained(tiny_llama_dir, dtype="float32", block_size=block_sizes[1])
    prompts = prompts_of(a, [3, 16, 45])
    alone = run_collect(a, prompts, PARAMS)
    for i, p in enumerate(prompts):
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def hook(
            layer: int,
            k: torch.Tensor,
            v: torch.Tensor,
            seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = layers,
        ) -> None:
            seen[layer] = (k.clone(), v.clone())

        first, payload = prefill_and_export(a, f"x{i}", p, hook)
        # The layer hook saw exactly what the export holds, every layer once.
        assert sorted(layers) == list(range(a.model_config.num_layers))
        for layer, (k, v) in layers.items():
            # the export is numpy in the wire dtype (``kv_arrays``): viewed back to compare
            keys, values = payload.keys[layer], payload.values[layer]
            assert torch.equal(k, as_tensor(keys, k.dtype))
            assert torch.equal(v, as_tensor(values, v.dtype))
        wire = KVPayload.from_bytes(payload.to_bytes())
        b.add_request(f"y{i}", p, PARAMS, kv=wire, first_token=first)
        tokens = [first[0]]
        while b.has_unfinished():
            for o in b.step():
                tokens += o.new_token_ids
        assert tokens == alone[f"r{i}"][0]
        assert len(tokens) == PARAMS.max_tokens
    b.check_no_leaks()


def test_mismatched_payload_refused(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    a = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    other_model = Engine.from_pretrained(tiny_qwen2_dir, dtype="float32")
    other_dtype = Engine.from_pretrained(tiny_llama_dir, dtype="bfloat16")
    prompt = prompts_of(a, [20])[0]
    first, payload = prefill_and_export(a, "x", prompt)
    for engine, field in ((other_model, "model_fingerprint"), (other_dtype, "dtype")):
        with pytest.raises(KVPayloadMismatchError, match=field):
            engine.add_request("y", prompt, PARAMS, kv=payload, first_token=first)
        engine.check_no_leaks()
    blob = bytearray(payload.to_bytes())
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(KVPayloadMismatchError, match="checksum"):
        KVPayload.from_bytes(bytes(blob))


def test_seeded_sampling_continues_across_handoff(tiny_llama_dir: Path) -> None:
    """Draw i depends on (seed, i) only, so a hand-off mid-request changes nothing."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=12, ignore_eos=True)
    a = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    b = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    prompt = prompts_of(a, [21], seed=4)[0]
    alone = a.generate(prompt, params)[0].token_ids
    a.add_request("p", prompt, dataclasses.replace(params, max_tokens=1), hold_kv=True)
    first = next(o for o in a.step())
    payload = a.export_kv("p")
    a.release_kv("p")
    b.add_request("d", prompt, params, kv=payload, first_token=(first.new_token_ids[0], 0.0))
    tokens = list(first.new_token_ids)
    while b.has_unfinished():
        for o in b.step():
            tokens += o.new_token_ids
    assert tokens == alone
    assert len(set(alone)) > 4


def test_handed_over_requests_waiting_for_a_slot_are_counted_apart(tiny_llama_dir: Path) -> None:
    # The planner's slot pressure counts decodes that wait for a batch slot, not prompts that
    # wait to be prefilled (those are queued tokens): the engine tells them apart.
    a = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    b = Engine.from_pretrained(tiny_llama_dir, dtype="float32", max_num_seqs=2)
    prompts = prompts_of(a, [12, 13, 14, 15], seed=5)
    handed = [prefill_and_export(a, f"x{i}", p) for i, p in enumerate(prompts[:3])]
    for i, (first, payload) in enumerate(handed):
        b.add_request(f"d{i}", prompts[i], PARAMS, kv=payload, first_token=first)
    b.add_request("fresh", prompts[3], PARAMS)
    b.step()  # two of the three imports take the two slots
    stats = b.stats()
    assert (stats.num_running, stats.num_waiting_imports) == (2, 1)
    assert stats.num_waiting == 2  # the third import and the fresh prompt
    while b.has_unfinished():
        b.step()
    assert b.stats().num_waiting_imports == 0
    b.check_no_leaks()
