"""LightLLM's KV cache sizing, and the tokens a GPU admits more with online HCA than with the C128 ring
(``python -m helpers.lightllm_sim capacity`` from ``tests/`` prints the table of docs/INTEGRATION.md).
"""

from __future__ import annotations

import json
import os

from .objects import DSV4_C4_STATE_RING, DSV4_C128_STATE_RING, DSV4_SWA_PAGE_SIZE, DeepseekV4MemoryManager
from .spawn import as_lightllm

#: LightLLM's sizing constants (deepseek4_mem_manager.py L22, L27, L41) and defaults (api_cli.py: --mem_fraction
#: 0.8, --running_max_req_size 256, --graph_max_batch_size 256, --mtp_step 0; api_start.py L268-269:
#: batch_max_tokens 16384 // dp with chunked prefill).
DSV4_MLA_BYTES_PER_TOKEN = 584
DSV4_INDEXER_BYTES_PER_TOKEN = 132
DSV4_SWA_FULL_TOKENS_RATIO = 0.1
LIGHTLLM_DEFAULTS = dict(running_max_req_size=256, graph_max_batch_size=256, batch_max_tokens=16384, mtp_step=0,
                         mem_fraction=0.8)  # fmt: skip
#: DeepSeek-V4 layers (docs/SPEC.md section 1): all layers, the C4 (CSA) and the C128 (HCA) ones.
MODEL_LAYERS = {"DeepSeek-V4-Flash": (43, 21, 20), "DeepSeek-V4-Pro": (61, 30, 31)}


def lightllm_cell_size(layer_num: int, n_c4: int, c4_state_ring: int, n_c128: int, head_dim: int = 512,
                       indexer_head_dim: int = 128) -> float:  # fmt: skip
    """LightLLM's bytes per full token slot (``DeepseekV4MemoryManager.get_cell_size``, L478-487): the SWA slot
    (every layer's 584-byte record and the C4 states' ring share) times the SWA ratio 0.1, plus a C4 entry and
    indexer pack every 4 tokens per C4 layer and a C128 entry every 128 tokens per C128 layer."""
    c4_state_width = 4 * head_dim + 4 * indexer_head_dim
    c4_state_bytes = c4_state_ring / DSV4_SWA_PAGE_SIZE * c4_state_width * 4 * n_c4
    swa_slot = DSV4_MLA_BYTES_PER_TOKEN * layer_num + c4_state_bytes
    compressed = (DSV4_MLA_BYTES_PER_TOKEN + DSV4_INDEXER_BYTES_PER_TOKEN) * n_c4 / 4
    compressed += DSV4_MLA_BYTES_PER_TOKEN * n_c128 / DSV4_C128_STATE_RING
    return swa_slot * DSV4_SWA_FULL_TOKENS_RATIO + compressed


def bare_memory_manager(cls, *, layer_num: int, n_c4: int, n_c128: int, max_request_num: int, mtp_step: int,
                        head_dim: int = 512):  # fmt: skip
    """A memory manager of class ``cls`` with the fields LightLLM's ``__init__`` sets before it sizes its fixed
    buffers (mem manager L433-460), and no buffers: what ``get_fixed_memory_size`` sees in ``profile_size``."""
    mm = object.__new__(cls)
    rates = [0] * (layer_num - n_c4 - n_c128) + [4] * n_c4 + [128] * n_c128
    mm.__dict__.update(
        compress_rates=rates, n_c4=n_c4, n_c128=n_c128, max_request_num=max_request_num, head_dim=head_dim,
        c4_state_ring=DSV4_C4_STATE_RING + mtp_step,
        c128_state_ring=-(-(DSV4_C128_STATE_RING + mtp_step) // 4) * 4, layer_num=layer_num, online_hca=False,
    )  # fmt: skip
    return mm


def capacity_report(adapter, *, models=MODEL_LAYERS, mtp_steps=(0, 3), **overrides) -> list[dict]:
    """Tokens a LightLLM GPU admits more with online HCA than with the C128 ring, from LightLLM's own sizing
    (``MemoryManager.profile_size``, mem_manager.py L64-89: ``size = (available - get_fixed_memory_size()) /
    get_cell_size()``), so the difference is ``(fixed_ring - fixed_online) / cell``, whatever memory the weights
    leave. ``fixed`` is what the adapter's ``install`` makes ``get_fixed_memory_size`` return, on this module's
    memory manager registered as LightLLM's (:func:`as_lightllm`), with LightLLM's start arguments at their
    defaults (:data:`LIGHTLLM_DEFAULTS`, ``overrides`` replace them); ``lightllm_fixed`` is LightLLM's own (the
    ring alone). With MTP (``mtp_step > 0``, ``--mtp_mode eagle_with_att``) LightLLM adds one SWA layer for the
    draft model (``get_added_mtp_kv_layer_num``, envs_utils.py L292-300)."""
    settings = {**LIGHTLLM_DEFAULTS, **overrides}
    saved_args = os.environ.get(adapter.START_ARGS_ENV)
    try:
        with as_lightllm():
            return [_capacity_row(adapter, model, *layers, mtp, settings) for model, layers in models.items()
                    for mtp in mtp_steps]  # fmt: skip
    finally:
        if saved_args is None:
            os.environ.pop(adapter.START_ARGS_ENV, None)
        else:
            os.environ[adapter.START_ARGS_ENV] = saved_args


def _capacity_row(adapter, model: str, layers: int, n_c4: int, n_c128: int, mtp: int, settings: dict) -> dict:
    off = dict.fromkeys(("disable_cudagraph", "diverse_mode", "enable_decode_microbatch_overlap",
                         "enable_prefill_microbatch_overlap"), False)  # fmt: skip
    os.environ[adapter.START_ARGS_ENV] = json.dumps(dict(settings, mtp_step=mtp, **off))
    layer_num = layers + (1 if mtp else 0)
    requests = settings["running_max_req_size"]
    mm = bare_memory_manager(DeepseekV4MemoryManager, layer_num=layer_num, n_c4=n_c4, n_c128=n_c128,
                             max_request_num=requests, mtp_step=mtp)  # fmt: skip
    own = DeepseekV4MemoryManager.get_fixed_memory_size(mm)
    fixed = {}
    for mode in ("ring", "online"):
        adapter.install(online_hca=mode == "online")
        fixed[mode] = DeepseekV4MemoryManager.get_fixed_memory_size(mm)
        adapter.uninstall()
    cell = lightllm_cell_size(layer_num, n_c4, mm.c4_state_ring, n_c128)
    return dict(model=model, mtp_step=mtp, max_request_num=requests, layer_num=layer_num, cell_bytes=cell,
                lightllm_fixed=own, ring_fixed=fixed["ring"], online_fixed=fixed["online"],
                extra_tokens=int((fixed["ring"] - fixed["online"]) // cell))  # fmt: skip


def capacity_table(rows: list[dict], contexts=(8192, 32768, 131072)) -> str:
    """The rows of :func:`capacity_report` as a Markdown table (GiB of fixed buffers, tokens and requests more)."""
    gib = 2**30
    more = " | ".join(f"more requests at {c // 1024}K" for c in contexts)
    head = ("| model | mtp_step | LightLLM fixed (ring) | adapter, ring | adapter, online | bytes per token | "
            f"more tokens per GPU | {more} |")  # fmt: skip
    lines = [head, "|" + "---|" * (7 + len(contexts))]
    for r in rows:
        more = " | ".join(f"{r['extra_tokens'] / c:.1f}" for c in contexts)
        lines.append(f"| {r['model']} | {r['mtp_step']} | {r['lightllm_fixed'] / gib:.3f} GiB | "
                     f"{r['ring_fixed'] / gib:.3f} GiB | {r['online_fixed'] / gib:.3f} GiB | {r['cell_bytes']:.1f} | "
                     f"{r['extra_tokens']:,} | {more} |")  # fmt: skip
    return "\n".join(lines)
