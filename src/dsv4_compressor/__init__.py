"""dsv4-compressor: DeepSeek-V4's compressed KV cache (HCA, CSA and Lightning-Indexer compressors).

Public API::

    import dsv4_compressor as dc
    cfg = dc.CompressorConfig.hca()
    params = dc.CompressorParams.random(cfg)            # or your checkpoint's tensors
    cache = dc.CompressedKVCache(cfg, params, max_requests=8, max_seq_len=8192)
    cache.step(request_ids, starts, num_rows, kv_score)
    cache.entries(request_id)
"""

from .cache import CompressedKVCache, StepError
from .config import INDEXER, LATENT, CompressorConfig, CompressorParams
from .rope import YarnScaling, rope_tables
from .step import StepDescriptor, build_step_descriptor
from .workspace import C128ScratchPlan, CapacityError, Workspace, plan_c128_scratch

__version__ = "0.1.0"

__all__ = [
    "CompressedKVCache",
    "StepError",
    "CompressorConfig",
    "CompressorParams",
    "LATENT",
    "INDEXER",
    "YarnScaling",
    "rope_tables",
    "StepDescriptor",
    "build_step_descriptor",
    "C128ScratchPlan",
    "CapacityError",
    "Workspace",
    "plan_c128_scratch",
]
