"""HF transformers' ``generate`` as a benchmark peer (the same checkpoint directory)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pdserve_bench.measure import PeerError


class HFPeer:
    """``AutoModelForCausalLM.generate``: greedy, left-padded batches, no early stop."""

    name = "hf"

    def __init__(self, model_dir: str | Path, *, dtype: str, threads: int) -> None:
        from transformers import AutoModelForCausalLM  # heavy import: only when HF is measured

        torch.set_num_threads(threads)
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).eval()
        pad = self.model.generation_config.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)

    def _batch(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pad to one ``[B, L]`` tensor: generated tokens then line up at the right."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        return ids, mask

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        ids, mask = self._batch(prompts)
        start = time.perf_counter()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,  # suppresses EOS, so every row runs all max_tokens steps
            do_sample=False,
            pad_token_id=self.pad_id,
        )
        seconds = time.perf_counter() - start
        if out.shape[1] - ids.shape[1] != max_tokens:
            raise PeerError(
                f"HF generated {out.shape[1] - ids.shape[1]} tokens, asked for {max_tokens}"
            )
        return seconds

    def close(self) -> None:
        del self.model
