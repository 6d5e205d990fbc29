"""Rotary position embeddings, with the `linear`, Llama 3 (`llama3`) and Phi-3 (`longrope`) scalings.

Frequencies are computed in float32 exactly as transformers does, so angles agree bit for bit.
"""

from __future__ import annotations

import math

import torch

from loraplex.services.inference.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "longrope":
        # Short factors only: config.check_context_length keeps the context within the original length.
        factors = torch.tensor(rope.short_factor, dtype=torch.float32)
        if factors.shape[0] != inv_freq.shape[0]:
            raise ValueError(
                f"longrope short_factor has {factors.shape[0]} entries, needs {inv_freq.shape[0]}"
            )
        return 1.0 / (factors * rope.theta**exponents)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin for a batch of positions, computed once per forward and shared by all layers."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)
        self.attention_factor = rope.attention_factor  # longrope scales cos and sin (1.0 otherwise)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
