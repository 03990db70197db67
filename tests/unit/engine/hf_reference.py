"""Independent reference: HF transformers' forward pass on the same checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch


class HFReference:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """``[len, vocab]`` next-token logits at every position (no cache: nothing shared)."""
        out = self.model(torch.tensor([token_ids]))
        return out.logits[0].float()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt) :]
