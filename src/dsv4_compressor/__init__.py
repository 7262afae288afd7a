"""dsv4-compressor: DeepSeek-V4's compressed KV cache (HCA, CSA and Lightning-Indexer compressors).

Two ways in::

    from dsv4_compressor import ops          # engines: plan once per step, compress into your own buffers
    ops.build_plan(plan, positions, row_req, out_slot, ratio=r, num_slots=n)
    ops.compress(kv_score, plan, ape, norm_weight, cos, sin, state, out_pages, kind="csa", page_size=64)

    import dsv4_compressor as dc             # everyone else: a streaming cache that owns its buffers
    cfg = dc.CompressorConfig.hca()
    params = dc.CompressorParams.random(cfg)            # or your checkpoint's tensors
    cache = dc.CompressedKVCache(cfg, params, max_requests=8, max_seq_len=8192)
    cache.step(request_ids, starts, num_rows, kv_score)
    cache.entries(request_id)
"""

from .cache import CacheGraph, CompressedKVCache
from .config import INDEXER, LATENT, CompressorConfig, CompressorParams
from .errors import CapacityError, OpError, StepError
from .rope import YarnScaling, rope_tables
from .workspace import C128ScratchPlan, Workspace, plan_c128_scratch

__version__ = "0.2.0"


def __getattr__(name):
    # ``dsv4_compressor.ops`` imports the kernels, and ``@triton.jit`` reads TRITON_INTERPRET when it decorates:
    # importing the package alone must not, so that a program may still choose the interpreter afterwards.
    if name == "ops":
        import importlib

        return importlib.import_module(".ops", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ops",
    "CompressedKVCache",
    "CacheGraph",
    "StepError",
    "CapacityError",
    "OpError",
    "CompressorConfig",
    "CompressorParams",
    "LATENT",
    "INDEXER",
    "YarnScaling",
    "rope_tables",
    "C128ScratchPlan",
    "Workspace",
    "plan_c128_scratch",
]
