"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

Read top to bottom: rotary tables, RMSNorm, attention (paged), MLP, decoder layer, model.
Every forward works on a *flat* batch: the new tokens of all scheduled sequences concatenated,
``T`` tokens in all. The first ``D`` of them are decode tokens (one per decoding sequence);
the rest are prefill chunks. Linear layers see one ``[T, hidden]`` matrix (big matmuls, no
padding); only attention needs to know which token belongs to which sequence, and it reads
that from ``AttentionMetadata``.

Weights use the Hugging Face parameter names; q/k/v and gate/up are fused at load time so a
layer does 4 matmuls instead of 7 (fewer kernel launches per decode step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.errors import ModelLoadError
from pdserve.models.config import ModelConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (K, V), each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    start: int
    """Offset of the chunk's first token in the flat batch."""
    num_new: int
    """Tokens computed now."""
    context_len: int
    """Tokens attended to by the chunk's last token (cached prefix + earlier chunks + new)."""
    block_ids: torch.Tensor | None
    """``[num_blocks]`` block table; None when the chunk is the whole context (no gather)."""
    mask: torch.Tensor | None
    """``[num_new, context_len]`` bool, True = attend; None for a plain causal chunk."""


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """``[T]`` flat cache slot (block * block_size + offset) each new token's K/V goes to."""
    num_decodes: int
    """The first ``num_decodes`` tokens are decode tokens, one per sequence."""
    decode_block_tables: torch.Tensor | None
    """``[D, max_blocks]`` block tables of decoding sequences, padded with block 0."""
    decode_mask: torch.Tensor | None
    """``[D, 1, 1, max_blocks * block_size]`` bool: slot < context length."""
    prefills: list[PrefillSpan]


# --- rotary embeddings ---------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` inverse frequencies, with Llama 3 scaling when configured."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables ``[max_positions, head_dim]`` (float32; halves duplicated as in HF)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(cfg))  # [P, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, hd]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, hd]``; cos/sin ``[T, 1, hd]`` in x's dtype. Rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the model dtype: the reference implementation's order.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# --- attention -----------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, (self.nh + 2 * self.kvh) * self.hd, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = self.hd**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, hd]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, kvh, hd]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (nh + 2 kvh) * hd]
        q, k, v = qkv.split([self.nh * self.hd, self.kvh * self.hd, self.kvh * self.hd], dim=-1)
        q = apply_rope(q.view(T, self.nh, self.hd), cos, sin)
        k = apply_rope(k.view(T, self.kvh, self.hd), cos, sin)
        v = v.view(T, self.kvh, self.hd)
        # Write every new token's K/V into its paged slot before attending: chunks of the same
        # step that share cached blocks then see each other's keys.
        k_cache.view(-1, self.kvh, self.hd).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.kvh, self.hd).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(T, self.nh, self.hd, dtype=x.dtype, device=x.device)
        D = meta.num_decodes
        if D:
            out[:D] = self._decode(q[:D], k_cache, v_cache, meta)
        for span in meta.prefills:
            s, e = span.start, span.start + span.num_new
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, span)
        return self.o_proj(out.view(T, self.nh * self.hd))

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        D = meta.decode_block_tables.shape[0]
        # Gather each sequence's blocks: [D, max_blocks, bs, kvh, hd] -> [D, kvh, S, hd].
        keys = k_cache[meta.decode_block_tables].view(D, -1, self.kvh, self.hd).transpose(1, 2)
        vals = v_cache[meta.decode_block_tables].view(D, -1, self.kvh, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [D, nh, 1, hd]
            keys,
            vals,
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)  # [D, nh, hd]

    def _prefill(
        self,
        q: torch.Tensor,  # [n, nh, hd]
        k: torch.Tensor,  # [n, kvh, hd]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        span: PrefillSpan,
    ) -> torch.Tensor:
        if span.block_ids is not None:  # earlier context lives in the cache: read it back
            k = k_cache[span.block_ids].view(-1, self.kvh, self.hd)[: span.context_len]
            v = v_cache[span.block_ids].view(-1, self.kvh, self.hd)[: span.context_len]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, nh, n, hd]
            k.transpose(0, 1).unsqueeze(0),  # [1, kvh, ctx, hd]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)  # [n, nh, hd]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)  # [T, inter] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv[0], kv[1], meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    cos: torch.Tensor  # [max_positions, head_dim] float32
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] rows of the flat batch to produce logits for
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, hd]
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], meta)
            if after_layer is not None:
                after_layer(i)
        # The final norm is per token, so normalise only the rows we need logits for.
        h = self.norm(x[logits_indices])  # [S, hidden]
        return self.lm_head(h).float()  # [S, vocab]

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up."""
        cfg = self.cfg

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(f"checkpoint has no tensor {name!r}")
            return weights[name]

        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if cfg.tie_word_embeddings:
            # Re-tie: moving the module between devices may have given lm_head its own storage.
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(
                torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            )
            if cfg.attention_bias:
                assert attn.qkv_proj.bias is not None
                attn.qkv_proj.bias.copy_(
                    torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                )
            attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            if cfg.o_proj_bias:
                assert attn.o_proj.bias is not None
                attn.o_proj.bias.copy_(take(p + "self_attn.o_proj.bias"))
            layer.mlp.gate_up_proj.weight.copy_(
                torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
            )
            layer.mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
