"""SGLang 0.5.23's trtllm backend (``--dsv4-attn-backend trtllm``): its uniform FP8 pool written by the adapter
byte for byte as SGLang's own store writes it (``make test-sglang``; skipped without SGLang), CPU, interpreter.

What SGLang does (read from its code): under ``--dsv4-attn-backend trtllm`` the pool is ``uniform_fp8``
(``DeepSeekV4UniformFP8KVPool``: 512 e4m3 bytes a token, no scale, pages ``P x 512``; the main layout must be V4) and
``CompressorBackendMixin.forward_unified`` sends a C4 main or C128 compressor to
``compressor_trtllm.forward_compress_uniform_fp8``: ``compress_forward`` (the same float32 pooled vectors as
V4's path), rows that close no group zeroed (decode: ``seq_len % r != 0``; prefill: invalid plan rows, whose
``out_loc`` it sets to 0), ``fused_norm_rope_inplace_triton`` on the float32 rows in place (``tl.rsqrt(sum(x * x) /
512 + eps)``, ``x * inv * w``, rope ``(x cos - y sin, x sin + y cos)`` at ``seq_len - r``, float32 stored: no bf16
step), then the pool's ``set_key_buffer_fused``: ``cache_k.to(float8_e4m3fn)`` scattered at ``out_loc``, so the zeroed
rows land in slot 0 (its dummy slot) as e4m3 zeros. The indexer keeps V4's path and its 132-byte pack.
``fused_k_norm_rope_uniform_fp8`` (the function with a bf16 step) is the pool's store of the *SWA* keys, not the
compressor's.

The tests (every page poisoned first, fresh random data):

* the finish alone (``test_uniform_records_match_sglangs_store``): the kernels' ``finish_values`` against SGLang's
  ``forward_unified`` with ``compress_forward`` handing both the same pooled vectors, at C128's 2-slot and C4's
  64-slot pages, decode and prefill plans: 0 differing records, no byte outside them; SGLang's zeros in slot 0,
  which ours leaves alone;
* the adapter on SGLang's real uniform pool (``test_adapter_writes_sglangs_uniform_pool``): decode and prefill
  steps through ``SGLangCompressor.forward_unified`` against SGLang's store on a twin pool, SGLang's
  ``compress_forward`` handing it our tiled kernel's own pooled C128 vectors (the scratch: 0 differing records) and
  the float32 reference's for C4 (counted); both against float64;
* SGLang's SWA store ``fused_k_norm_rope_uniform_fp8`` writes our records from float32 rows and other bytes from
  bf16 ones (its interpreter casts rounded to nearest even, as the GPU's);
* the settings: trtllm no longer refused, its layers read as ``uniform_fp8``, the FP4 indexer still refused.

The GPU counterpart (SGLang's own ``compress_forward`` and store against ours): ``tests/test_engine_sglang_v41_gpu.py``,
on the same helpers (``tests/helpers/sglang_store.py``).
"""

from __future__ import annotations

import types

import pytest
import test_engine_sglang as tes  # skips the module without SGLang
import torch
from helpers import sglang_store as ss
from helpers.buffers import POISON_BYTE
from helpers.inputs import make_params
from helpers.session import engine_casts_round_to_nearest_even

from dsv4_compressor import layout, reference
from dsv4_compressor.integrations import sglang as sg

kv_norm = pytest.importorskip("sglang.kernels.ops.attention.dsv4.kv_norm_rope_store")
rope_mod = pytest.importorskip("sglang.kernels.ops.attention.dsv4.rope")
clean = tes.clean  # the fixture: uninstall before and after
TRTLLM = dict(chunked_prefill_size=256, max_running_requests=8, dsv4_attn_backend="trtllm")


def _pooled(rows: int, gen: torch.Generator) -> torch.Tensor:
    """Pooled vectors over several magnitudes per row, a few with a tiny or a large part."""
    c = torch.randn(rows, 512, generator=gen) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=gen).float())
    c[0, :256] *= 1e-4
    c[min(1, rows - 1), 448:] *= 50.0
    return c


def _step(world: ss.StoreWorld, mode: str) -> ss.Step:
    if mode == "decode":
        return world.decode(ss.decode_lengths(world.slots, seed=3), bs=world.slots + 2)  # 2 padding rows
    # a first chunk across C128's first group end, a continuation across a later one, one closing nothing
    return world.prefill([(1, 0, 136), (2, 250, 10), (3, 40, 3)])


@pytest.mark.parametrize("ratio", [128, 4], ids=["c128", "c4"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("seed", [0, 1])
def test_uniform_records_match_sglangs_store(ratio, mode, seed):
    """The finish alone (see the module docstring): every closing record equal, nothing else written by us;
    SGLang also writes slot 0, with e4m3 zeros only."""
    with ss.published("cpu", **TRTLLM):
        world = ss.StoreWorld(slots=4, device="cpu", seed=seed)
        assert world.theirs.uniform_fp8 and sg.layer_layout(world.ours, ss.LAYERS[ratio][1]) == "uniform_fp8"
        step = _step(world, mode)
        pooled = _pooled(step.tokens, world.gen)
        world.poison()
        world.ours_finish(step, ratio, pooled, "uniform_fp8")
        world.theirs_step(step, ratio, pooled)
        assert world.calls["compress_forward"] == 1  # SGLang's uniform path ran, on the pooled vectors given
        cfg, _ = ss.LAYERS[ratio]
        starts = step.positions[step.closing(ratio)] + 1 - ratio
        values = reference.finish_entries(pooled[step.closing(ratio)].double(), starts,
                                          reference.params_as(world.params[ratio], torch.float64), cfg)  # fmt: skip
        c = world.compare(step, ratio, "uniform_fp8", values)
    assert c["records"] >= 2, c
    assert c["differing_records"] == 0, c
    assert c["stray_ours"] == 0 and c["stray_theirs"] == 0 and c["slot0_ours"] == 0, c
    assert c["slot0_theirs"] > 0 and set(c["slot0_theirs_values"]) <= {0x00, 0x80}, c  # SGLang's zeroed rows
    assert c["ours_float64"], c["ours_report"]
    # the plain-PyTorch form of SGLang's rounding: the same records but at rounding boundaries (its sum of squares
    # is torch's, the interpreter's numpy's)
    mine = layout.encode_latent(
        reference.finish_entries_sglang_triton(pooled[step.closing(ratio)], starts, world.params[ratio], cfg),
        cfg,
        "uniform_fp8",
    )
    pl = layout.latent_page_layout(cfg, world.page_size(ratio), "uniform_fp8")
    ours = pl.read(world.pages_of(world.ours, ratio), step.out_loc[ratio][step.closing(ratio)])
    assert int((mine != ours).sum()) <= mine.numel() // 200


def test_uniform_values_are_sglangs_float32_bit_for_bit():
    """Before the cast: the float32 values the kernels finish uniform records from (``out_keys``) are the float32
    values SGLang's ``fused_norm_rope_inplace_triton`` leaves in its rows, bit for bit (the records cannot show an
    operation-order change of one ulp: e4m3 keeps 3 mantissa bits); the plain-PyTorch form of SGLang's norm and
    rope (``reference.finish_entries_sglang_triton``) is within a few ulps (its sum of squares is torch's)."""
    from dsv4_compressor.kernels.entry_pack import entry_args, finish_values

    cfg = ss.HCA
    gen = torch.Generator().manual_seed(9)
    p = make_params(cfg, seed=2, max_positions=512)
    c = _pooled(64, gen)
    starts = torch.randint(0, 4, (64,), generator=gen, dtype=torch.int32) * 128
    keys = torch.zeros(64, 512)
    prm, out, meta = entry_args(
        head=512, rope=64, latent=True, page_size=2, scale_bytes=8, norm_weight=p.norm_weight, cos=p.cos, sin=p.sin,
        eps=p.eps, out_pages=torch.zeros(32, 1024, dtype=torch.uint8), out_keys=keys, exact_fp8=True,
        layout="uniform_fp8",
    )  # fmt: skip
    finish_values(c, starts, torch.arange(64, dtype=torch.int32), prm, out, meta)
    theirs = c.clone()
    rope_mod.fused_norm_rope_inplace_triton(theirs, p.norm_weight.float(), p.eps, torch.complex(p.cos, p.sin),
                                            positions=starts.long())  # fmt: skip
    assert torch.equal(keys.view(torch.int32), theirs.view(torch.int32)), int((keys != theirs).sum())
    ref = reference.finish_entries_sglang_triton(c, starts, p, cfg)
    rms = ref.pow(2).mean(dim=1, keepdim=True).sqrt()
    err = (keys - ref).abs() / (ref.abs() + rms)  # rope pairs can cancel: relative to the row's RMS too
    assert float(err.max()) < 2**-21, float(err.max())


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_adapter_writes_sglangs_uniform_pool(mode):
    """The adapter against SGLang's store on its real uniform pool (see the module docstring)."""
    with ss.published("cpu", **TRTLLM):
        world = ss.StoreWorld(slots=4, device="cpu", seed=5)
        step = _step(world, mode)
        world.poison()
        before = {r: world.state(world.ours, r).clone() for r in ss.LAYERS}
        for ratio in ss.LAYERS:
            world.ours_step(step, ratio)
        assert world.adapter._layouts and {v[0] for v in world.adapter._layouts.values()} == {"uniform_fp8"}
        counts = {}
        for ratio in ss.LAYERS:
            if ratio == 128:
                pooled = world.scratch_rows(step)  # our kernel's own pooled vectors
            else:
                pooled = _pooled(step.tokens, world.gen)  # rows that close nothing: SGLang zeroes them
                pooled[step.closing(ratio)] = world.entries(step, ratio, before[ratio], torch.float32)[0].float()
            world.theirs_step(step, ratio, pooled)
            counts[ratio] = world.compare(step, ratio, "uniform_fp8", world.entries(step, ratio, before[ratio])[1])
    print(f"CPU uniform_fp8 {mode}: " + "; ".join(f"c{r}: {c['differing_records']} of {c['records']} records differ"
                                                 for r, c in counts.items()))  # fmt: skip
    for ratio, c in counts.items():
        assert c["records"] >= 1, (ratio, c)
        assert c["ours_float64"], c["ours_report"]
        assert c["theirs_float64"], c["theirs_report"]
        assert c["stray_ours"] == 0 and c["slot0_ours"] == 0 and c["stray_theirs"] == 0, (ratio, c)
    assert counts[128]["differing_records"] == 0, counts[128]  # the same pooled vectors: the same records
    assert counts[4]["differing_bytes"] <= counts[4]["record_bytes"] // 100, counts[4]


@pytest.mark.parametrize("kv_layout", ["V41", "V41_NEW"])
def test_gpu_harness_on_v41_pools(kv_layout):
    """The GPU test's V4.1 cases as far as a CPU runs them (SGLang's V4.1 store is CUDA only): the adapter on a
    decode step of SGLang's real V4.1 pools, every record against float64, nothing written outside the records;
    SGLang's twin pool, not written here, differs in every record."""
    with ss.published("cpu", chunked_prefill_size=256, max_running_requests=8):
        world = ss.StoreWorld(slots=4, device="cpu", kv_layout=kv_layout, seed=7)
        step = world.decode(ss.decode_lengths(world.slots, seed=7), bs=world.slots + 2)
        world.poison()
        before = {r: world.state(world.ours, r).clone() for r in ss.LAYERS}
        for ratio in ss.LAYERS:
            world.ours_step(step, ratio)
            c = world.compare(step, ratio, ss.LAYOUT_OF[kv_layout], world.entries(step, ratio, before[ratio])[1])
            assert c["records"] >= 1 and c["differing_records"] == c["records"], (ratio, c)
            assert c["ours_float64"], c["ours_report"]
            assert c["stray_ours"] == 0 and c["slot0_ours"] == 0 and c["stray_theirs"] == 0, (ratio, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_sglangs_swa_uniform_store(dtype):
    """SGLang's other uniform store, ``fused_k_norm_rope_uniform_fp8`` (its SWA keys): from float32 rows it
    writes the compressor's records (the same Triton norm and rope); from the bf16 rows its SWA path gives it,
    the bf16 rounding of the input and of the result moves bytes."""
    from dsv4_compressor.kernels.entry_pack import entry_args, finish_values

    cfg = ss.HCA
    gen = torch.Generator().manual_seed(4)
    p = make_params(cfg, seed=6, max_positions=512)
    rows = 48
    c = _pooled(rows, gen)
    starts = torch.randint(0, 4, (rows,), generator=gen, dtype=torch.int32) * 128
    slots = torch.randperm(64, generator=gen)[:rows]
    theirs = torch.full((32, 1024), POISON_BYTE, dtype=torch.uint8)
    ours = theirs.clone()
    with engine_casts_round_to_nearest_even():
        kv_norm.fused_k_norm_rope_uniform_fp8(c.to(dtype), p.norm_weight.float(), p.eps,
                                              torch.complex(p.cos, p.sin), starts.long(), slots,
                                              theirs.view(torch.float8_e4m3fn))  # fmt: skip
    prm, out, meta = entry_args(
        head=512, rope=64, latent=True, page_size=2, scale_bytes=8, norm_weight=p.norm_weight, cos=p.cos, sin=p.sin,
        eps=p.eps, out_pages=ours, out_keys=None, exact_fp8=True, layout="uniform_fp8",
    )  # fmt: skip
    finish_values(c.to(dtype).float(), starts, slots.to(torch.int32), prm, out, meta)
    differing = int((theirs != ours).sum())
    if dtype == torch.float32:
        assert differing == 0, f"{differing} bytes differ"
    else:
        assert differing > 0  # its bf16 step: not the compressor's (float32) path


def test_trtllm_is_written_and_what_stays_refused(clean, monkeypatch):
    """``--dsv4-attn-backend trtllm`` is no longer refused from the settings; the backend built on its pool reads
    both compressor layers as ``uniform_fp8`` and the indexer's pages as V4's; the FP4 indexer and
    ``flashmla_mega`` stay refused with the reason."""
    import test_engine_sglang_settings as tess

    monkeypatch.setattr(tes.dsa_utils, "get_parallel", lambda: types.SimpleNamespace(attn_cp_size=1))
    monkeypatch.setattr(tes.backend_mod, "_create_flashmla_metadata", lambda: None)
    with ss.published("cpu", **TRTLLM) as args:
        assert sg.refusals_from_server_args(args) == []
        sg.install(check_environment=False)
        pool = tess._pool([128, 4])
        assert pool.uniform_fp8 and pool.get_extra_key_layout(0).name == "V4"  # SGLang's layout getter says V4
        backend = tes.backend_mod.DeepseekV4AttnBackend(tess._runner(pool, args))
        adapter = tess._adapter(backend)
        assert adapter.check_layouts(pool) == []
        state = lambda backend: types.SimpleNamespace(kv_score_buffer=types.SimpleNamespace(kv_score=None))  # noqa: E731
        main = types.SimpleNamespace(is_in_indexer=False, ratio=128, get_state_pool=state)
        index = types.SimpleNamespace(is_in_indexer=True, ratio=4, get_state_pool=state)
        for layer, page in ((0, 2), (1, 64)):
            got = adapter._buffers(backend, pool, main, layer)
            assert got["layout"] == "uniform_fp8" and got["page_size"] == page
            assert got["out_pages"].shape[-1] == page * 512
        got = adapter._buffers(backend, pool, index, 1)
        assert "layout" not in got and got["page_size"] == 64 and got["out_pages"].shape[-1] == 8448
        with pytest.raises(sg.SGLangUnsupported, match="FP4 indexer"):
            sg._refuse_unsupported(types.SimpleNamespace(enable_deepseek_v4_fp4_indexer=True), pool, index, 1)
    mega = dict(TRTLLM, dsv4_attn_backend="flashmla_mega")
    with ss.published("cpu", **mega):
        assert any("flashmla_mega" in r for r in sg.refusals_from_server_args(None))
