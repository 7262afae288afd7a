"""Stand-ins of LightLLM's DeepSeek-V4 serving objects (``ModelTC/LightLLM``, branch ``support_ds4``), for the
LightLLM adapter's tests and the multi-GPU harness (``benchmarks/multi_gpu/``, ``scripts/multi_gpu_run.py``):
LightLLM does not install on a CPU machine, so these classes play it, with its names, attributes, dtypes and
layouts as far as the compressors see them (docs/INTEGRATION.md, "LightLLM").

- :mod:`.objects`: the memory manager, request manager, ``infer_state``, compressor and indexer objects, the
  slot bookkeeping (:class:`SlotAllocator`) and :func:`make_infer_state`;
- :mod:`.spawn`: the stand-ins under LightLLM's module paths (:func:`as_lightllm`) and a LightLLM-shaped package
  for launcher tests in real processes (:func:`write_spawn_stand_ins`);
- :mod:`.capacity`: LightLLM's KV cache sizing and the capacity table (``python -m helpers.lightllm_sim
  capacity`` from ``tests/``).

Every public name is re-exported here (``from helpers import lightllm_sim as sim``; ``sim.SlotAllocator``).
"""

from .capacity import (
    DSV4_INDEXER_BYTES_PER_TOKEN,
    DSV4_MLA_BYTES_PER_TOKEN,
    DSV4_SWA_FULL_TOKENS_RATIO,
    LIGHTLLM_DEFAULTS,
    MODEL_LAYERS,
    bare_memory_manager,
    capacity_report,
    capacity_table,
    lightllm_cell_size,
)
from .objects import (
    DSV4_C4_PAGE_SIZE,
    DSV4_C4_STATE_RING,
    DSV4_C128_PAGE_SIZE,
    DSV4_C128_STATE_RING,
    DSV4_INDEXER_PAGE_SIZE,
    DSV4_SWA_PAGE_SIZE,
    POISON_BYTE,
    POISON_F32,
    CompressorInfer,
    DeepseekV4IndexInfer,
    DeepseekV4InferStateInfo,
    DeepseekV4MemoryManager,
    DeepseekV4ReqManager,
    DeepseekV4TpPartModel,
    Linear,
    NoQuantization,
    PackedPagePool,
    PDCacheLayout,
    SlotAllocator,
    WeightPack,
    copy_for_cuda_graph,
    copy_pd_cache_page,
    make_infer_state,
    mm_fp32_supported,
    poison_f32,
    prompt_page_size,
)
from .spawn import LAYER_MODULE, MEM_MODULE, MODEL_MODULE, STATE_MODULE, as_lightllm, write_spawn_stand_ins

__all__ = [
    "DSV4_INDEXER_BYTES_PER_TOKEN",
    "DSV4_MLA_BYTES_PER_TOKEN",
    "DSV4_SWA_FULL_TOKENS_RATIO",
    "LIGHTLLM_DEFAULTS",
    "MODEL_LAYERS",
    "bare_memory_manager",
    "capacity_report",
    "capacity_table",
    "lightllm_cell_size",
    "DSV4_C4_PAGE_SIZE",
    "DSV4_C4_STATE_RING",
    "DSV4_C128_PAGE_SIZE",
    "DSV4_C128_STATE_RING",
    "DSV4_INDEXER_PAGE_SIZE",
    "DSV4_SWA_PAGE_SIZE",
    "POISON_BYTE",
    "POISON_F32",
    "CompressorInfer",
    "DeepseekV4IndexInfer",
    "DeepseekV4InferStateInfo",
    "DeepseekV4MemoryManager",
    "DeepseekV4ReqManager",
    "DeepseekV4TpPartModel",
    "Linear",
    "NoQuantization",
    "PackedPagePool",
    "PDCacheLayout",
    "SlotAllocator",
    "WeightPack",
    "copy_for_cuda_graph",
    "copy_pd_cache_page",
    "make_infer_state",
    "mm_fp32_supported",
    "poison_f32",
    "prompt_page_size",
    "LAYER_MODULE",
    "MEM_MODULE",
    "MODEL_MODULE",
    "STATE_MODULE",
    "as_lightllm",
    "write_spawn_stand_ins",
]
