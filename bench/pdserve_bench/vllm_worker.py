"""Runs inside vLLM's own interpreter (a separate virtualenv) as a script, driven by ``VllmPeer``.

It imports only the standard library and vLLM, never pdserve. Protocol: one JSON object per
line. The worker writes ``{"ok": true, "ready": ..., "vllm_version": ...}`` once the engine is
up, then answers each request line read from stdin:

* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": N}`` ->
  ``{"ok": true, "seconds": wall time of LLM.generate}``
* ``{"op": "exit"}`` -> the worker exits.

A failure answers ``{"ok": false, "error": "..."}``. Replies go to the original stdout; fd 1 is
pointed at stderr before vLLM is imported, so its logs (and its engine-core subprocess's) cannot
corrupt the protocol stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import IO, Any


def _protocol_stream() -> IO[str]:
    """Keep a private copy of stdout for replies and send everything else to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _reply(stream: IO[str], obj: dict[str, Any]) -> None:
    stream.write(json.dumps(obj) + "\n")
    stream.flush()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="vLLM benchmark worker")
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    return parser.parse_args(argv)


def _generate(
    llm: Any, sampling_params_cls: Any, prompts: list[list[int]], max_tokens: int
) -> float:
    params = sampling_params_cls(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True
    )
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    lengths = sorted({len(o.outputs[0].token_ids) for o in outputs})
    if len(outputs) != len(prompts) or lengths != [max_tokens]:
        raise RuntimeError(f"vLLM generated {lengths} tokens per prompt, asked for {max_tokens}")
    return seconds


def main(argv: list[str]) -> int:
    proto = _protocol_stream()
    args = _parse(argv)
    start = time.perf_counter()
    try:
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            enforce_eager=True,
            enable_prefix_caching=False,  # repeats reuse the same prompts
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            seed=0,
        )
    except Exception as e:  # reported to the parent, which raises it there
        _reply(proto, {"ok": False, "error": f"vLLM failed to start: {type(e).__name__}: {e}"})
        return 1
    _reply(
        proto,
        {
            "ok": True,
            "ready": True,
            "startup_s": time.perf_counter() - start,
            "vllm_version": vllm.__version__,
        },
    )
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "exit":
            break
        try:
            seconds = _generate(llm, SamplingParams, req["prompts"], int(req["max_tokens"]))
        except Exception as e:  # reported to the parent, which raises it there
            _reply(proto, {"ok": False, "error": f"{type(e).__name__}: {e}"})
            continue
        _reply(proto, {"ok": True, "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
