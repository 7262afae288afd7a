"""LightLLM's geometry: its pool constants and the layout the adapter reads off its memory manager."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ...config import CompressorConfig
from ...errors import EngineNotInstalled

#: LightLLM's constants (``deepseek4_mem_manager.py``): SWA page, pool pages, the C4 ring before MTP padding.
SWA_PAGE_SIZE = 128
C4_PAGE_SIZE = 64
C128_PAGE_SIZE = 2
INDEXER_PAGE_SIZE = 64
C4_STATE_RING_BASE = 8
#: LightLLM packs the indexer key as ``fp8(bf16(hadamard(bf16 key)))`` with a float32 ``amax / 448`` scale.
INDEXER_PACK = "hadamard_bf16"
#: The C4 ratio (CSA and its indexer); the HCA ratio is a layout field (128; smaller in tests).
C4_RATIO = 4
#: DeepSeek-V4's indexer key size (``index_head_dim``).
INDEXER_HEAD_DIM = 128
#: How :func:`compressor_compress` projects ``x``: ``"auto"`` (``ops.compress_from_hidden`` /
#: ``ops.compress_online_hca_from_hidden``, our Triton projection, where it is the faster path: steps of at most
#: ``ops.projection_triton_rows(2W, D)`` rows; LightLLM's GEMM then our compress elsewhere, where cuBLAS is
#: level or faster) or ``"engine"`` (LightLLM's GEMM then our compress, always).
PROJECTIONS = ("auto", "engine")
#: The projection switch for processes LightLLM spawns (``install(projection=None)`` reads it; default auto).
PROJECTION_ENV = "DSV4C_LIGHTLLM_PROJECTION"

#: ``infer_state`` attributes the builder sets (tensors, so ``copy_for_cuda_graph`` sees them) and reads back.
_C4_PLAN, _C4_READ, _C4_SAVE = "dsv4c_c4_plan", "dsv4c_c4_read_rows", "dsv4c_c4_save_rows"
_C128_PLAN, _C128_SCRATCH = "dsv4c_c128_plan", "dsv4c_c128_scratch"
#: The builder itself (not a tensor: copy_for_cuda_graph leaves it alone; layers read its layout and options).
_BUILDER = "dsv4c_builder"
#: Where :func:`allot_online_hca_banks` puts the banks on LightLLM's memory manager.
_BANKS = "dsv4c_c128_state_banks"


class LightLLMNotInstalled(EngineNotInstalled):
    """``install()`` was called where LightLLM (branch ``support_ds4``) cannot be imported."""


# ---------------------------------------------------------------------------------------------------------------
# The engine's geometry
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LightLLMLayout:
    """What the ops need to know about LightLLM's buffers (read once from its memory manager).

    ``max_request_num`` is also LightLLM's ``HOLD_REQUEST_ID``: request slots are ``0..max_request_num - 1`` and
    padding rows carry ``max_request_num``. ``c4_state_ring = 8 + mtp_step``; ``c128_state_ring =
    ceil((c128_ratio + mtp_step) / 4) * 4`` (our ``CompressorConfig.ring_rows``). ``index_dtype`` is the dtype of
    ``full_to_c4_indexs`` / ``full_to_c128_indexs`` (``build_plan`` reads either).
    """

    max_request_num: int
    mtp_step: int
    c4_state_ring: int
    c128_state_ring: int
    has_c4: bool = True
    has_c128: bool = True
    head_dim: int = 512
    c128_ratio: int = 128
    swa_page_size: int = SWA_PAGE_SIZE
    c4_page_size: int = C4_PAGE_SIZE
    c128_page_size: int = C128_PAGE_SIZE
    indexer_page_size: int = INDEXER_PAGE_SIZE
    index_dtype: torch.dtype = torch.int32

    def __post_init__(self) -> None:
        if self.max_request_num < 1 or self.mtp_step < 0:
            raise ValueError(f"LightLLMLayout: max_request_num >= 1 and mtp_step >= 0, got {self}")
        if self.has_c4 and self.c4_state_ring != C4_STATE_RING_BASE + self.mtp_step:
            raise ValueError(f"LightLLMLayout: c4_state_ring must be 8 + mtp_step = {8 + self.mtp_step}, "
                             f"got {self.c4_state_ring}")  # fmt: skip
        if self.has_c4 and self.c4_state_ring > self.swa_page_size:
            raise ValueError(f"LightLLMLayout: c4_state_ring {self.c4_state_ring} exceeds the SWA page "
                             f"{self.swa_page_size}")  # fmt: skip
        want = self.hca_config.ring_rows(self.mtp_step)
        if self.has_c128 and self.c128_state_ring != want:
            raise ValueError(f"LightLLMLayout: c128_state_ring must be ceil((r + mtp_step) / 4) * 4 = {want}, got "
                             f"{self.c128_state_ring}")  # fmt: skip

    @property
    def hca_config(self) -> CompressorConfig:
        """The HCA layers' configuration at this layout's ratio and head size."""
        return CompressorConfig(ratio=self.c128_ratio, head_dim=self.head_dim, rope_dim=64, overlap=False)

    @classmethod
    def from_mem_manager(
        cls, mem_manager, *, swa_page_size: int | None = None, c128_ratio: int | None = None
    ) -> LightLLMLayout:
        """Read the layout of a ``DeepseekV4MemoryManager``: ``max_request_num``, ``c4_state_ring``,
        ``c128_state_ring``, ``head_dim``, ``n_c4`` / ``n_c128``, the pools' ``page_size`` and the index tables'
        dtype; the SWA page and the C128 ratio are its module's ``DSV4_SWA_PAGE_SIZE`` and
        ``DSV4_C128_STATE_RING`` (128 and 128; a scaled-down stand-in may set others) unless given. Also before
        ``_init_buffers`` has run (LightLLM sizes its fixed buffers then, ``get_fixed_memory_size``): the pools'
        page sizes and the tables' dtype are then LightLLM's (64 / 2 / 64, int32)."""
        mm = mem_manager
        consts = _engine_constants(mm)
        has_c4, has_c128 = mm.n_c4 > 0, mm.n_c128 > 0

        def page_size(pool: str, default: int) -> int:
            found = getattr(mm, pool, None)
            return default if found is None else found.page_size

        table = getattr(mm, "full_to_c4_indexs" if has_c4 else "full_to_c128_indexs", None)
        return cls(
            max_request_num=mm.max_request_num,
            mtp_step=mm.c4_state_ring - consts["DSV4_C4_STATE_RING"],
            c4_state_ring=mm.c4_state_ring,
            c128_state_ring=mm.c128_state_ring,
            has_c4=has_c4,
            has_c128=has_c128,
            head_dim=mm.head_dim,
            c128_ratio=consts["DSV4_C128_STATE_RING"] if c128_ratio is None else c128_ratio,
            swa_page_size=consts["DSV4_SWA_PAGE_SIZE"] if swa_page_size is None else swa_page_size,
            c4_page_size=page_size("c4_pool", C4_PAGE_SIZE) if has_c4 else C4_PAGE_SIZE,
            c128_page_size=page_size("c128_pool", C128_PAGE_SIZE) if has_c128 else C128_PAGE_SIZE,
            indexer_page_size=page_size("c4_indexer_pool", INDEXER_PAGE_SIZE) if has_c4 else INDEXER_PAGE_SIZE,
            index_dtype=torch.int32 if table is None else table.dtype,
        )


def _engine_constants(mem_manager) -> dict[str, int]:
    """LightLLM's layout constants, from the module that defines the memory manager's class (its own values:
    a stand-in may scale them down), else LightLLM's."""
    module = sys.modules.get(type(mem_manager).__module__)
    defaults = {"DSV4_SWA_PAGE_SIZE": SWA_PAGE_SIZE, "DSV4_C4_STATE_RING": C4_STATE_RING_BASE,
                "DSV4_C128_STATE_RING": 128}  # fmt: skip
    return {name: int(getattr(module, name, value)) for name, value in defaults.items()}


def _hidden_size(config) -> int | None:
    """``hidden_size`` of a model config (LightLLM's ``model.config``, a dict), if it has a usable one."""
    value = config.get("hidden_size") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 16 and not value % 16 else None
