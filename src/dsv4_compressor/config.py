"""Compressor configurations and their learned parameters (SPEC sections 1-2).

A :class:`CompressorConfig` says *what* a compressor layer computes (ratio, head size, rope size,
overlapping windows or not, latent or indexer output); :class:`CompressorParams` holds the tensors it
computes with.  Everything else (the reference, the kernels, the cache) derives its sizes from these two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rope import YarnScaling, rope_tables

__all__ = [
    "CompressorConfig",
    "CompressorParams",
    "LATENT",
    "INDEXER",
    "RMS_NORM_EPS",
    "COMPRESS_ROPE_THETA",
    "MAX_POSITIONS",
    "MODELS",
]

LATENT = "latent"
INDEXER = "indexer"

#: DeepSeek-V4 config.json values (SPEC section 1).
RMS_NORM_EPS = 1e-6
COMPRESS_ROPE_THETA = 160000.0
MAX_POSITIONS = 1_048_576
#: Compressed layers per DeepSeek-V4 model (SPEC section 1): ``csa`` (ratio 4, each with its Lightning indexer)
#: and ``hca`` (ratio 128). The models' other layers keep only the sliding window and need no compressor.
MODELS = {
    "DeepSeek-V4-Flash": {"csa": 21, "hca": 20},
    "DeepSeek-V4-Pro": {"csa": 30, "hca": 31},
}

#: The FP8 latent encoding packs nope dims in blocks of this many values, one UE8M0 scale each.
FP8_BLOCK = 64
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class CompressorConfig:
    """Shape and semantics of one compressor layer.

    Args:
        ratio: source tokens pooled into one entry (``r``): 128 for HCA, 4 for CSA and the indexer.
        head_dim: length of one entry (``H``).
        rope_dim: trailing dims rotated by rope (``R``), interleaved pairs.
        overlap: windows span the previous group too (CSA, indexer); rows are then ``2W = 4H`` wide.
        output: ``"latent"`` (584-byte FP8 record, FlashMLA sparse layout) or ``"indexer"`` (bf16 key).
        indexer_fp8: for the indexer, also write the 132-byte FP8 pack (Hadamard + per-token scale).
        name: label used in tables and errors.
    """

    ratio: int
    head_dim: int
    rope_dim: int
    overlap: bool
    output: str = LATENT
    indexer_fp8: bool = False
    name: str = "custom"

    # -- DeepSeek-V4 constructors ---------------------------------------------------------------
    @classmethod
    def hca(cls) -> CompressorConfig:
        """Heavily compressed attention: 128 tokens -> one 512-dim latent, no overlap."""
        return cls(ratio=128, head_dim=512, rope_dim=64, overlap=False, output=LATENT, name="hca")

    @classmethod
    def csa(cls) -> CompressorConfig:
        """Compressed sparse attention: 4 tokens -> one 512-dim latent, overlapping windows of 8."""
        return cls(ratio=4, head_dim=512, rope_dim=64, overlap=True, output=LATENT, name="csa")

    @classmethod
    def indexer(cls, fp8: bool = True) -> CompressorConfig:
        """Lightning-Indexer keys: 4 tokens -> one 128-dim bf16 key (+ optional 132-byte FP8 pack)."""
        return cls(ratio=4, head_dim=128, rope_dim=64, overlap=True, output=INDEXER, indexer_fp8=fp8, name="indexer")

    def __post_init__(self) -> None:
        if self.ratio < 1:
            raise ValueError(f"{self.name}: ratio must be >= 1, got {self.ratio}")
        if self.head_dim < 2 or self.rope_dim < 0 or self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(
                f"{self.name}: need an even rope_dim in [0, head_dim], got head_dim={self.head_dim} "
                f"rope_dim={self.rope_dim}"
            )
        if self.output not in (LATENT, INDEXER):
            raise ValueError(f"{self.name}: output must be 'latent' or 'indexer', got {self.output!r}")
        if self.output == LATENT and self.nope_dim % FP8_BLOCK:
            raise ValueError(
                f"{self.name}: latent output packs nope dims in blocks of {FP8_BLOCK}; "
                f"head_dim - rope_dim = {self.nope_dim} is not a multiple"
            )
        if self.output == INDEXER and self.indexer_fp8 and self.head_dim & (self.head_dim - 1):
            raise ValueError(f"{self.name}: the Hadamard FP8 pack needs a power-of-two head_dim, got {self.head_dim}")
        if self.output == LATENT and self.indexer_fp8:
            raise ValueError(f"{self.name}: indexer_fp8 applies to indexer output only")

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def width(self) -> int:
        """``W``: values (and gate logits) per token row: ``H``, or ``2H`` with overlap."""
        return self.head_dim * (2 if self.overlap else 1)

    @property
    def row_width(self) -> int:
        """Columns of one ``kv_score`` row: ``[kv (W) | score (W)]``."""
        return 2 * self.width

    @property
    def op_kind(self) -> str:
        """``ops.compress``'s ``kind`` for this compressor: ``"hca"``, ``"csa"`` or ``"indexer"``."""
        if self.output == INDEXER:
            return "indexer"
        return "csa" if self.overlap else "hca"

    @property
    def window(self) -> int:
        """Source positions pooled into one entry: ``r``, or ``2r`` with overlap."""
        return self.ratio * (2 if self.overlap else 1)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def fp8_blocks(self) -> int:
        """UE8M0 scale bytes in a latent record (one per 64 nope values)."""
        return self.nope_dim // FP8_BLOCK

    @property
    def record_data_bytes(self) -> int:
        """Latent record data part: nope as FP8 then rope dims as bf16 (576 for DeepSeek-V4)."""
        return self.nope_dim + 2 * self.rope_dim

    @property
    def record_scale_bytes(self) -> int:
        """Latent record scale part: one byte per block, zero padded to a power of two >= 8 (7 + 1 for
        DeepSeek-V4)."""
        size = 8
        while size < self.fp8_blocks:
            size *= 2
        return size

    @property
    def entry_bytes(self) -> int:
        """Bytes of one stored entry: 584 (latent), ``2H`` (indexer bf16 key)."""
        if self.output == LATENT:
            return self.record_data_bytes + self.record_scale_bytes
        return 2 * self.head_dim

    @property
    def indexer_fp8_bytes(self) -> int:
        """Bytes of one indexer FP8 pack: ``H`` FP8 values + a float32 scale (132)."""
        return self.head_dim + 4

    @property
    def default_page_size(self) -> int:
        """Slots per page used by the engines: one page covers 256 source tokens (64 for CSA, 2 for HCA)."""
        return max(1, 256 // self.ratio)

    def ring_rows(self, mtp_step: int = 0) -> int:
        """Rows of raw ring state per request (docs/SPEC.md section 6).

        Without overlap: ``ceil((r + mtp_step) / 4) * 4`` (132 for HCA at mtp_step 3).
        With overlap: ``2r + mtp_step``.
        """
        if mtp_step < 0:
            raise ValueError(f"mtp_step must be >= 0, got {mtp_step}")
        if self.overlap:
            return 2 * self.ratio + mtp_step
        return -(-(self.ratio + mtp_step) // 4) * 4

    def ring_bytes(self, mtp_step: int = 0) -> int:
        """Bytes of ring state per request (float32 rows of ``2W``)."""
        return self.ring_rows(mtp_step) * self.state_row_bytes

    @property
    def state_row_bytes(self) -> int:
        """Bytes of one row of raw state ``[kv | score + ape]``: ``2W`` float32 (4,096 for HCA). Every engine's
        ring (LightLLM's, SGLang's, vLLM's blocks) is a number of these rows."""
        return self.row_width * 4

    def online_bank_bytes(self, mtp_step: int = 0) -> int:
        """Bytes of online HCA state per request: ``mtp_step + 1`` banks of ``(max, sum, weighted sum)`` per
        channel, ``3H`` float32 each (24,576 for HCA at mtp_step 3). What replaces the ring in every engine."""
        if mtp_step < 0:
            raise ValueError(f"mtp_step must be >= 0, got {mtp_step}")
        return (mtp_step + 1) * 3 * self.head_dim * 4

    def group_start(self, g: int) -> int:
        return g * self.ratio

    def describe(self) -> str:
        ov = "overlap" if self.overlap else "no overlap"
        return f"{self.name}: r={self.ratio} H={self.head_dim} R={self.rope_dim} {ov} -> {self.output}"


@dataclass
class CompressorParams:
    """Learned parameters and rope tables of one compressor layer (SPEC section 2).

    Args:
        ape: float32 ``[r, W]`` absolute position bias added to the gate logits (row ``p % r``).
        norm_weight: ``[H]`` RMSNorm weight, float32 or bfloat16 (math is float32).
        cos, sin: float32 ``[max_positions, R/2]`` rope tables.
        eps: RMSNorm epsilon.
    """

    ape: torch.Tensor
    norm_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    eps: float = RMS_NORM_EPS

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]

    @property
    def device(self) -> torch.device:
        return self.ape.device

    def validate(self, config: CompressorConfig) -> CompressorParams:
        """Raise ``ValueError`` unless these parameters fit ``config``; returns ``self``."""
        name = config.name
        expect = {
            "ape": ((config.ratio, config.width), (torch.float32,)),
            "norm_weight": ((config.head_dim,), (torch.float32, torch.bfloat16)),
            "cos": ((self.cos.shape[0], config.rope_dim // 2), (torch.float32,)),
            "sin": ((self.cos.shape[0], config.rope_dim // 2), (torch.float32,)),
        }
        for attr, (shape, dtypes) in expect.items():
            t = getattr(self, attr)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: params.{attr} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: params.{attr} must have shape {list(shape)}, got {list(t.shape)}")
            if t.dtype not in dtypes:
                raise ValueError(f"{name}: params.{attr} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
            if t.device != self.ape.device:
                raise ValueError(f"{name}: params.{attr} is on {t.device}, params.ape on {self.ape.device}")
            if t.numel() and t.device.type != "meta" and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: params.{attr} has non-finite values")
        if self.cos.shape[0] < config.ratio:
            raise ValueError(f"{name}: rope tables cover {self.cos.shape[0]} positions, fewer than one group")
        if not (isinstance(self.eps, float) or isinstance(self.eps, int)) or not (0 < self.eps < 1):
            raise ValueError(f"{name}: eps must be a float in (0, 1), got {self.eps!r}")
        return self

    def to(self, device) -> CompressorParams:
        return CompressorParams(
            self.ape.to(device),
            self.norm_weight.to(device),
            self.cos.to(device),
            self.sin.to(device),
            self.eps,
        )

    @classmethod
    def random(
        cls,
        config: CompressorConfig,
        *,
        max_positions: int = 65536,
        seed: int = 0,
        device="cpu",
        yarn: YarnScaling | None = YarnScaling(),
        norm_dtype: torch.dtype = torch.float32,
    ) -> CompressorParams:
        """Random but realistic parameters (for demos, tests and benchmarks): ape ~ N(0, 0.5),
        norm weight ~ 1 + N(0, 0.1), DeepSeek YaRN rope tables (``yarn=None`` for plain rope)."""
        gen = torch.Generator().manual_seed(seed)
        ape = torch.randn(config.ratio, config.width, generator=gen) * 0.5
        norm_weight = (1.0 + 0.1 * torch.randn(config.head_dim, generator=gen)).to(norm_dtype)
        cos, sin = rope_tables(config.rope_dim, max_positions, base=COMPRESS_ROPE_THETA, yarn=yarn)
        return cls(ape, norm_weight, cos, sin).to(device).validate(config)
