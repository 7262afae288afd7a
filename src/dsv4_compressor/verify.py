"""Checking stored entries against float64 reference values, byte by byte.

A kernel computes in float32 with its own summation order, so its pre-quantization values differ from the
float64 reference by a few ulps; where a value lies that close to a rounding boundary (bf16, FP8 or a
power-of-two scale), the stored byte may legitimately be either neighbour. These checks therefore accept a
byte exactly when it is the encoding of *some* value within ``tol`` of the float64 reference
(``tol = rel_tol * |v| + abs_tol * rms(v)`` per entry, defaults 1e-5 and 1e-6), and report separately how
many bytes equal the encoding of the reference itself. Anything else (a wrong window, a missing rope, a
stale row, an unwritten byte) lands far outside the tolerance and is reported as unexplained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import FP8_BLOCK, FP8_E4M3_MAX, CompressorConfig
from .layout import (
    AMAX_FLOOR,
    V41_TILE,
    ceil_log2,
    decode_latent,
    encode_indexer_fp8,
    encode_latent,
    hadamard,
    latent_record_bytes,
    ue8m0_exponent,
    v41_exponent,
)

__all__ = [
    "Report",
    "check_latent_records",
    "check_indexer_keys",
    "check_indexer_fp8",
    "check_indexer_pack",
    "DEFAULT_REL_TOL",
]

DEFAULT_REL_TOL = 1e-5
#: Absolute slack, as a fraction of the entry's RMS: float32 pooling errors scale with the inputs, not with
#: each pooled value, so values near zero need a floor (1e-6 is still below the smallest FP8 step in a block).
ABS_TOL_RMS = 1e-6


@dataclass
class Report:
    """Outcome of a byte check. ``ok`` when every byte is explained."""

    what: str
    total_bytes: int = 0
    exact_bytes: int = 0
    unexplained: int = 0
    max_abs_err: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.unexplained == 0

    @property
    def exact_fraction(self) -> float:
        return self.exact_bytes / max(1, self.total_bytes)

    def merge(self, other: Report) -> Report:
        self.total_bytes += other.total_bytes
        self.exact_bytes += other.exact_bytes
        self.unexplained += other.unexplained
        self.max_abs_err = max(self.max_abs_err, other.max_abs_err)
        self.failures += other.failures[: max(0, 5 - len(self.failures))]
        return self

    def __str__(self) -> str:
        status = "ok" if self.ok else f"FAILED ({self.unexplained} unexplained bytes)"
        return (
            f"{self.what}: {status}; {self.exact_bytes}/{self.total_bytes} bytes equal the encoding of the "
            f"reference ({100 * self.exact_fraction:.3f}%), max |dequantized - reference| = {self.max_abs_err:.3g}"
            + "".join(f"\n  {f}" for f in self.failures)
        )


def _bounds(values: torch.Tensor, rel_tol: float, abs_tol: float = ABS_TOL_RMS) -> tuple[torch.Tensor, torch.Tensor]:
    v = values.double()
    rms = v.pow(2).mean(dim=-1, keepdim=True).sqrt()
    tol = rel_tol * v.abs() + abs_tol * rms
    return v - tol, v + tol


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16).double()


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).double()


def _min_abs(lo: torch.Tensor, hi: torch.Tensor, rnd) -> torch.Tensor:
    """Smallest |rnd(x)| over x in [lo, hi] (rnd monotone)."""
    a, b = rnd(lo).abs(), rnd(hi).abs()
    return torch.where((lo <= 0) & (hi >= 0), torch.zeros_like(a), torch.minimum(a, b))


def _outside(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Not within [lo, hi]; NaN (e.g. the e4m3fn byte 0x7F) is always outside."""
    return ~((x >= lo) & (x <= hi))


def _locate(mask: torch.Tensor, label: str, out: list[str]) -> None:
    idx = mask.nonzero()
    if len(idx) and len(out) < 5:
        out.append(f"{label}: {len(idx)} bad, first at {idx[0].tolist()}")


def check_latent_records(
    actual: torch.Tensor,
    values: torch.Tensor,
    config: CompressorConfig,
    rel_tol: float = DEFAULT_REL_TOL,
    layout: str = "v4",
    abs_tol: float = ABS_TOL_RMS,
) -> Report:
    """Check latent records (uint8 ``[N, record bytes]``) of ``layout`` (``layout.LATENT_LAYOUTS``; the 584-byte
    V4 record by default) against float64 entry values ``[N, H]``; ``rel_tol`` / ``abs_tol``: the module's
    tolerance (``abs_tol`` in units of the entry's RMS; widen it where the inputs themselves carry a known error,
    e.g. a float32 projection checked against the float64 product)."""
    if layout != "v4":
        return _check_other_latent(actual, values, config, rel_tol, layout, abs_tol)
    actual = actual.cpu()
    values = values.cpu().double()
    rep = Report(f"{config.name} latent records", total_bytes=actual.numel())
    if actual.shape != (values.shape[0], config.entry_bytes):
        rep.unexplained = actual.numel() or 1
        rep.failures.append(f"shape {list(actual.shape)} != {[values.shape[0], config.entry_bytes]}")
        return rep
    n, nb, nope = values.shape[0], config.fp8_blocks, config.nope_dim
    data = config.record_data_bytes
    rep.exact_bytes = int((actual == encode_latent(values.float(), config)).sum())
    rep.max_abs_err = float((decode_latent(actual, config).double() - values).abs().max()) if n else 0.0
    lo, hi = _bounds(values, rel_tol, abs_tol)

    # scale bytes: the exponent of some amax reachable within tolerance
    e_act = actual[:, data : data + nb].to(torch.int32) - 127
    blo, bhi = lo[:, :nope].view(n, nb, FP8_BLOCK), hi[:, :nope].view(n, nb, FP8_BLOCK)
    amax_lo = _min_abs(blo, bhi, _bf16).amax(-1)
    amax_hi = torch.maximum(_bf16(blo).abs(), _bf16(bhi).abs()).amax(-1)
    bad_scale = (e_act < ue8m0_exponent(amax_lo)) | (e_act > ue8m0_exponent(amax_hi))
    bad_pad = actual[:, data + nb :] != 0

    # FP8 values, given the record's own scales
    q = actual[:, :nope].contiguous().view(torch.float8_e4m3fn).double().view(n, nb, FP8_BLOCK)
    step = torch.pow(2.0, -e_act.double())[..., None]
    q_lo, q_hi = _e4m3(_bf16(blo) * step), _e4m3(_bf16(bhi) * step)
    bad_q = _outside(q, q_lo, q_hi).view(n, nope)

    # rope dims as bf16
    rope = actual[:, nope:data].contiguous().view(torch.bfloat16).double()
    bad_rope = _outside(rope, _bf16(lo[:, nope:]), _bf16(hi[:, nope:]))

    rep.unexplained = int(bad_scale.sum() + bad_pad.sum() + bad_q.sum() + 2 * bad_rope.sum())
    for mask, label in ((bad_scale, "scale byte"), (bad_pad, "pad byte"), (bad_q, "fp8 value"), (bad_rope, "rope")):
        _locate(mask, label, rep.failures)
    return rep


def _check_other_latent(actual, values, config, rel_tol, layout, abs_tol=ABS_TOL_RMS) -> Report:
    """The V4.1 records (every dim as e4m3 under one UE8M0 exponent per 32 values, no bf16 rounding) and the
    uniform FP8 values (e4m3 of each value, no scale): each scale byte the exponent of some block amax within
    tolerance, each FP8 value the rounding of some value within tolerance under the record's own scale."""
    actual = actual.cpu()
    values = values.cpu().double()
    n, head = values.shape
    data, scale = latent_record_bytes(head, config.rope_dim, layout)
    rep = Report(f"{config.name} latent records ({layout})", total_bytes=actual.numel())
    if actual.shape != (n, data + scale):
        rep.unexplained = actual.numel() or 1
        rep.failures.append(f"shape {list(actual.shape)} != {[n, data + scale]}")
        return rep
    rep.exact_bytes = int((actual == encode_latent(values.float(), config, layout)).sum())
    rep.max_abs_err = float((decode_latent(actual, config, layout).double() - values).abs().max()) if n else 0.0
    lo, hi = _bounds(values, rel_tol, abs_tol)
    q = actual[:, :head].contiguous().view(torch.float8_e4m3fn).double()
    if layout == "uniform_fp8":
        bad_scale = torch.zeros(n, 0, dtype=torch.bool)
        bad_q = _outside(q, _e4m3(lo), _e4m3(hi))
    else:
        tiles = head // V41_TILE
        blo, bhi = lo.view(n, tiles, V41_TILE), hi.view(n, tiles, V41_TILE)
        e_act = actual[:, head : head + tiles].to(torch.int32) - 127
        amax_lo = _min_abs(blo, bhi, lambda x: x).amax(-1)
        amax_hi = torch.maximum(blo.abs(), bhi.abs()).amax(-1)
        bad_scale = (e_act < v41_exponent(amax_lo)) | (e_act > v41_exponent(amax_hi))
        step = torch.pow(2.0, -e_act.double())[..., None]
        bad_q = _outside(q.view(n, tiles, V41_TILE), _e4m3(blo * step), _e4m3(bhi * step)).view(n, head)
    rep.unexplained = int(bad_scale.sum() + bad_q.sum())
    _locate(bad_scale, "scale byte", rep.failures)
    _locate(bad_q, "fp8 value", rep.failures)
    return rep


def check_indexer_keys(actual: torch.Tensor, values: torch.Tensor, rel_tol: float = DEFAULT_REL_TOL) -> Report:
    """Check bf16 indexer keys ``[N, H]`` against float64 entry values."""
    actual = actual.cpu().double()
    values = values.cpu().double()
    rep = Report("indexer keys", total_bytes=2 * actual.numel())
    rep.exact_bytes = 2 * int((actual == _bf16(values)).sum())
    rep.max_abs_err = float((actual - values).abs().max()) if actual.numel() else 0.0
    lo, hi = _bounds(values, rel_tol)
    bad = _outside(actual, _bf16(lo), _bf16(hi))
    rep.unexplained = 2 * int(bad.sum())
    _locate(bad, "key value", rep.failures)
    return rep


def check_indexer_fp8(actual: torch.Tensor, keys: torch.Tensor, rel_tol: float = DEFAULT_REL_TOL) -> Report:
    """Check 132-byte FP8 packs ``[N, H + 4]`` (the ``hadamard`` variant) against the stored bf16 ``keys`` they
    were made from: :func:`check_indexer_pack` with the keys as the exact input, so the only slack is the float32
    summation error of the transform (any evaluation order)."""
    rep = check_indexer_pack(actual, keys.cpu().double(), "hadamard", keys=keys, rel_tol=rel_tol)
    rep.what = "indexer fp8 packs"
    return rep


def check_indexer_pack(
    actual: torch.Tensor,
    values: torch.Tensor,
    variant: str = "hadamard",
    keys: torch.Tensor | None = None,
    rel_tol: float = DEFAULT_REL_TOL,
    abs_tol: float = ABS_TOL_RMS,
) -> Report:
    """Check FP8 packs ``[N, H + 4]`` of any variant (``layout.INDEXER_PACKS``) against the float64 entry values
    ``[N, H]``; ``keys``: the bf16 keys the kernel stored for the same entries, if it stored them (the variants
    that start from ``bf16(key)`` must then have used exactly those).

    The values a variant quantizes are bounded by interval arithmetic: the entry within ``tol``, its bf16
    rounding either way where the variant rounds, the Hadamard transform of an interval (centre transformed,
    the radius summed, plus the worst float32 summation error of 128 terms), bf16 rounding of the result for
    ``hadamard_bf16``; the scale and every FP8 value must then be reachable from those bounds."""
    actual = actual.cpu()
    values = values.cpu().double()
    n, h = values.shape
    rep = Report(f"indexer fp8 packs ({variant})", total_bytes=actual.numel())
    source = keys.cpu().float() if keys is not None and variant != "hadamard_f32" else values.float()
    rep.exact_bytes = int((actual == encode_indexer_fp8(source, variant)).sum())
    lo, hi = _bounds(values, rel_tol, abs_tol)
    if variant == "hadamard_f32":
        in_lo, in_hi = lo, hi
    elif keys is not None:
        in_lo = in_hi = keys.cpu().double()
    else:
        in_lo, in_hi = _bf16(lo), _bf16(hi)
    if variant in ("pow2", "pow2_ue8m0"):
        x_lo, x_hi = in_lo, in_hi
    else:
        centre = hadamard((in_lo + in_hi) / 2) / h**0.5
        slack = ((in_hi - in_lo) / 2 + h * 2.0**-24 * torch.maximum(in_lo.abs(), in_hi.abs())).sum(-1, keepdim=True)
        x_lo, x_hi = centre - slack / h**0.5, centre + slack / h**0.5
        if variant == "hadamard_bf16":
            x_lo, x_hi = _bf16(x_lo), _bf16(x_hi)
    # LightLLM's pack (hadamard_bf16) divides as Triton's ``/`` does on the GPU (div.full.f32: within 2 float32
    # ulps); the other variants divide correctly rounded (their slack: the double-to-float32 rounding)
    div = 2.5e-7 if variant == "hadamard_bf16" else 1e-7
    if variant == "pow2_ue8m0":  # four equal bytes e + 127: read as the power of two they encode
        byte = actual[:, h:].long()
        scale = torch.ldexp(torch.ones(n, 1, dtype=torch.float64), byte[:, :1] - 127)
        scale = torch.where((byte == byte[:, :1]).all(-1, keepdim=True), scale, torch.nan)
    else:
        scale = actual[:, h:].contiguous().view(torch.float32).double()  # [N, 1]
    amax_lo = _min_abs(x_lo, x_hi, lambda x: x).amax(-1, keepdim=True).clamp(min=AMAX_FLOOR)
    amax_hi = torch.maximum(x_lo.abs(), x_hi.abs()).amax(-1, keepdim=True).clamp(min=AMAX_FLOOR)
    if variant in ("pow2", "pow2_ue8m0"):
        inv = torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)
        e_lo, e_hi = ceil_log2(amax_lo.float() * inv), ceil_log2(amax_hi.float() * inv)
        e = ceil_log2(scale.float())
        bad_scale = (scale != torch.ldexp(torch.ones_like(scale), e.double())) | (e < e_lo) | (e > e_hi)
    else:
        s_lo = (amax_lo / FP8_E4M3_MAX).float().double()
        s_hi = (amax_hi / FP8_E4M3_MAX).float().double()
        bad_scale = _outside(scale, s_lo * (1 - div), s_hi * (1 + div))
    q = actual[:, :h].contiguous().view(torch.float8_e4m3fn).double()
    q_lo, q_hi = x_lo / scale, x_hi / scale
    bad_q = _outside(q, _e4m3(q_lo - div * q_lo.abs()), _e4m3(q_hi + div * q_hi.abs()))
    rep.max_abs_err = float((q * scale - (x_lo + x_hi) / 2).abs().max()) if n else 0.0
    rep.unexplained = int(4 * bad_scale.sum() + bad_q.sum())
    _locate(bad_scale, "scale", rep.failures)
    _locate(bad_q, "fp8 value", rep.failures)
    return rep
