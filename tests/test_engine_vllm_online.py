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
from dsv4_compressor.layout import latent_page_layout  # noqa: E402
from dsv4_compressor.verify import check_latent_records  # noqa: E402

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
    page plus :data:`BLOCK_PAD` floats, as a block-outermost layout packs the other groups' pages between. On
    ``device`` (``tests/test_engine_vllm_gpu.py`` runs it on CUDA); the rows it keeps per request stay on CPU."""

    def __init__(self, device: str = "cpu"):
        import test_engine_vllm
        from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        original = test_engine_vllm._fwd_config
        test_engine_vllm._fwd_config = lambda *args: _hybrid(original(*args))  # vLLM's DeepSeek-V4 resolution
        try:
            super().__init__("hca", ours=True, device=device)
        finally:
            test_engine_vllm._fwd_config = original
        state = self.module.state_cache
        spec = state.get_kv_cache_spec(self.config)
        assert type(spec) is CircularBufferSpec and self.state_bs == BANKS
        blocks = self.state_raw.numel() // (spec.page_size_bytes + 4 * BLOCK_PAD) or 8
        stride = spec.page_size_bytes + 4 * BLOCK_PAD
        pattern = torch.tensor([POISON_STATE], dtype=torch.int32).view(torch.uint8)
        self.state_raw = pattern.repeat(blocks * stride // 4).view(torch.int8).to(device)
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
            self.rows[rid] = torch.cat([self.rows.get(rid, rows[:0])[:start], rows[row : row + n]]).cpu()
            row += n

    def banks(self) -> torch.Tensor:
        return dsv4_vllm.online_bank_view(self.module.state_cache.kv_cache, BANKS, HEAD)

    def records(self, rid: str) -> torch.Tensor:
        """The records of ``rid``'s closed groups, read where vLLM's compressed slot mapping puts them (2 per
        256-token block of the k cache group), on CPU."""
        kv, per = self.blocks[rid][1], self.entries
        groups = self.rows[rid].shape[0] // 128
        slots = torch.tensor([kv[g // per] * per + g % per for g in range(groups)], dtype=torch.int64)
        pages = self.k_raw.view(torch.uint8).cpu().view(-1, self.k_page)
        return latent_page_layout(HCA, per).read(pages, slots)


def _check_banks(run: OnlineRun) -> int:
    """The bank of each request's length, when mid-group: ``a / s`` the float64 pooled value of the partial
    group (gate logits ``score + ape``), ``m`` its exact float32 maximum. Returns the banks checked."""
    ape = run.module.ape.detach().view(128, HEAD).cpu()
    checked = 0
    for rid, rows in run.rows.items():
        length = rows.shape[0]
        g0 = length // 128 * 128
        if length == g0:
            continue
        block = run.blocks[rid][0][0]
        m, s, a = run.banks()[block, length % run.banks().shape[1]].double().cpu()
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
# The layer in vLLM's own pool: its planner's layout, its allocator, its KV-cache manager's blocks
# ---------------------------------------------------------------------------------------------------------------
SWA_PREFIX = "model.layers.0.attn.swa_cache"
HCA = dc.CompressorConfig.hca()


def pool_config(*args, mtp: int = MTP, engine: str | None = None):
    """``_fwd_config(*args)`` as vLLM resolves it for DeepSeek-V4 (hybrid KV-cache manager on) with ``mtp``
    speculative tokens (DeepSeek-V4's MTP, as :mod:`.capacity` stands it in, plus the draft fields NIXL's
    compatibility hash reads) and, given an ``engine`` id, a NIXL ``kv_transfer_config`` (``kv_both``, host
    buffers: a CPU platform's). Stood in: the model config's fields vLLM's planner and NIXL read."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig

    config = _hybrid(_fwd_config(*args))
    config.speculative_config = None
    if mtp:
        config.speculative_config = capacity._mtp(mtp)
        config.speculative_config.draft_model_config = SimpleNamespace(
            hf_config=SimpleNamespace(), model="deepseek-ai/DeepSeek-V4-Flash", revision=None, code_revision=None
        )
        config.speculative_config.kv_cache_dtype = None
    model = config.model_config
    model.original_max_model_len, model.supports_kv_cache_grouping = model.max_model_len, False
    model.use_mla, model.enable_sleep_mode, model.model = True, False, "deepseek-ai/DeepSeek-V4-Flash"
    model.dtype, model.get_head_size = torch.bfloat16, lambda: HEAD
    model.get_total_num_kv_heads = model.get_total_num_hidden_layers = lambda: 1
    if engine is not None:
        config.kv_transfer_config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both",
                                                     kv_buffer_device="cpu", engine_id=engine)  # fmt: skip
    return config


class PooledRun(ForwardRun):
    """:class:`test_engine_vllm.ForwardRun` of an HCA layer built under ``install(hca="online")`` whose caches
    and blocks are vLLM's: the layer's KV-cache specs (its k cache's ``MLAAttentionSpec``, the bank group's
    ``CircularBufferSpec``, and a sliding-window layer's ``DeepseekV4SWACache`` as a third group), the layout
    vLLM resolves for V4's backends (block-outermost, every group's page at the start of its block: the groups
    overlay), ``get_kv_cache_configs`` for a pool of ``num_blocks``, ``allocate_kv_cache`` (poisoned: NaN
    words), and every block from vLLM's ``KVCacheManager`` (the scheduler's config, prefix caching on) for
    ``vllm.v1.request.Request`` objects with block hashes. ``blocks[rid]``: the request's ``(bank block, k cache
    blocks)``, as the manager gave them."""

    def __init__(self, *, mtp: int = MTP, num_blocks: int = 24, engine: str | None = None):
        import test_engine_vllm
        from vllm.config import set_current_vllm_config
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache
        from vllm.v1.core import kv_cache_planning as planning
        from vllm.v1.core import kv_cache_utils as utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode
        from vllm.v1.worker.utils import allocate_kv_cache

        original = test_engine_vllm._fwd_config
        test_engine_vllm._fwd_config = lambda *args: pool_config(*args, mtp=mtp, engine=engine)
        try:
            with dsv4_vllm.install(hca="online"):
                super().__init__("hca", ours=True)
                state, config = self.module.state_cache, self.config
                self.bank_spec = state.get_kv_cache_spec(config)
        finally:
            test_engine_vllm._fwd_config = original
        self.mtp, self.nbanks = mtp, self.bank_spec.block_size
        k_spec = MLAAttentionSpec(  # DeepseekV4MLAAttention.get_kv_cache_spec (fp8_ds_mla), as ForwardRun's
            block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=HEAD, dtype=torch.uint8, tokens_per_state=128,
            cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
            kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"), state_content_bytes=584,
        )  # fmt: skip
        with set_current_vllm_config(config):
            swa = DeepseekV4SWACache(HEAD, 128, torch.uint8, SWA_PREFIX, config.cache_config)
        specs = {self.k_prefix: k_spec, state.prefix: self.bank_spec, SWA_PREFIX: swa.get_kv_cache_spec(config)}
        capacity._layout(config, specs)
        groups = planning.get_global_kv_cache_groups(config, [specs])
        self.row = max(spec.page_size_bytes for spec in specs.values())  # a block: the groups' pages overlay
        (self.kv_config,) = planning.get_kv_cache_configs(config, [specs], [num_blocks * self.row], groups)
        tensors = self.kv_config.kv_cache_tensors
        assert self.kv_config.num_blocks == num_blocks and {t.block_stride for t in tensors} == {self.row}
        layout = config.cache_config.get_resolved_kv_cache_layout()
        self.caches = allocate_kv_cache(self.kv_config, torch.device("cpu"), layout)
        raw = torch.empty(0, dtype=torch.int32).set_(self.caches[state.prefix].untyped_storage())
        raw.fill_(POISON_STATE)
        state.bind_kv_cache(self.caches[state.prefix])
        k_view = self.caches[self.k_prefix].squeeze(1)
        config.compilation_config.static_forward_context[self.k_prefix].kv_cache = k_view
        self.pages = torch.as_strided(k_view, (num_blocks, 1728), (k_view.stride(0), 1))  # [P x 576][P x 8], padded
        # the scheduler's side
        self.group_of = {name: g for g, grp in enumerate(self.kv_config.kv_cache_groups) for name in grp.layer_names}
        register_all_kvcache_specs(config)
        self.scheduler_kv_config = utils.generate_scheduler_kv_cache_config([self.kv_config])
        block, hash_block = utils.resolve_kv_cache_block_sizes(self.kv_config, config)
        self.manager = KVCacheManager(
            self.scheduler_kv_config, max_model_len=config.model_config.max_model_len, scheduler_block_size=block,
            hash_block_size=hash_block, enable_caching=True,
        )  # fmt: skip
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        utils.init_none_hash(hash_fn)
        self.block_hasher = utils.get_request_block_hasher(hash_block, hash_fn, 0)
        compute = self.state_table.compute_slot_mapping

        def no_slot_mapping(*args, **kwargs):  # the worker's PAD for a spec with uses_slot_mapping off
            compute(*args, **kwargs)
            self.state_table.slot_mapping.gpu.fill_(-1)

        self.state_table.compute_slot_mapping = no_slot_mapping
        self.requests: dict = {}
        self.hits: dict = {}
        self.rows: dict[str, torch.Tensor] = {}
        self.claimed: dict[str, int] = {}  # rid -> its bank block, poisoned when vLLM handed it out
        self.stale: dict[int, torch.Tensor] = {}  # bank block -> its banks as vLLM handed it out

    # -- the scheduler's side -----------------------------------------------------------------------------------
    def admit(self, rid: str, tokens: list[int], kv_transfer_params=None):
        """A new ``Request`` and vLLM's prefix-cache lookup for it (``get_computed_blocks``); returns
        ``(hit blocks, hit tokens)``."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        req = Request(rid, list(tokens), SamplingParams(max_tokens=1), None, block_hasher=self.block_hasher)
        req.kv_transfer_params = kv_transfer_params
        self.requests[rid] = req
        hit, tokens_hit, _ = self.manager.get_computed_blocks(req)
        self.hits[rid] = (hit, tokens_hit)
        return hit, tokens_hit

    def block_ids(self, rid: str) -> tuple[list, list]:
        """``(bank group's blocks, k cache group's blocks)`` the manager gave ``rid``."""
        ids = self.manager.get_block_ids(rid)
        return list(ids[self.group_of[self.module.state_cache.prefix]]), list(ids[self.group_of[self.k_prefix]])

    def _schedule(self, rid: str, start: int, end: int) -> tuple[list, list]:
        req, (hit, hit_tokens) = self.requests[rid], self.hits.pop(rid, (None, 0))
        if req.num_computed_tokens > start:  # rejected drafts: vLLM's scheduler rolls num_computed_tokens back
            req.num_computed_tokens = start
        assert req.num_computed_tokens + hit_tokens == start, (rid, req.num_computed_tokens, hit_tokens, start)
        got = self.manager.allocate_slots(req, end - start, hit_tokens, hit)  # as Scheduler.schedule calls it
        assert got is not None, f"{rid}: no blocks"
        bank, kv = self.block_ids(rid)
        if rid not in self.claimed:  # a block vLLM just handed out (not zeroed): poison what its owner left
            self.claimed[rid] = bank[0]
            self.poison_banks(bank[0])
        self.blocks[rid] = (bank, kv)
        return bank, kv

    def poison_banks(self, block: int) -> None:
        self.stale[block] = self.banks()[block].clone()  # what vLLM handed out, before the poison
        self.banks()[block] = float("nan")

    def step(self, padding, items, rows: torch.Tensor) -> None:
        attn_metadata, padded, out_slot = self.prepare(padding, items, rows)
        self.forward(attn_metadata, padded)
        step = getattr(attn_metadata[self.module.state_cache.prefix], dsv4_vllm.STEP_ATTR)
        assert step.rows == padded and step.decode == (max(n for _, _, n in items) <= self.mtp + 1)
        self.closed |= set(out_slot[out_slot >= 0].tolist())
        row = 0
        for rid, start, n in items:
            self.rows[rid] = torch.cat([self.rows.get(rid, rows[:0])[:start], rows[row : row + n]]).cpu()
            self.requests[rid].num_computed_tokens = start + n
            row += n

    def finish(self, rid: str) -> None:
        """vLLM frees the request's blocks (``KVCacheManager.free``: full blocks stay cached for prefix hits)."""
        self.manager.free(self.requests.pop(rid))
        del self.rows[rid]

    # -- what the layer holds -------------------------------------------------------------------------------------
    def banks(self) -> torch.Tensor:
        return dsv4_vllm.online_bank_view(self.module.state_cache.kv_cache, self.nbanks, HEAD)

    def records(self, rid: str, kv=None) -> torch.Tensor:
        """The records of ``rid``'s closed groups, read where vLLM's compressed slot mapping puts them (2 per
        256-token block of the k cache group)."""
        kv = self.blocks[rid][1] if kv is None else kv
        groups = self.rows[rid].shape[0] // 128
        slots = torch.tensor([kv[g // 2] * 2 + g % 2 for g in range(groups)], dtype=torch.int64)
        return latent_page_layout(HCA, 2).read(self.pages, slots)

    def check_entries(self, rid: str, what: str) -> int:
        """``rid``'s records against the float64 one-shot entries of its rows; returns the entries checked."""
        return check_entries(self, self.rows[rid], self.records(rid), f"{what}: {rid}")


def check_entries(run: ForwardRun, rows: torch.Tensor, records: torch.Tensor, what: str) -> int:
    """HCA ``records`` of a request with kv_score ``rows`` through ``run``'s layer against the float64 one-shot
    entries (``verify.check_latent_records``: every byte explained within the float64 value's rounding)."""
    module, cos_sin = run.module, run.rotary_emb.cos_sin_cache.cpu()
    params = dc.CompressorParams(module.ape.detach().view(128, HEAD).cpu(), module.norm.weight.detach().cpu(),
                                 cos_sin[:, :32], cos_sin[:, 32:], eps=module.rms_norm_eps)  # fmt: skip
    want = ref.compress_sequence(rows, params, HCA, dtype=torch.float64)
    rep = check_latent_records(records, want, HCA)
    assert rep.ok, f"{what}: {rep}"
    return want.shape[0]


class RingOnPool(ForwardRun):
    """The ring path's layer (:class:`test_engine_vllm.ForwardRun`, ``install()``) fed a :class:`PooledRun`'s
    program with the k cache blocks vLLM gave it (a prefix hit's shared block included), its ring state blocks
    its own: its records land in the same slots of its own k cache."""

    def __init__(self, pool: PooledRun, monkeypatch):
        import test_engine_vllm

        monkeypatch.setitem(test_engine_vllm.FWD_KINDS, "hca", (128, HEAD, 584, 64, pool.kv_config.num_blocks))
        with dsv4_vllm.install():
            super().__init__("hca", ours=True)
        self.pool, self.rows = pool, {}

    def _schedule(self, rid: str, start: int, end: int) -> tuple[list, list]:
        self.blocks.setdefault(rid, ([0] * (start // self.state_bs), []))  # a hit's skipped window: null blocks
        state, _ = super()._schedule(rid, start, end)
        return state, self.pool.blocks[rid][1]

    def step(self, padding, items, rows: torch.Tensor) -> None:
        with dsv4_vllm.install():
            super().step(padding, items, rows)
        for rid, _, _ in items:
            self.rows[rid] = self.pool.rows[rid]

    def records(self, slots) -> torch.Tensor:
        return latent_page_layout(HCA, 2).read(self.k_raw.view(torch.uint8).view(-1, 1728), torch.tensor(slots))


#: Request A alone (chunked prefill, MTP verify with rejected drafts: group 1 closes twice), then, once vLLM freed
#: A, B (A's first 256 tokens: a prefix hit) and C (new) together; B rewinds 2 drafts at its group 2's end.
PREFIX_PROGRAM = [
    (None, [("A", 0, 100)]),
    ("piecewise", [("A", 100, 150)]),  # closes group 0
    ("full", [("A", 250, 4)]),
    ("piecewise", [("A", 252, 4)]),  # rejected 2 drafts, closes group 1
    (None, [("A", 255, 4)]),  # rejected 1: closes group 1 again
    "A finishes; B (a hit on A's first block) and C are admitted",
    (None, [("B", 256, 100), ("C", 0, 60)]),
    ("piecewise", [("B", 356, 28), ("C", 60, 70)]),  # B closes group 2, C group 0
    ("full", [("B", 382, 4), ("C", 129, 4)]),  # B rejected 2: closes group 2 again; C rejected 1
]


@pytest.mark.usefixtures("vllm_on_cpu")
def test_a_prefix_hit_and_a_freed_block_in_vllms_pool(monkeypatch):
    """:data:`PREFIX_PROGRAM` through the layer in vLLM's own pool (:class:`PooledRun`: its planner's packed
    layout, its allocator, its ``KVCacheManager``) and through the ring path on the same k cache blocks
    (:class:`RingOnPool`). vLLM's prefix hit for B lands on 256 tokens (the k cache group's block), and gives the
    ``CircularBufferSpec`` group no block (it skips groups that are not prefix cacheable): B starts at a group
    boundary with a new bank block, which vLLM does not zero: the block A freed, holding A's banks, poisoned here
    (NaN) before B's first step, as is C's. Every record of both runs against float64, ring and online records
    equal but at the online kernel's rounding boundaries (counted, at most 2% of the bytes), the banks of B and C
    hold their float64 partial groups."""
    online = PooledRun()
    ring = RingOnPool(online, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 1000, (400,), generator=gen).tolist()
    online.admit("A", tokens[:300])
    checked = differ = 0
    for k, entry in enumerate(PREFIX_PROGRAM):
        if isinstance(entry, str):
            checked += online.check_entries("A", "A's last step")
            checked += check_entries(ring, ring.rows["A"], ring.records(_slots(online, "A")), "ring: A")
            a_rows, a_bank, a_kv = online.rows["A"], online.claimed["A"], online.blocks["A"][1]
            a_banks = online.banks()[a_bank].clone()
            online.finish("A")
            hit, hit_tokens = online.admit("B", tokens[:256] + tokens[300:400])
            bank_group = online.group_of[online.module.state_cache.prefix]
            assert hit_tokens == 256 and not hit.blocks[bank_group]  # no hit block for the bank group
            assert [b.block_id for b in hit.blocks[online.group_of[online.k_prefix]]] == a_kv[:1]
            assert online.admit("C", [t + 1000 for t in tokens[:140]])[1] == 0
            online.rows["B"] = ring.rows["B"] = a_rows[:256]  # B's first 256 tokens are A's: so are their rows
            continue
        padding, items = entry
        rows = _fwd_rows("hca", padding, items, gen)
        with dsv4_vllm.install(hca="online"):
            online.step(padding, items, rows)
        ring.step(padding, items, rows)
        assert online.closed == ring.closed
        slots = sorted(online.closed)
        got_o, got_r = latent_page_layout(HCA, 2).read(online.pages, torch.tensor(slots)), ring.records(slots)
        differ = int((got_o != got_r).sum())
        assert differ <= got_o.numel() // 50, f"step {k}: {differ} of {got_o.numel()} record bytes differ"
    assert online.blocks["B"][1][0] == a_kv[0]
    assert online.claimed["B"] == a_bank, "B was not given A's freed bank block"  # vLLM's free queue: A's last
    assert torch.equal(online.stale[a_bank].view(torch.int32), a_banks.view(torch.int32))  # as A left it
    for rid in ("B", "C"):
        checked += online.check_entries(rid, "the last step")
        checked += check_entries(ring, ring.rows[rid], ring.records(_slots(online, rid)), f"ring: {rid}")
    assert checked == 2 * (2 + 3 + 1) and _check_banks(online) == 2
    print(f"prefix hit and freed block: {len(slots)} records, {differ} of {got_o.numel()} bytes differ ring/online")


def _slots(run: PooledRun, rid: str) -> list[int]:
    kv = run.blocks[rid][1]
    return [kv[g // 2] * 2 + g % 2 for g in range(run.rows[rid].shape[0] // 128)]


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
