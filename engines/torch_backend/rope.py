"""Rotary position embeddings: the inverse frequencies of each supported rope type, and the
cos/sin table the model gathers by position. Computed in float32 as transformers does, then
cast to the model's dtype."""

from __future__ import annotations

import math

import torch

from engines.torch_backend.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_table(
    rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[max_positions, 2, head_dim]``: cos and sign-folded sin, so that rotating ``x`` is
    ``x * cos + swap_halves(x) * sin``."""
    inv_freq = inverse_frequencies(rope, head_dim).to(device)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    sin = freqs.sin()
    signed_sin = torch.cat((-sin, sin), dim=-1)
    return torch.stack((cos, signed_sin), dim=1).to(dtype)
