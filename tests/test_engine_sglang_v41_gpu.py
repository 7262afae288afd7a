"""SGLang's Blackwell page layouts on a GPU: SGLang 0.5.23's own compressor store against the adapter's, on
SGLang's real pools and identical inputs (marker ``gpu``; skipped without CUDA, and without SGLang: on the GPU
machine the engine kit, ``engine_kit/manifest.json`` from ``scripts/build_engine_kit.sh``, puts it on the path).

Every case runs ``tests/helpers/sglang_store.py`` (the code the CPU tests in ``tests/test_engine_sglang_uniform_fp8.py``
run), here with SGLang's own CUDA pieces: its ``create_paged_compressor_data`` planner and ``compress_forward``,
then its store: ``compress_norm_rope_store(layout=V41 / V41_NEW)`` (``fused_norm_rope_v2``, JIT-built with the
machine's nvcc) or, on the trtllm backend's pool, ``forward_compress_uniform_fp8`` (its Triton
``fused_norm_rope_inplace_triton`` compiled, torch's cast). Ours: the adapter's ``forward_unified`` on a twin pool
(the tiled HCA kernel, SGLang's GEMM output as ``kv_score``).

* ``test_sglangs_store_against_ours``: a decode batch of B = 16 or 256 requests (C128 and C4 group ends, rows
  that close nothing, two padding rows; C4's first group) and, at B = 16, a prefill step: per layer, the records
  that differ between SGLang's pages and ours are counted and printed (``E=1 ...`` lines, which
  ``scripts/gpu_check.sh`` keeps: both sides valid, so at rounding boundaries: SGLang pools with ``__expf`` and
  its own summation order), asserted within 2% of the record bytes; ours pass the float64 checks (SGLang's are
  counted, not asserted); ours write no byte outside the records (pages poisoned first) and leave slot 0 alone.
* ``test_uniform_finish_on_identical_pooled_vectors``: the uniform FP8 finish alone, compiled: SGLang's store and
  the kernels' ``finish_values`` from the same pooled vectors (``compress_forward`` stood in on both sides). Both
  normalize with ``rsqrt.approx`` (``scripts/compile_check.py`` checks ours); what may still differ is the order
  of the sum of squares (Triton's register layout per kernel): counted and printed.

On CPU the module collects, and its tests report the skip.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import engine_kit
from helpers.session import interpreting, record_out

KIT = engine_kit.activate() if importlib.util.find_spec("sglang") is None else None
pytest.importorskip("sglang", reason="SGLang is not importable (no engine_kit/: scripts/build_engine_kit.sh)")
from helpers import sglang_store as ss  # noqa: E402

CUDA = torch.cuda.is_available() and not interpreting()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA and compiled kernels (no TRITON_INTERPRET)")
SETTINGS = dict(chunked_prefill_size=8192, max_running_requests=256)
LAYOUTS = {"V41": "V41", "V41_NEW": "V41_NEW", "UNIFORM_FP8": "V4"}  # SGLang's layout -> the pool's kv_layout


def _report(name: str, counts: dict) -> None:
    line = "; ".join(
        f"c{r}: {c['differing_records']} of {c['records']} records ({c['differing_bytes']} of {c['record_bytes']} "
        f"bytes) differ, SGLang's records {'pass' if c.get('theirs_float64', True) else 'FAIL'} float64, SGLang "
        f"wrote {c['slot0_theirs']} bytes of slot 0 and {c['stray_theirs']} elsewhere"
        for r, c in counts.items()
    )  # fmt: skip
    print(f"{name}: {line}")
    record_out(
        "engine_sglang_v41_gpu.json", name,
        {r: {k: v for k, v in c.items() if not k.endswith("_report")} for r, c in counts.items()},
    )  # fmt: skip


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode, batch", [("decode", 16), ("decode", 256), ("prefill", 16)])
@pytest.mark.parametrize("kv_layout", list(LAYOUTS), ids=str.lower)
def test_sglangs_store_against_ours(kv_layout, mode, batch):
    """See the module docstring."""
    name = ss.LAYOUT_OF[kv_layout]
    trtllm = dict(dsv4_attn_backend="trtllm") if kv_layout == "UNIFORM_FP8" else {}
    with ss.published("cuda", **trtllm, **SETTINGS):
        world = ss.StoreWorld(slots=batch, device="cuda", kv_layout=LAYOUTS[kv_layout], seed=batch)
        assert world.theirs.uniform_fp8 == (kv_layout == "UNIFORM_FP8")
        if mode == "decode":
            step = world.decode(ss.decode_lengths(batch, seed=batch), bs=batch + 2)
        else:
            step = world.prefill([(s, 0 if s % 2 else 250, 136 if s % 2 else 10) for s in range(1, batch + 1)])
        world.poison()
        before = {r: world.state(world.ours, r).clone() for r in ss.LAYERS}
        counts = {}
        for ratio in ss.LAYERS:
            world.theirs_step(step, ratio)
            world.ours_step(step, ratio)
            torch.cuda.synchronize()
            counts[ratio] = world.compare(step, ratio, name, world.entries(step, ratio, before[ratio])[1])
    _report(f"E=1 {name} {mode} B={batch}", counts)
    for ratio, c in counts.items():
        assert c["records"] >= 1, (ratio, c)
        assert c["ours_float64"], c["ours_report"]
        assert c["stray_ours"] == 0 and c["slot0_ours"] == 0, (ratio, c)
        assert c["differing_bytes"] <= c["record_bytes"] // 50, f"c{ratio}: more than rounding: {c}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", [16, 256])
def test_uniform_finish_on_identical_pooled_vectors(batch):
    """See the module docstring."""
    with ss.published("cuda", dsv4_attn_backend="trtllm", **SETTINGS):
        world = ss.StoreWorld(slots=batch, device="cuda", seed=batch + 1)
        step = world.decode(ss.decode_lengths(batch, seed=batch + 1), bs=batch + 2)
        counts = {}
        for ratio in ss.LAYERS:
            pooled = torch.randn(step.tokens, 512, generator=world.gen).to("cuda")
            world.poison()
            world.ours_finish(step, ratio, pooled, "uniform_fp8")
            world.theirs_step(step, ratio, pooled)
            torch.cuda.synchronize()
            assert world.calls["compress_forward"] == len(counts) + 1
            cfg, _ = ss.LAYERS[ratio]
            rows = step.closing(ratio)
            p = ss.reference.params_as(world.params[ratio], torch.float64)
            values = ss.reference.finish_entries(pooled.cpu()[rows].double(), step.positions[rows] + 1 - ratio, p, cfg)
            counts[ratio] = world.compare(step, ratio, "uniform_fp8", values)
    _report(f"E=1 uniform_fp8 finish B={batch}", counts)
    for ratio, c in counts.items():
        assert c["ours_float64"], c["ours_report"]
        assert c["stray_ours"] == 0 and c["slot0_ours"] == 0 and c["stray_theirs"] == 0, (ratio, c)
        assert c["differing_bytes"] <= c["record_bytes"] // 200, f"c{ratio}: more than rounding: {c}"
