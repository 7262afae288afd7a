"""Reference semantics of the DeepSeek-V4 compressor (SPEC section 3), in plain PyTorch.

Read this file top to bottom against the SPEC: it is what every kernel is checked against.

Entry ``g`` pools the group of positions ``s = g*r .. s+r-1`` (plus, with overlap, the previous group):

1. gate each window row: ``score_j + ape[p_j % r]``;
2. per channel, softmax over the window and take the weighted sum of ``kv`` -> ``c`` (float32 or float64);
3. RMSNorm: ``n = c * rsqrt(mean(c*c) + eps) * norm_weight``;
4. rope on the trailing ``R`` dims (interleaved pairs) at the group start ``s``;
5. encode (``layout.encode_latent`` or bf16 indexer keys).

With overlap, a token row carries two halves: ``[0, H)`` feeds the *next* group's entry, ``[H, 2H)`` its own.
"""

from __future__ import annotations

import torch

from .config import INDEXER, CompressorConfig, CompressorParams
from .layout import decode_latent, encode_indexer_fp8, encode_latent

__all__ = [
    "gated_rows",
    "window_halves",
    "pool_windows",
    "rms_norm",
    "apply_rope",
    "finish_entries",
    "finish_entries_sglang_triton",
    "compress_sequence",
    "encode_entries",
    "dequantized_entries",
    "indexer_fp8_pack",
    "params_as",
]


def gated_rows(kv_score: torch.Tensor, positions: torch.Tensor, ape: torch.Tensor, width: int) -> torch.Tensor:
    """Return ``[kv | score + ape[p % r]]`` for token rows at ``positions`` (the ring-state row format)."""
    r = ape.shape[0]
    out = kv_score.clone()
    out[:, width:] = out[:, width:] + ape.to(out.dtype)[positions.long() % r]
    return out


def window_halves(
    prev_rows: torch.Tensor | None, cur_rows: torch.Tensor, config: CompressorConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Assemble windows from gated rows.

    Args:
        prev_rows: ``[N, r, 2W]`` gated rows of the previous groups, or ``None`` (no overlap); rows of an
            absent previous group (``g == 0``) must be passed with ``-inf`` scores.
        cur_rows: ``[N, r, 2W]`` gated rows of the groups themselves.

    Returns:
        ``(kv, score)``, each ``[N, window, H]``: without overlap the rows as they are; with overlap the
        previous group's ``[0, H)`` halves followed by the current group's ``[H, 2H)`` halves.
    """
    h, w = config.head_dim, config.width
    if not config.overlap:
        return cur_rows[..., :w], cur_rows[..., w:]
    kv = torch.cat([prev_rows[..., :h], cur_rows[..., h:w]], dim=1)
    score = torch.cat([prev_rows[..., w : w + h], cur_rows[..., w + h :]], dim=1)
    return kv, score


def pool_windows(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Per-channel softmax over the window (dim 1) and the weighted sum: ``[N, window, H] -> [N, H]``."""
    weights = torch.softmax(score, dim=1)
    return (weights * kv).sum(dim=1)


def rms_norm(c: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``c * rsqrt(mean(c^2) + eps) * weight`` over the last dim (math in ``c.dtype``)."""
    return c * torch.rsqrt((c * c).mean(dim=-1, keepdim=True) + eps) * weight.to(c.dtype)


def apply_rope(
    n: torch.Tensor, group_starts: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """Rotate the trailing ``rope_dim`` dims as interleaved pairs ``(x, y) = (n[2k], n[2k+1])`` by the angle
    of position ``group_starts[i]``: ``x' = x cos - y sin``, ``y' = y cos + x sin``."""
    if rope_dim == 0:
        return n
    out = n.clone()
    pairs = n[:, n.shape[1] - rope_dim :].reshape(n.shape[0], rope_dim // 2, 2)
    x, y = pairs[..., 0], pairs[..., 1]
    c = cos[group_starts.long()].to(n.dtype)
    s = sin[group_starts.long()].to(n.dtype)
    rotated = torch.stack([x * c - y * s, y * c + x * s], dim=-1)
    out[:, n.shape[1] - rope_dim :] = rotated.reshape(n.shape[0], rope_dim)
    return out


def finish_entries(
    c: torch.Tensor, group_starts: torch.Tensor, params: CompressorParams, config: CompressorConfig
) -> torch.Tensor:
    """RMSNorm then rope: pooled ``c [N, H]`` -> the entry values ``[N, H]`` before encoding."""
    n = rms_norm(c, params.norm_weight, params.eps)
    return apply_rope(n, group_starts, params.cos, params.sin, config.rope_dim)


def finish_entries_sglang_triton(
    c: torch.Tensor, group_starts: torch.Tensor, params: CompressorParams, config: CompressorConfig
) -> torch.Tensor:
    """:func:`finish_entries` as SGLang's Triton ``fused_norm_rope_inplace_triton`` computes it for its trtllm
    backend's uniform FP8 records, in float32: ``inv = 1 / sqrt(sum(c * c) / H + eps)`` (each step rounded),
    ``n = c * inv * w``, rope pairs ``(x * cos - y * sin, x * sin + y * cos)``.

    Within rounding of SGLang's bytes, not bit for bit: on the GPU ``tl.rsqrt`` is ``rsqrt.approx.f32`` (a few
    ulp from ``1 / sqrt``, not reproducible here) and the sum of squares is added in the order of Triton's
    register layout (here torch's); under the Triton interpreter ``tl.rsqrt`` is ``1 / sqrt`` and the sum
    numpy's. The kernels run SGLang's own Triton operations instead (``kernels.entry_pack``), so on identical
    pooled vectors their records are SGLang's (tests/test_engine_sglang_uniform_fp8.py)."""
    c = c.float()
    inv = 1.0 / torch.sqrt((c * c).sum(dim=-1, keepdim=True) / c.shape[-1] + params.eps)
    n = c * inv * params.norm_weight.float()
    rope = config.rope_dim
    if rope == 0:
        return n
    pairs = n[:, n.shape[1] - rope :].reshape(n.shape[0], rope // 2, 2)
    x, y = pairs[..., 0], pairs[..., 1]
    cos = params.cos[group_starts.long()].float()
    sin = params.sin[group_starts.long()].float()
    out = n.clone()
    out[:, n.shape[1] - rope :] = torch.stack([x * cos - y * sin, x * sin + y * cos], dim=-1).reshape(-1, rope)
    return out


def compress_sequence(
    kv_score: torch.Tensor,
    params: CompressorParams,
    config: CompressorConfig,
    *,
    dtype: torch.dtype = torch.float32,
    return_pooled: bool = False,
):
    """One-shot computation of every complete entry of one sequence.

    Args:
        kv_score: ``[L, 2W]`` rows of positions ``0..L-1``.
        dtype: math precision (``torch.float32`` as the kernels, or ``torch.float64``).

    Returns:
        The entry values ``[L // r, H]`` (normalized and rotated, before encoding); with
        ``return_pooled=True`` the tuple ``(values, pooled)``.
    """
    r, w = config.ratio, config.width
    groups = kv_score.shape[0] // r
    rows = kv_score[: groups * r].to(dtype)
    positions = torch.arange(groups * r, device=kv_score.device)
    rows = gated_rows(rows, positions, params.ape, w).view(groups, r, 2 * w)
    prev = None
    if config.overlap:
        # Group g's previous group is g - 1; group 0 has none (weight 0 through -inf gate logits).
        absent = torch.zeros(1, r, 2 * w, dtype=dtype, device=rows.device)
        absent[..., w:] = float("-inf")
        prev = torch.cat([absent, rows[:-1]], dim=0)[:groups]  # no groups at all when L < r
    kv, score = window_halves(prev, rows, config)
    pooled = pool_windows(kv, score)
    starts = torch.arange(groups, device=kv_score.device) * r
    values = finish_entries(pooled, starts, params_as(params, dtype), config)
    return (values, pooled) if return_pooled else values


def params_as(params: CompressorParams, dtype: torch.dtype) -> CompressorParams:
    """The same parameters with every tensor in ``dtype`` (for float64 reference math)."""
    return CompressorParams(
        params.ape.to(dtype),
        params.norm_weight.to(dtype),
        params.cos.to(dtype),
        params.sin.to(dtype),
        params.eps,
    )


def encode_entries(values: torch.Tensor, config: CompressorConfig) -> torch.Tensor:
    """Stored bytes of entries: the 584-byte latent record, or the indexer's bf16 key bytes (``2H``)."""
    if config.output == INDEXER:
        return values.float().to(torch.bfloat16).contiguous().view(torch.uint8)
    return encode_latent(values.float(), config)


def dequantized_entries(values: torch.Tensor, config: CompressorConfig) -> torch.Tensor:
    """What a reader of the stored entries sees, as float32: decoded latents, or the bf16 keys."""
    if config.output == INDEXER:
        return values.float().to(torch.bfloat16).float()
    return decode_latent(encode_latent(values.float(), config), config)


def indexer_fp8_pack(values: torch.Tensor) -> torch.Tensor:
    """The optional 132-byte FP8 pack of indexer entry values (bf16 key -> Hadamard -> e4m3fn + scale)."""
    return encode_indexer_fp8(values.float().to(torch.bfloat16))
