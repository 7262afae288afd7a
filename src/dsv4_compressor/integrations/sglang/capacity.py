"""What online HCA gives back in SGLang's own accounting: SGLang 0.5.23's ``DSV4PoolConfigurator`` (the real
class, on CPU) run for DeepSeek-V4-Flash and V4-Pro, with the C128 ring (``install()``) and with online HCA
(``install(hca="online")``), at SGLang's DeepSeek-V4 defaults (256 running requests, one attention-DP rank,
page 256, ``--chunked-prefill-size 8192``) and with EAGLE (SGLang's automatic settings: 3 steps, top-k 1, 4 draft
tokens).

Per row: the C128 state SGLang prices as fixed bytes (``_get_c128_state_fixed_bytes``: the term it subtracts
before it divides by the bytes of one token), its ``bytes_per_full_token``, the KV tokens
``calculate_pool_sizes`` gives for the same budget, and the requests of 8K / 32K tokens those hold. The budget
is the bytes SGLang's ``_profile_available_bytes`` would hand the configurator less what the adapter's backends
allocate (its HCA scratch and projection workspaces, the same in both modes, :func:`.memory.scratch_bytes_for`,
:func:`.memory.projection_bytes_for`); the gain in tokens does not depend on it.

``python -m dsv4_compressor.integrations.sglang.capacity [--available-gib 80]`` prints the table (SGLang
importable with its dependencies; on a CPU machine without torchvision, ``PYTHONPATH=src:tests python -m
helpers.sglang_capacity`` first puts the test suite's stand-in for it in place).
"""

from __future__ import annotations

import argparse
import importlib
import types

from ...config import MODELS

#: hidden size per model (config.json): the projection workspaces' width
HIDDEN = {"DeepSeek-V4-Flash": 4096, "DeepSeek-V4-Pro": 7168}
EAGLE = dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
             speculative_num_draft_tokens=4)  # fmt: skip
CONTEXTS = (8192, 32768)


def compress_ratios(model: str) -> list[int]:
    """A layer list with the model's compressed layers (docs/SPEC.md section 1: V4-Flash 21 CSA, 20 HCA of 43;
    V4-Pro 30 and 31 of 61), the others sliding-window only (ratio 0). The sizing counts layers per ratio; their
    order does not enter it."""
    counts = MODELS[model]
    total = {"DeepSeek-V4-Flash": 43, "DeepSeek-V4-Pro": 61}[model]
    ratios = [4] * counts["csa"] + [128] * counts["hca"]
    return [0] * (total - len(ratios)) + ratios


def pool_capacity(model: str, *, hca: str, speculative: bool, available_bytes: int,
                  max_running_requests: int = 256, chunked_prefill_size: int = 8192) -> dict:  # fmt: skip
    """SGLang's ``DSV4PoolConfigurator`` for ``model`` under ``install(hca=hca)``, its settings published on
    SGLang's runtime context for the call (restored after). Returns the configurator's figures."""
    from . import memory, patching

    ns = types.SimpleNamespace
    server_args_mod = importlib.import_module("sglang.srt.server_args")
    runtime = importlib.import_module("sglang.srt.runtime_context")
    pc = importlib.import_module("sglang.srt.model_executor.pool_configurator")
    spec_info = importlib.import_module("sglang.srt.speculative.spec_info")
    if patching.installed():
        raise RuntimeError("pool_capacity installs the adapter itself: uninstall() first")
    args = server_args_mod.ServerArgs(model_path="dsv4c-capacity", max_running_requests=max_running_requests,
                                      chunked_prefill_size=chunked_prefill_size, page_size=256, device="cpu",
                                      **(EAGLE if speculative else {}))  # fmt: skip
    ctx = runtime.get_context()
    saved = {name: getattr(ctx, name) for name in ("_server_args", "_config_bags")}
    saved_parallel = ctx.parallel._config
    ratios = compress_ratios(model)
    hf = ns(hidden_size=HIDDEN[model], head_dim=512, index_head_dim=128, compress_ratios=ratios,
            kv_source_layer_ids=[])  # fmt: skip
    cfg = ns(qk_nope_head_dim=448, qk_rope_head_dim=64, index_head_dim=128, context_len=1 << 20,
             compress_ratios=ratios, hf_config=hf, hf_text_config=hf, window_size=128)  # fmt: skip
    algo = spec_info.SpeculativeAlgorithm.from_string("EAGLE" if speculative else None)
    kvc = ns(kv_cache_dtype_str="auto", model_config=cfg, spec_algorithm=algo, pp_size=1, pp_group=None,
             layer_info=ns(start_layer=0, end_layer=len(ratios)), sliding_window_size=128, page_size=256,
             attn_dp_size=1, spec_aux_config=None)  # fmt: skip
    ctx.set_server_args(args)
    try:
        patching.install(hca=hca, check_environment=False)
        settings = patching.settings_of(None)
        adapter = memory.scratch_bytes_for(settings) + memory.projection_bytes_for(settings, cfg)
        sizer = pc.DSV4PoolConfigurator(kvc)
        budget = available_bytes - adapter
        config = sizer.calculate_pool_sizes(budget, 256)
        config.max_running_requests = max_running_requests
        config = sizer.finalize_with_max_running_requests(config)
        tokens = int(config.full_max_total_num_tokens)
        return dict(
            model=model, hca=hca, speculative=speculative, ring_rows=int(sizer.ring_sizes[128]),
            c128_state_bytes=int(sizer._get_c128_state_fixed_bytes(max_running_requests)),
            c128_state_pool_rows=int(config.c128_state_pool_size), bytes_per_token=float(sizer.bytes_per_full_token),
            adapter_bytes=int(adapter), tokens=tokens, requests={c: tokens // c for c in CONTEXTS},
        )  # fmt: skip
    finally:
        patching.uninstall()
        for name, value in saved.items():
            setattr(ctx, name, value)
        ctx.parallel._config = saved_parallel


def capacity_table(available_gib: float = 80.0) -> list[dict]:
    """:func:`pool_capacity` ring and online for each model, without and with EAGLE."""
    budget = int(available_gib * (1 << 30))
    rows = []
    for model in MODELS:
        for speculative in (False, True):
            ring, online = (pool_capacity(model, hca=h, speculative=speculative, available_bytes=budget)
                            for h in ("ring", "online"))  # fmt: skip
            rows.append(dict(ring=ring, online=online))
    return rows


def format_table(rows: list[dict], available_gib: float) -> str:
    gib = 1 << 30
    out = [
        f"SGLang 0.5.23 DSV4PoolConfigurator, {available_gib:g} GiB for the pools per GPU (less the adapter's "
        "buffers), 256 running requests, attention DP 1, page 256",
        "",
        "| model | speculation | C128 state: ring | online banks | bytes per token | KV tokens, ring | KV tokens, "
        "online | more tokens | requests at 8K, ring -> online | requests at 32K, ring -> online |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r, o = row["ring"], row["online"]
        spec = "EAGLE (4 draft tokens)" if r["speculative"] else "none"
        out.append(
            f"| {r['model']} | {spec} | {r['c128_state_bytes'] / gib:.3f} GiB ({r['ring_rows']} rows) | "
            f"{o['c128_state_bytes'] / gib:.3f} GiB ({o['ring_rows']} rows) | {r['bytes_per_token']:.1f} | "
            f"{r['tokens']:,} | {o['tokens']:,} | {o['tokens'] - r['tokens']:,} | "
            f"{r['requests'][8192]} -> {o['requests'][8192]} | {r['requests'][32768]} -> {o['requests'][32768]} |"
        )
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--available-gib", type=float, default=80.0, help="bytes SGLang gives its KV pools per GPU")
    ns = parser.parse_args(argv)
    print(format_table(capacity_table(ns.available_gib), ns.available_gib))


if __name__ == "__main__":
    main()
