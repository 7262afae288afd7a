"""What online HCA gives back in vLLM's own accounting: vLLM 0.33.0's KV-cache planner (the real functions, on
CPU) run for DeepSeek-V4-Flash and V4-Pro with the C128 ring state (``install()``) and with online HCA
(``install(hca="online")``), and the concurrent requests it admits at 8K and 32K tokens of context.

Per model and context: the layers' KV-cache specs as DeepSeek-V4 declares them (each layer's sliding-window
cache ``DeepseekV4SWACache``; a compressed layer's MLA cache, as ``DeepseekV4MLAAttention.get_kv_cache_spec``
builds it, and its ``CompressorStateCache``; a CSA layer's ``DeepseekV4IndexerCache`` and indexer state: the
real classes, whose C128 state spec is the adapter's under ``hca="online"``), the layout vLLM resolves for
V4's backends (``resolve_kv_cache_layout``: block-outermost, every group's page of a block packed together),
then ``get_global_kv_cache_groups``, ``get_kv_cache_configs`` for ``--kv-gib`` of KV memory and
``get_max_concurrency_for_kv_cache_config`` at ``max_model_len`` = the context: requests of that length the
pool holds at once. Settings: block size 256, ``fp8_ds_mla``, 8,192 batched tokens, 256 sequences, MTP with
``--mtp`` speculative tokens (1 by default). The ring's C128 group reserves the blocks of a 128-token window
plus a step's in-flight tokens; the online group one block of ``mtp + 1`` banks per request, and every block a
request holds costs the whole packed block, so the gain is in blocks per request.

``python -m dsv4_compressor.integrations.vllm.capacity [--kv-gib 40] [--mtp 1]`` prints the table (vLLM
importable; on a machine without a GPU it runs with ``CUDA_VISIBLE_DEVICES=""``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from types import SimpleNamespace

from ...config import MODELS

CONTEXTS = (8192, 32768)
KV_BLOCK = 256
HEAD, INDEX_HEAD, WINDOW = 512, 128, 128


def compress_ratios(model: str) -> list[int]:
    """The model's layers by compress ratio (docs/SPEC.md section 1: V4-Flash 21 CSA and 20 HCA of 43 layers,
    V4-Pro 30 and 31 of 61; the others sliding-window only, ratio 0), CSA and HCA alternating."""
    counts = MODELS[model]
    total = {"DeepSeek-V4-Flash": 43, "DeepSeek-V4-Pro": 61}[model]
    csa, hca = counts["csa"], counts["hca"]
    mixed = [r for pair in zip([128] * hca, [4] * csa) for r in pair] + [4] * (csa - hca) + [128] * (hca - csa)
    return [0] * (total - csa - hca) + mixed


def _config(context: int, mtp: int):
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig

    scheduler = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=context,
                                is_encoder_decoder=False)  # fmt: skip
    config = VllmConfig(scheduler_config=scheduler, device_config=DeviceConfig(device="cpu"),
                        cache_config=CacheConfig(block_size=KV_BLOCK, cache_dtype="fp8_ds_mla"))  # fmt: skip
    # what a DeepSeek-V4 model config resolves to (a real ModelConfig loads a checkpoint): its KV groups are
    # hybrid, it declares no grouping of its own
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.model_config = SimpleNamespace(max_model_len=context, original_max_model_len=context,
                                          supports_kv_cache_grouping=False)  # fmt: skip
    config.speculative_config = _mtp(mtp) if mtp else None
    return config


def _mtp(tokens: int):
    """The speculative config's fields vLLM's planner reads, as DeepSeek-V4's MTP sets them (``deepseek_mtp``:
    an EAGLE-family drafter, one MTP module run ``tokens`` times)."""

    def no():
        return False

    return SimpleNamespace(num_speculative_tokens=tokens, method="mtp", use_eagle=lambda: True,
                           use_multi_module_mtp=no, use_eagle_block_drop=no, use_dspark=no, use_dflash=no,
                           uses_draft_model=no, uses_dynamic_speculative_decoding=no,
                           disable_lookahead_block_hashes=True, parallel_drafting=False)  # fmt: skip


def layer_specs(model: str, config) -> dict:
    """Every KV-cache layer of ``model`` and its spec, from DeepSeek-V4's own cache classes (the C128 state's is
    whatever ``CompressorStateCache.get_kv_cache_spec`` returns now: the adapter's under ``hca="online"``)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    cache, specs, layers = config.cache_config, {}, []
    with set_current_vllm_config(config):
        for i, ratio in enumerate(compress_ratios(model)):
            p = f"model.layers.{i}.attn"
            layers.append(DeepseekV4SWACache(HEAD, WINDOW, torch.uint8, f"{p}.swa_cache", cache))
            if ratio == 0:
                continue
            # DeepseekV4MLAAttention.get_kv_cache_spec (fp8_ds_mla: 584-byte records, 576-byte alignment)
            specs[f"{p}.mla_attn"] = MLAAttentionSpec(
                block_size=cache.block_size, num_kv_heads=1, max_tp_shards=1, head_size=HEAD, dtype=torch.uint8,
                tokens_per_state=ratio, cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
                kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"), state_content_bytes=584,
            )  # fmt: skip
            coff = 2 if ratio == 4 else 1
            layers.append(CompressorStateCache(2 * coff * HEAD, torch.float32, ratio, f"{p}.compressor.state_cache"))
            if ratio == 4:
                layers.append(DeepseekV4IndexerCache(INDEX_HEAD + 4, torch.uint8, f"{p}.indexer.k_cache", cache, 4))
                layers.append(CompressorStateCache(2 * 2 * INDEX_HEAD, torch.float32, 4,
                                                   f"{p}.indexer.compressor.state_cache"))  # fmt: skip
    for layer in layers:
        specs[layer.prefix] = layer.get_kv_cache_spec(config)
    return specs


def _layout(config, specs) -> None:
    """The layout vLLM's engine core resolves for DeepSeek-V4's backends, recorded on ``config``."""
    from vllm.models.deepseek_v4.compressor import CompressorBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV4IndexerBackend
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    backends = (DeepseekV4IndexerBackend, DeepseekSparseSWABackend, CompressorBackend)
    names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(config, [names], specs.values())


def plan(model: str, *, hca: str, context: int, kv_gib: float = 40.0, mtp: int = 1) -> dict:
    """vLLM's plan of ``kv_gib`` GiB of KV cache for ``model`` under ``install(hca=hca)`` at ``max_model_len =
    context``: the block pool, the C128 state group's spec and blocks per request, the requests admitted."""
    from vllm.models.deepseek_v4.compressor import DeepseekCompressor
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core import kv_cache_utils as utils

    from . import install

    if "_dsv4c_installation" in vars(DeepseekCompressor):
        raise RuntimeError("capacity.plan installs the adapter itself: uninstall() first")
    config = _config(context, mtp)
    with install(hca=hca, vllm_config=config):
        specs = layer_specs(model, config)
    _layout(config, specs)
    groups = planning.get_global_kv_cache_groups(config, [specs])
    (kv_config,) = planning.get_kv_cache_configs(config, [specs], [int(kv_gib * (1 << 30))], groups)
    requests = utils.get_max_concurrency_for_kv_cache_config(config, kv_config)
    c128 = [g for g in kv_config.kv_cache_groups if any(n.endswith(".compressor.state_cache") for n in g.layer_names)
            and _first(g.kv_cache_spec).block_size not in (4,)]  # fmt: skip
    spec = c128[0].kv_cache_spec
    blocks = -(-spec.max_memory_usage_bytes(config) // spec.page_size_bytes)
    return dict(model=model, hca=hca, context=context, mtp=mtp, num_blocks=int(kv_config.num_blocks),
                c128_spec=type(_first(spec)).__name__, c128_blocks_per_request=int(blocks),
                requests=float(requests))  # fmt: skip


def _first(spec):
    return getattr(spec, "first_spec", spec)


def capacity_table(kv_gib: float = 40.0, mtp: int = 1) -> list[dict]:
    """:func:`plan` ring and online for each model and context."""
    rows = []
    for model in MODELS:
        for context in CONTEXTS:
            ring, online = (plan(model, hca=h, context=context, kv_gib=kv_gib, mtp=mtp) for h in ("tiled", "online"))
            rows.append(dict(model=model, context=context, ring=ring, online=online))
    return rows


def format_table(rows: list[dict], kv_gib: float, mtp: int) -> str:
    out = [
        f"vLLM 0.33.0 KV-cache planner, {kv_gib:g} GiB of KV cache per GPU, block size 256, fp8_ds_mla, MTP {mtp}, "
        "8192 batched tokens",
        "",
        "| model | context | blocks in the pool | C128 blocks per request: ring -> online | requests, ring | requests, "
        "online | more |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r, o = row["ring"], row["online"]
        out.append(
            f"| {row['model']} | {row['context'] // 1024}K | {r['num_blocks']:,} | {r['c128_blocks_per_request']} "
            f"-> {o['c128_blocks_per_request']} | {r['requests']:.1f} | {o['requests']:.1f} | "
            f"{100 * (o['requests'] / r['requests'] - 1):+.0f}% |"
        )
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-gib", type=float, default=40.0, help="KV-cache memory per GPU, GiB")
    parser.add_argument("--mtp", type=int, default=1, help="speculative (MTP) tokens per step")
    ns = parser.parse_args(argv)
    with contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115  (vLLM's import-time warnings)
        rows = capacity_table(ns.kv_gib, ns.mtp)
    print(format_table(rows, ns.kv_gib, ns.mtp))


if __name__ == "__main__":
    if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    main()
