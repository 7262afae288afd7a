"""Rope tables for the compressor: plain and DeepSeek YaRN (SPEC section 1).

The compressor rotates each entry at its group's start position with interleaved (GPT-J style) pairs.
Tables are computed in float64 and stored as float32 ``[max_positions, rope_dim / 2]``; DeepSeek applies
no attention-scale factor to the compressor's cos/sin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["YarnScaling", "yarn_inv_freq", "rope_inv_freq", "rope_tables"]


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek-V4 YaRN settings (config.json ``rope_scaling``)."""

    factor: float = 16.0
    original_max_positions: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def rope_inv_freq(rope_dim: int, base: float) -> torch.Tensor:
    """``inv[i] = base^(-2i/d)`` for ``i < d/2``, float64."""
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    return base ** (-2.0 * i / rope_dim)


def _correction_dim(num_rotations: float, rope_dim: int, base: float, original_max_positions: int) -> float:
    # The dimension whose wavelength fits ``num_rotations`` times into the original context.
    return rope_dim * math.log(original_max_positions / (2 * math.pi * num_rotations)) / (2 * math.log(base))


def yarn_inv_freq(rope_dim: int, base: float, yarn: YarnScaling) -> torch.Tensor:
    """DeepSeek's YaRN frequencies: high-frequency dims keep ``inv``, low-frequency dims get ``inv / factor``,
    with a linear ramp between the correction dims of ``beta_fast`` and ``beta_slow`` rotations."""
    inv = rope_inv_freq(rope_dim, base)
    low = math.floor(_correction_dim(yarn.beta_fast, rope_dim, base, yarn.original_max_positions))
    high = math.ceil(_correction_dim(yarn.beta_slow, rope_dim, base, yarn.original_max_positions))
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
    return inv / yarn.factor * ramp + inv * (1.0 - ramp)


def rope_tables(
    rope_dim: int,
    max_positions: int,
    *,
    base: float = 160000.0,
    yarn: YarnScaling | None = YarnScaling(),
    device="cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each float32 ``[max_positions, rope_dim // 2]``: ``cos[p, i] = cos(p * inv'[i])``.

    ``yarn=None`` gives plain rope frequencies. Angles are formed in float64 so that large positions
    (up to 1,048,576) keep full float32 accuracy in the table.
    """
    if rope_dim % 2 or rope_dim < 0:
        raise ValueError(f"rope_dim must be even and >= 0, got {rope_dim}")
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    inv = rope_inv_freq(rope_dim, base) if yarn is None else yarn_inv_freq(rope_dim, base, yarn)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)
