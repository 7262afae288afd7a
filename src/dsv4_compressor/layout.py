"""Byte layouts of compressed entries and their pages (SPEC section 4).

Latent entry (HCA, CSA), the FlashMLA "fp8 sparse" record of 584 bytes::

    data   [0, 576):  448 nope values as float8 e4m3fn, then 64 rope values as bfloat16 (little-endian)
    scales [576, 584): 7 UE8M0 exponents (one per 64 nope values), then one zero byte

A page of ``P`` slots stores ``[P x 576 data][P x 8 scales]``, padded to a multiple of 576 bytes.

The other latent layouts (``layout=``, :data:`LATENT_LAYOUTS`; SGLang's ``kv_layout.cuh`` on Blackwell), at
DeepSeek-V4's ``H = 512``::

    "v41"          528 B: 512 e4m3 of the float32 values (rope dims too, no bf16 rounding), then 16 UE8M0
                   exponents, one per 32 values, ``e = ceil(log2(max(amax / 448, 1e-4)))``; pages
                   ``[P x 512][P x 16]`` padded to a multiple of 512
    "v41_new"      the "v41" bytes, each record's data then its scales (528 B apart), no page padding
    "uniform_fp8"  512 B: ``e4m3(x)`` of every float32 value (round to nearest even, saturating at 448), no
                   scales (the reader's unit scale); pages ``P x 512``, slot ``t`` at ``t * 512``. SGLang's trtllm
                   compressor store (``compressor_trtllm.forward_compress_uniform_fp8``): the pooled float32
                   vector through its Triton ``fused_norm_rope_inplace_triton`` (float32 in and out, no bf16
                   step; ``tl.rsqrt``, which is ``rsqrt.approx.f32`` on the GPU), then torch's
                   ``.to(float8_e4m3fn)`` into ``DeepSeekV4UniformFP8KVPool``. The kernels finish these records
                   with SGLang's Triton operations (``kernels.entry_pack.norm_rope_sglang_triton``;
                   :func:`dsv4_compressor.reference.finish_entries_sglang_triton` is its plain-PyTorch form)

Indexer key: the rotated vector as bfloat16; its optional FP8 pack (132 bytes) is the Walsh-Hadamard
transform (Sylvester order, scaled by ``H**-0.5``) as e4m3fn with one float32 scale per token, paged as
``[P x 128 fp8][P x 4-byte scale]``.

All functions here are plain PyTorch, run on any device, and are the byte-level reference the kernels
are checked against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import FP8_BLOCK, FP8_E4M3_MAX, INDEXER, LATENT, CompressorConfig

__all__ = [
    "LATENT_LAYOUTS",
    "PageLayout",
    "latent_page_layout",
    "latent_record_bytes",
    "indexer_fp8_page_layout",
    "round_to_bf16",
    "ue8m0_exponent",
    "encode_latent",
    "v41_exponent",
    "decode_latent",
    "hadamard",
    "INDEXER_PACKS",
    "indexer_pack_values",
    "ceil_log2",
    "encode_indexer_fp8",
    "decode_indexer_fp8",
]

AMAX_FLOOR = 1e-4
#: Latent record layouts: DeepSeek-V4's FlashMLA fp8-sparse record (the default), SGLang's V4.1 records
#: (block-split and interleaved pages) and the trtllm backend's uniform FP8 values.
LATENT_LAYOUTS = ("v4", "v41", "v41_new", "uniform_fp8")
#: One UE8M0 scale per this many values of a V4.1 record.
V41_TILE = 32


# ----------------------------------------------------------------------------------------------
# Pages
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PageLayout:
    """A page of ``page_size`` records split into a data area then a scale area.

    ``bytes_per_page = ceil(P * (data + scale) / align) * align``; slot ``t`` of page ``k`` keeps its data
    at ``k * bytes_per_page + t * data_bytes`` and its scale at ``k * bytes_per_page + P * data_bytes +
    t * scale_bytes``; ``interleaved``: its data at ``k * bytes_per_page + t * record_bytes``, its scale right
    after. A global slot index is ``k * P + t``.
    """

    page_size: int
    data_bytes: int
    scale_bytes: int
    align: int = 1
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    @property
    def record_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def bytes_per_page(self) -> int:
        raw = self.page_size * self.record_bytes
        return -(-raw // self.align) * self.align

    def data_offset(self, slot_in_page: int) -> int:
        return slot_in_page * (self.record_bytes if self.interleaved else self.data_bytes)

    def scale_offset(self, slot_in_page: int) -> int:
        if self.interleaved:
            return slot_in_page * self.record_bytes + self.data_bytes
        return self.page_size * self.data_bytes + slot_in_page * self.scale_bytes

    def _byte_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat byte offsets ``[N, record_bytes]`` of each record's bytes in a flat pool."""
        slots = slots.to(torch.int64)
        page, t = slots // self.page_size, slots % self.page_size
        base = page * self.bytes_per_page
        if self.interleaved:
            return (base + t * self.record_bytes)[:, None] + torch.arange(self.record_bytes, device=slots.device)
        d = torch.arange(self.data_bytes, device=slots.device)
        s = torch.arange(self.scale_bytes, device=slots.device)
        data = (base + t * self.data_bytes)[:, None] + d[None, :]
        scale = (base + self.page_size * self.data_bytes + t * self.scale_bytes)[:, None] + s[None, :]
        return torch.cat([data, scale], dim=1)

    def write(self, pages: torch.Tensor, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Scatter ``records`` (uint8 ``[N, record_bytes]``) into ``pages`` (uint8 ``[num_pages, bpp]``)."""
        if records.shape[0]:
            pages.view(-1)[self._byte_index(slots).reshape(-1)] = records.reshape(-1)

    def read(self, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Gather the records of ``slots`` as uint8 ``[N, record_bytes]``."""
        idx = self._byte_index(slots)
        return pages.reshape(-1)[idx.reshape(-1)].reshape(idx.shape)


def _check_layout(layout: str) -> None:
    if layout not in LATENT_LAYOUTS:
        raise ValueError(f"layout must be one of {list(LATENT_LAYOUTS)}, got {layout!r}")


def latent_record_bytes(head: int, rope: int, layout: str = "v4") -> tuple[int, int]:
    """``(data, scale)`` bytes of one latent record of ``head`` dims (``rope`` of them rotated) in ``layout``:
    (576, 8), (512, 16), (512, 16), (512, 0) at DeepSeek-V4's shapes."""
    _check_layout(layout)
    if layout == "v4":
        nope = head - rope
        blocks, scale = nope // FP8_BLOCK, 8
        while scale < blocks:
            scale *= 2
        return nope + 2 * rope, scale
    if layout == "uniform_fp8":
        return head, 0
    return head, head // V41_TILE


def latent_page_layout(config: CompressorConfig, page_size: int, layout: str = "v4") -> PageLayout:
    """Latent pages of ``layout`` (DeepSeek-V4 shapes): ``"v4"`` 37,440 bytes for 64 slots, 1,728 for 2;
    ``"v41"`` 33,792 for 64, 1,536 for 2; ``"v41_new"`` 33,792 and 1,056; ``"uniform_fp8"`` 32,768 and 1,024."""
    if config.output != LATENT:
        raise ValueError(f"{config.name}: latent pages need latent output")
    data, scale = latent_record_bytes(config.head_dim, config.rope_dim, layout)
    if layout == "v41_new":
        return PageLayout(page_size, data, scale, align=data + scale, interleaved=True)
    return PageLayout(page_size, data, scale, align=data)


def indexer_fp8_page_layout(config: CompressorConfig, page_size: int) -> PageLayout:
    """Indexer FP8 pages: ``[P x H fp8][P x 4-byte float32 scale]`` (8,448 bytes for 64 slots)."""
    if config.output != INDEXER:
        raise ValueError(f"{config.name}: indexer pages need indexer output")
    return PageLayout(page_size, config.head_dim, 4, align=1)


# ----------------------------------------------------------------------------------------------
# Latent record
# ----------------------------------------------------------------------------------------------
def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 (nearest even) and back to float32."""
    return x.float().to(torch.bfloat16).float()


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``e = ceil(log2(max(amax, 1e-4) / 448))`` as int32, exactly.

    The quotient is formed in float32 (as every implementation does); the ceiling of its log2 is then
    taken exactly from the float's bits (``torch.frexp``), not from a rounded float ``log2``, which maps
    values a few ulps above a power of two to that power and would make the result implementation-defined.
    """
    y = torch.clamp(amax.float(), min=AMAX_FLOOR) / FP8_E4M3_MAX
    mantissa, exponent = torch.frexp(y)  # y = mantissa * 2**exponent, mantissa in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def _to_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 already within [-448, 448] -> e4m3fn bytes, round to nearest even."""
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def v41_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``e = ceil(log2(max(amax / 448, 1e-4)))`` as int32, exactly: the quotient rounded to float32, the floor
    (``2^-13``) applied after the division, as SGLang's ``quantize_k_cache_v41``."""
    y = torch.clamp(amax.float() / FP8_E4M3_MAX, min=AMAX_FLOOR)
    return ceil_log2(y)


def _encode_v41(n: torch.Tensor) -> torch.Tensor:
    num, head = n.shape
    x = n.float().view(num, head // V41_TILE, V41_TILE)
    e = v41_exponent(x.abs().amax(dim=-1))
    q = _to_e4m3_bytes(torch.ldexp(x, (-e)[..., None].float())).view(num, head)  # |x / 2^e| <= 448, exact
    return torch.cat([q, (e + 127).to(torch.uint8)], dim=1)


def encode_latent(n: torch.Tensor, config: CompressorConfig, layout: str = "v4") -> torch.Tensor:
    """Pack normalized, rotated entries ``n`` (float ``[N, H]``) into uint8 ``[N, record bytes]`` of ``layout``.

    ``"v4"``: nope dims bf16-rounded, per 64-block power-of-two scale ``2^e``, ``clamp(x / 2^e, +-448)`` as
    e4m3fn, scale byte ``e + 127``; rope dims: bf16 bytes; then zero padding of the scale area. ``"v41"`` /
    ``"v41_new"`` (the same record): every dim of the float32 values, per 32-block ``2^e`` with
    :func:`v41_exponent`, ``x / 2^e`` as e4m3fn, then the ``e + 127`` bytes. ``"uniform_fp8"``:
    ``clamp(x, +-448)`` as e4m3fn (round to nearest even): the bytes of torch's ``x.float().to(float8_e4m3fn)``,
    SGLang's trtllm store, which saturates too since pytorch/pytorch#178817 (torch 2.13 here; before it, torch wrote
    NaN, ``0x7F``, for ``|x| > 464``: entries stay below ``sqrt(H) * max|norm_weight|``, 22.6 for unit weights).
    ``n`` there is SGLang's float32 Triton norm and rope of the pooled vector (no bf16 rounding before the cast):
    :func:`dsv4_compressor.reference.finish_entries_sglang_triton`.
    """
    if config.output != LATENT:
        raise ValueError(f"{config.name}: encode_latent needs latent output")
    _check_layout(layout)
    n = n.float()
    if layout in ("v41", "v41_new"):
        return _encode_v41(n)
    if layout == "uniform_fp8":
        return _to_e4m3_bytes(n.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    num = n.shape[0]
    nope = round_to_bf16(n[:, : config.nope_dim]).view(num, config.fp8_blocks, FP8_BLOCK)
    e = ue8m0_exponent(nope.abs().amax(dim=-1))  # [N, blocks]
    scaled = torch.ldexp(nope, (-e)[..., None].float())  # exact: division by a power of two
    q = _to_e4m3_bytes(scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)).view(num, config.nope_dim)
    rope = n[:, config.nope_dim :].to(torch.bfloat16).contiguous().view(torch.uint8).view(num, 2 * config.rope_dim)
    scales = torch.zeros(num, config.record_scale_bytes, dtype=torch.uint8, device=n.device)
    scales[:, : config.fp8_blocks] = (e + 127).to(torch.uint8)
    return torch.cat([q, rope, scales], dim=1)


def decode_latent(records: torch.Tensor, config: CompressorConfig, layout: str = "v4") -> torch.Tensor:
    """Dequantize uint8 ``[N, record bytes]`` records of ``layout`` to float32 ``[N, H]``: ``fp8 * 2^(byte -
    127)`` (``"uniform_fp8"``: the fp8 values)."""
    _check_layout(layout)
    num = records.shape[0]
    records = records.contiguous()
    head = config.head_dim
    if layout == "uniform_fp8":
        return records[:, :head].contiguous().view(torch.float8_e4m3fn).float()
    if layout in ("v41", "v41_new"):
        q = records[:, :head].contiguous().view(torch.float8_e4m3fn).float().view(num, -1, V41_TILE)
        e = records[:, head : head + head // V41_TILE].to(torch.int32) - 127
        return torch.ldexp(q, e[..., None].float()).view(num, head)
    q = records[:, : config.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    data = config.record_data_bytes
    e = records[:, data : data + config.fp8_blocks].to(torch.int32) - 127
    nope = torch.ldexp(q.view(num, config.fp8_blocks, FP8_BLOCK), e[..., None].float()).view(num, config.nope_dim)
    rope = records[:, config.nope_dim : data].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)


# ----------------------------------------------------------------------------------------------
# Indexer FP8 pack
# ----------------------------------------------------------------------------------------------
def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform over the last dim in natural (Sylvester) order:
    ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``.

    Computed with the butterfly in float64, which is exact for bf16 keys, then rounded once to ``x.dtype``,
    so the result does not depend on the order of the additions."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two length, got {n}")
    y = x.double()
    h = 1
    while h < n:
        y = y.view(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*x.shape[:-1], n)
        h *= 2
    return y.to(x.dtype)


#: How each engine packs an indexer key (see ``kernels/indexer_pack.py``): the values that are quantized, and
#: whether the scale is ``amax / 448`` or a power of two.
INDEXER_PACKS = ("hadamard", "hadamard_bf16", "hadamard_f32", "pow2", "pow2_ue8m0")


def indexer_pack_values(key: torch.Tensor, variant: str = "hadamard") -> torch.Tensor:
    """The float32 values ``[N, H]`` a pack ``variant`` quantizes, from float keys: ``hadamard`` (SPEC):
    ``H(bf16(key)) * H**-0.5``; ``hadamard_bf16`` (LightLLM): that rounded to bf16; ``hadamard_f32`` (SGLang):
    ``H(key) * H**-0.5`` of the unrounded key; ``pow2`` and ``pow2_ue8m0`` (vLLM): ``bf16(key)``."""
    if variant not in INDEXER_PACKS:
        raise ValueError(f"unknown indexer pack variant {variant!r}; choose one of {INDEXER_PACKS}")
    h = key.shape[-1]
    if variant in ("pow2", "pow2_ue8m0"):
        return round_to_bf16(key)
    source = key.float() if variant == "hadamard_f32" else round_to_bf16(key)
    x = hadamard(source) * (1.0 / math.sqrt(h))
    return round_to_bf16(x) if variant == "hadamard_bf16" else x


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` of positive normal float32 values, exactly (from the bits)."""
    mantissa, exponent = torch.frexp(x.float())  # x = m * 2^e, m in [0.5, 1)
    return (exponent - 1 + (mantissa != 0.5).to(exponent.dtype)).to(torch.int32)


def encode_indexer_fp8(key: torch.Tensor, variant: str = "hadamard") -> torch.Tensor:
    """Pack indexer keys (bf16 or float ``[N, H]``) into uint8 ``[N, H + 4]``: ``H`` e4m3fn values of
    ``x / scale`` then the float32 ``scale`` as 4 little-endian bytes, with ``x = indexer_pack_values(key,
    variant)`` and ``scale = max(amax, 1e-4) / 448`` (``pow2``: ``2^ceil(log2(max(amax, 1e-4) * (1/448)))``,
    the product rounded to float32 first; ``pow2_ue8m0``: that scale as four equal bytes ``e + 127``).
    ``hadamard_f32`` quantizes ``x * (1 / scale)`` as SGLang does. (``hadamard_bf16`` divides here; on the GPU
    LightLLM's ``/`` is the approximate ``div.full.f32``, which only the kernels repeat.)"""
    num, h = key.shape
    if num == 0:  # an empty [0, 1] scale tensor cannot be viewed as bytes
        return torch.zeros(0, h + 4, dtype=torch.uint8, device=key.device)
    x = indexer_pack_values(key, variant)
    amax = torch.clamp(x.abs().amax(dim=-1, keepdim=True), min=AMAX_FLOOR)
    if variant in ("pow2", "pow2_ue8m0"):
        e = ceil_log2(amax * torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32))
        scale = torch.ldexp(torch.ones_like(amax), e.float())
    else:
        scale = amax / FP8_E4M3_MAX
    scaled = x * (1.0 / scale) if variant == "hadamard_f32" else x / scale
    q = _to_e4m3_bytes(scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    if variant == "pow2_ue8m0":
        tail = (e + 127).to(torch.uint8).expand(num, 4)
    else:
        tail = scale.float().contiguous().view(torch.uint8).view(num, 4)
    return torch.cat([q, tail], dim=1)


def decode_indexer_fp8(records: torch.Tensor, variant: str = "hadamard") -> torch.Tensor:
    """Dequantize ``[N, H + 4]`` packs to the Hadamard-domain float32 values ``[N, H]`` (``fp8 * scale``;
    ``pow2_ue8m0``: ``scale = 2^(byte - 127)``)."""
    h = records.shape[1] - 4
    records = records.contiguous()
    q = records[:, :h].contiguous().view(torch.float8_e4m3fn).float()
    if variant == "pow2_ue8m0":
        scale = torch.ldexp(torch.ones(records.shape[0], 1), records[:, h : h + 1].float() - 127.0)
    else:
        scale = records[:, h:].contiguous().view(torch.float32)
    return q * scale
