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

__version__ = "0.2.0"

#: Public name -> the submodule that defines it. Imported on first use (PEP 562), so that importing the package
#: (e.g. the engines' entry points, :mod:`.integrations.entry_points`) imports neither torch nor Triton, and
#: ``@triton.jit``, which reads TRITON_INTERPRET when it decorates, runs only once a program asks for a kernel.
_LAZY = {
    "ops": None,
    "CacheGraph": "cache",
    "CompressedKVCache": "cache",
    "INDEXER": "config",
    "LATENT": "config",
    "CompressorConfig": "config",
    "CompressorParams": "config",
    "CapacityError": "errors",
    "OpError": "errors",
    "StepError": "errors",
    "YarnScaling": "rope",
    "rope_tables": "rope",
    "C128ScratchPlan": "workspace",
    "Workspace": "workspace",
    "plan_c128_scratch": "workspace",
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


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
