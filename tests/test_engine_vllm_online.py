"""Online HCA in vLLM (``install(hca="online")``, ``VLLM_DSV4C=online``) against the real vLLM 0.33.0 package.

Skips without vLLM; runs on CPU (Triton under the interpreter), in ``.venv-vllm``. What it holds the adapter to:

* the C128 state's spec is vLLM's own ``CircularBufferSpec`` (the class itself, not a subclass), one block of
  ``mtp_step + 1`` banks per request, and vLLM's ``CompressorMetadataBuilder`` takes it;
* a program of chunked prefill, MTP verify with rejected drafts, decode and the runners' paddings through vLLM's
  ``DeepseekCompressor``, builder, ``BlockTable`` and cache views (the banks a strided view into padded blocks,
  as block-outermost layouts give them) writes the entries our ring path writes (which
  ``test_engine_vllm.py`` holds byte-identical to vLLM's own forward), but at the online kernel's rounding
  boundaries (counted, bounded), and banks that hold the float64 partial group;
* a mode it cannot serve is refused at install, nothing patched;
* the capacity figures are vLLM's planner's (``get_kv_cache_configs``, ``get_max_concurrency_for_kv_cache_config``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

compressor = pytest.importorskip("vllm.models.deepseek_v4.compressor", reason="vLLM 0.33 is not installed")

from test_engine_vllm import (  # noqa: E402  (the real-vLLM harness: one layer as vLLM's runner holds it)
    FWD_PROGRAMS,
    MTP,
    POISON_STATE,
    ForwardRun,
    _fwd_config,
    _fwd_rows,
    vllm_on_cpu,  # noqa: F401  (fixture)
)
from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowMLASpec  # noqa: E402

import dsv4_compressor as dc  # noqa: E402
from dsv4_compressor import reference as ref  # noqa: E402
from dsv4_compressor.errors import EngineModeNotSupported  # noqa: E402
from dsv4_compressor.integrations import vllm as dsv4_vllm  # noqa: E402
from dsv4_compressor.integrations.vllm import capacity  # noqa: E402

HEAD, BANKS = 512, MTP + 1
#: floats between two blocks of the bank group beyond the banks (the other groups' pages of a packed block)
BLOCK_PAD = 1000


def _hybrid(config):
    """A config as vLLM resolves it for DeepSeek-V4 (hybrid KV-cache manager on: its groups are hybrid)."""
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def _state_caches(config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        c128 = compressor.CompressorStateCache(2 * HEAD, torch.float32, 128, prefix="layers.1.c128_state")
        c4 = compressor.CompressorStateCache(4 * HEAD, torch.float32, 4, prefix="layers.0.c4_state")
    return c128, c4


def test_the_c128_spec_is_vllms_circular_buffer_spec():
    """Under ``install(hca="online")`` a C128 ``CompressorStateCache`` declares ``CircularBufferSpec`` itself, a
    page of exactly ``mtp_step + 1`` banks of ``3 x H`` float32; the C4 state keeps vLLM's sliding-window spec;
    vLLM's builder takes the bank spec (its own asserts a sliding window) with a planner of no window;
    ``uninstall()`` gives vLLM its spec back."""
    config = _hybrid(_fwd_config())
    c128, c4 = _state_caches(config)
    assert type(c128.get_kv_cache_spec(config)) is SlidingWindowMLASpec
    with dsv4_vllm.install(hca="online"):
        spec = c128.get_kv_cache_spec(config)
        assert type(spec) is CircularBufferSpec
        assert spec.block_size == BANKS and spec.head_size == 3 * HEAD and spec.dtype == torch.float32
        assert spec.page_size_bytes == dc.CompressorConfig.hca().online_bank_bytes(MTP) == 24576
        assert spec.max_num_blocks_per_req(config, 1 << 20) == 1 and not spec.prefix_cacheable
        assert not spec.uses_slot_mapping
        assert type(c4.get_kv_cache_spec(config)) is SlidingWindowMLASpec
        builder = compressor.CompressorMetadataBuilder(spec, [c128.prefix], config, torch.device("cpu"))
        planner = builder._dsv4c_planner
        assert planner.window is None and planner.read_rows is None and planner.mtp_step == MTP
        # the sliding-window spec of a state built for the ring is refused there, before any forward
        ring_spec = compressor.CompressorStateCache.get_kv_cache_spec.__wrapped__(c128, config)
        with pytest.raises(dsv4_vllm.VllmModeNotSupported, match="sliding_window=128"):
            compressor.CompressorMetadataBuilder(ring_spec, [c128.prefix], config, torch.device("cpu"))
    assert type(c128.get_kv_cache_spec(config)) is SlidingWindowMLASpec


def _patched():
    return (compressor.DeepseekCompressor.forward, compressor.CompressorMetadataBuilder.__init__,
            compressor.CompressorStateCache.get_kv_cache_spec)  # fmt: skip


@pytest.mark.parametrize("case", ["block_size", "hybrid_off", "no_circular_buffer_spec"])
def test_a_mode_vllm_cannot_serve_is_refused_at_install(case, monkeypatch):
    """``install(hca="online")`` refuses, with the reason, a KV block size that is not a multiple of 128, the
    hybrid KV-cache manager off, a vLLM without ``CircularBufferSpec``: ``VllmModeNotSupported`` (an
    ``EngineModeNotSupported``), nothing patched. Where vLLM asks a state cache for its spec the same config
    is refused too."""
    config = _hybrid(_fwd_config())
    match = {"block_size": "block size 64 is not a multiple of 128", "hybrid_off": "hybrid KV-cache manager",
             "no_circular_buffer_spec": "no CircularBufferSpec"}[case]  # fmt: skip
    if case == "block_size":
        config.cache_config.block_size = 64
    elif case == "hybrid_off":
        config.scheduler_config.disable_hybrid_kv_cache_manager = True
    else:
        monkeypatch.setattr(dsv4_vllm.online, "circular_buffer_spec_cls", lambda: None)
    before = _patched()
    with pytest.raises(dsv4_vllm.VllmModeNotSupported, match=match) as err:
        dsv4_vllm.install(hca="online", vllm_config=config)
    assert isinstance(err.value, EngineModeNotSupported) and "hca='online'" in str(err.value)
    assert _patched() == before and "_dsv4c_installation" not in vars(compressor.DeepseekCompressor)
    if case != "no_circular_buffer_spec":
        c128, _ = _state_caches(config)
        with dsv4_vllm.install(hca="online"):
            with pytest.raises(dsv4_vllm.VllmModeNotSupported, match=match):
                c128.get_kv_cache_spec(config)
        with dsv4_vllm.install(hca="online", vllm_config=_hybrid(_fwd_config())):  # a config it serves
            assert _patched() != before
    assert _patched() == before


def test_the_switch_installs_online(monkeypatch):
    """``VLLM_DSV4C=online`` (vLLM's plugin entry point, :func:`register`) installs ``hca="online"`` on the real
    classes."""
    monkeypatch.delenv(dsv4_vllm.ENV_VAR_ALIAS, raising=False)
    monkeypatch.setenv(dsv4_vllm.ENV_VAR, "online")
    installation = dsv4_vllm.register()
    try:
        assert installation.hca == "online" and installation.state_cache_cls is compressor.CompressorStateCache
    finally:
        installation.uninstall()
    assert type(_state_caches(_hybrid(_fwd_config()))[0].get_kv_cache_spec(_fwd_config())) is SlidingWindowMLASpec


# ---------------------------------------------------------------------------------------------------------------
# The program through vLLM's classes: online against the ring path
# ---------------------------------------------------------------------------------------------------------------
class OnlineRun(ForwardRun):
    """:class:`test_engine_vllm.ForwardRun` of an HCA layer built under ``install(hca="online")``: its state
    group is the ``CircularBufferSpec`` group, one block per request for its lifetime, no slot mapping (the
    worker's PAD for a spec with ``uses_slot_mapping`` off), and the cache view strides its blocks by the bank
    page plus :data:`BLOCK_PAD` floats, as a block-outermost layout packs the other groups' pages between."""

    def __init__(self):
        import test_engine_vllm
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        original = test_engine_vllm._fwd_config
        test_engine_vllm._fwd_config = lambda *args: _hybrid(original(*args))  # vLLM's DeepSeek-V4 resolution
        try:
            super().__init__("hca", ours=True)
        finally:
            test_engine_vllm._fwd_config = original
        state = self.module.state_cache
        spec = state.get_kv_cache_spec(self.config)
        assert type(spec) is CircularBufferSpec and self.state_bs == BANKS
        blocks = self.state_raw.numel() // (spec.page_size_bytes + 4 * BLOCK_PAD) or 8
        stride = spec.page_size_bytes + 4 * BLOCK_PAD
        pattern = torch.tensor([POISON_STATE], dtype=torch.int32).view(torch.uint8)
        self.state_raw = pattern.repeat(blocks * stride // 4).view(torch.int8)
        tensor = KVCacheTensor(size=self.state_raw.numel(), layers=["layer"], layer_stride=blocks * stride,
                               block_stride=stride)  # fmt: skip
        (view,) = create_kv_cache_views(self.state_raw, spec, blocks, KVCacheLayout.LBNHC, tensor)
        state.bind_kv_cache(view)
        assert state.kv_cache.shape == (blocks, BANKS, 3 * HEAD) and state.kv_cache.stride(0) == stride // 4
        compute = self.state_table.compute_slot_mapping

        def no_slot_mapping(*args, **kwargs):
            compute(*args, **kwargs)
            self.state_table.slot_mapping.gpu.fill_(-1)

        self.state_table.compute_slot_mapping = no_slot_mapping
        self.rows: dict[str, torch.Tensor] = {}

    def _schedule(self, rid: str, start: int, end: int) -> tuple[list, list]:
        state, kv = self.blocks.setdefault(rid, ([], []))
        if not state:  # CircularBufferManager: one block for the request's lifetime
            state.append(self.next_block[0])
            self.next_block[0] += 1
        while len(kv) * 256 < end:
            kv.append(self.next_block[1])
            self.next_block[1] += 1
        return state, kv

    def step(self, padding, items, rows: torch.Tensor) -> None:
        super().step(padding, items, rows)
        row = 0
        for rid, start, n in items:
            self.rows[rid] = torch.cat([self.rows.get(rid, rows[:0])[:start], rows[row : row + n]])
            row += n

    def banks(self) -> torch.Tensor:
        return dsv4_vllm.online_bank_view(self.module.state_cache.kv_cache, BANKS, HEAD)


def _check_banks(run: OnlineRun) -> int:
    """The bank of each request's length, when mid-group: ``a / s`` the float64 pooled value of the partial
    group (gate logits ``score + ape``), ``m`` its exact float32 maximum. Returns the banks checked."""
    ape = run.module.ape.detach().view(128, HEAD)
    checked = 0
    for rid, rows in run.rows.items():
        length = rows.shape[0]
        g0 = length // 128 * 128
        if length == g0:
            continue
        block = run.blocks[rid][0][0]
        m, s, a = run.banks()[block, length % BANKS].double()
        part = rows[g0:length]
        gate32 = part[:, HEAD:] + ape[torch.arange(g0, length) % 128]
        want = ref.pool_windows(part[None, :, :HEAD].double(), gate32[None].double())[0]
        assert torch.allclose(a / s, want, rtol=1e-5, atol=1e-6), (rid, length, (a / s - want).abs().max())
        assert torch.equal(m.float(), gate32.max(dim=0).values), (rid, length)
        checked += 1
    return checked


#: ``FWD_PROGRAMS["hca"]`` and then a third request joining mid-run, verify steps with rejections, a decode
PROGRAM = FWD_PROGRAMS["hca"] + [
    ("piecewise", [("A", 131, 4), ("C", 0, 60)]),
    (None, [("C", 60, 70), ("B", 131, 4)]),  # C closes its group 0
    ("full", [("B", 133, 4), ("C", 130, 1), ("A", 132, 4)]),  # B rejected 2 drafts, A 3
]


@pytest.mark.usefixtures("vllm_on_cpu")
def test_online_program_writes_the_ring_paths_entries(monkeypatch):
    """:data:`PROGRAM` (chunked prefill, MTP verify after rejected drafts, decode, a request joining, FULL and
    piecewise paddings) through the real classes with our ring path and with online HCA: after every step the
    same compressed slots are written and their records equal but at the online kernel's rounding boundaries (it
    sums a group in another order: counted, at most 2% of the bytes), no other k cache byte differs, and the
    banks hold the float64 partial group. The bank cache's null block, unused blocks and the padding between
    blocks are never written."""
    import test_engine_vllm

    monkeypatch.setitem(test_engine_vllm.FWD_KINDS, "hca", (128, 512, 584, 64, 4))  # the ring's blocks for C
    with dsv4_vllm.install():
        ring = ForwardRun("hca", ours=True)
    with dsv4_vllm.install(hca="online"):
        online = OnlineRun()
    gen = torch.Generator().manual_seed(11)
    checked = 0
    for k, (padding, items) in enumerate(PROGRAM):
        rows = _fwd_rows("hca", padding, items, gen)
        with dsv4_vllm.install():
            ring.step(padding, items, rows)
        with dsv4_vllm.install(hca="online"):
            online.step(padding, items, rows)
        assert online.closed == ring.closed
        differ = int((ring.k_raw != online.k_raw).sum())
        assert differ <= len(ring.closed) * 584 // 50, f"step {k}: {differ} k cache bytes differ"
        checked += _check_banks(online)
    assert len(ring.closed) == 3 and checked >= 10
    print(f"online vs ring HCA in vLLM: {len(ring.closed)} records, {differ} of {len(ring.closed) * 584} bytes differ")
    written = (online.state_raw.view(torch.int32) != POISON_STATE).view(-1, online.banks().stride(0))
    used = sorted(b for state, _ in online.blocks.values() for b in state)
    assert not written[:, BANKS * 3 * HEAD :].any(), "the padding between blocks was written"
    assert not written[[b for b in range(written.shape[0]) if b not in used]].any(), "a block no request holds"


# ---------------------------------------------------------------------------------------------------------------
# Capacity in vLLM's own planner
# ---------------------------------------------------------------------------------------------------------------
def test_the_capacity_figures_are_vllms_planners(monkeypatch):
    """:mod:`.capacity` plans with vLLM's ``get_global_kv_cache_groups`` / ``get_kv_cache_configs`` and counts
    requests with its ``get_max_concurrency_for_kv_cache_config``: the C128 group is a ``CircularBufferSpec``
    group of one block per request in the online plan, a sliding-window group in the ring plan, and online
    admits more requests at 8K and 32K for both models."""
    import vllm.v1.core.kv_cache_planning as planning
    import vllm.v1.core.kv_cache_utils as utils

    calls = []
    for module, name in ((planning, "get_kv_cache_configs"), (utils, "get_max_concurrency_for_kv_cache_config")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    ring = capacity.plan("DeepSeek-V4-Flash", hca="tiled", context=8192, kv_gib=40)
    online = capacity.plan("DeepSeek-V4-Flash", hca="online", context=8192, kv_gib=40)
    assert calls.count("get_kv_cache_configs") == 2 and calls.count("get_max_concurrency_for_kv_cache_config") == 2
    assert ring["c128_spec"] == "SlidingWindowMLASpec" and online["c128_spec"] == "CircularBufferSpec"
    assert online["c128_blocks_per_request"] == 1 < ring["c128_blocks_per_request"]
    assert online["num_blocks"] == ring["num_blocks"] > 0  # the same pool: a request needs fewer of its blocks
    assert online["requests"] > 1.3 * ring["requests"] > 0
    rows = capacity.capacity_table(kv_gib=40)
    assert {r["model"] for r in rows} == {"DeepSeek-V4-Flash", "DeepSeek-V4-Pro"}
    for r in rows:
        assert r["online"]["requests"] > r["ring"]["requests"] > 0, r
