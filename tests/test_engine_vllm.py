"""The vLLM adapter against the real vLLM 0.33.0 package (``make test-vllm``: ``.venv-vllm``, tests/engines/vllm.txt).

Skips without vLLM. Runs vLLM's own Python and Triton paths on CPU: its ``CompressorMetadataBuilder`` with the
``SlidingWindowMLASpec`` its ``CompressorStateCache`` declares, a real ``VllmConfig``, its
``CommonAttentionMetadata`` and the Triton ``token_to_req_indices`` kernel (under the interpreter), and vLLM's
own ``DeepseekCompressor.forward`` against the same forward after ``install()``, byte for byte
(:func:`test_vllms_forward_and_ours_write_the_same_bytes`). vLLM decides at import whether Triton is usable
from the active GPU drivers; with none (CPU) it swaps Triton for a placeholder, so on a machine without CUDA
this module sets ``CUDA_VISIBLE_DEVICES=""`` before importing vLLM, the case vLLM accepts with no active driver
(a Ray worker's start).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from helpers.session import engine_casts_round_to_nearest_even

if not torch.cuda.is_available():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

compressor = pytest.importorskip("vllm.models.deepseek_v4.compressor", reason="vLLM 0.33 is not installed")

from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import get_forward_context  # noqa: E402
from vllm.v1.attention.backend import AttentionMetadataBuilder, CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowMLASpec  # noqa: E402

from dsv4_compressor.errors import OpError  # noqa: E402
from dsv4_compressor.integrations import vllm as dsv4_vllm  # noqa: E402

MAX_T, MAX_REQS = 64, 4


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_symbols_the_adapter_patches_and_calls():
    """What install() replaces and what its replacements call, as vLLM 0.33.0 declares them."""
    DeepseekCompressor, Builder = compressor.DeepseekCompressor, compressor.CompressorMetadataBuilder
    assert _params(DeepseekCompressor.forward) == ["self", "kv_score", "positions", "rotary_emb"]
    assert _params(DeepseekCompressor.__init__)[:5] == ["self", "vllm_config", "compress_ratio", "hidden_size",
                                                         "head_dim"]  # fmt: skip
    assert _params(Builder.__init__) == ["self", "args", "kwargs"]  # passes on to AttentionMetadataBuilder's
    assert _params(AttentionMetadataBuilder.__init__) == ["self", "kv_cache_spec", "layer_names", "vllm_config",
                                                          "device"]  # fmt: skip
    assert _params(Builder.build) == ["self", "common_prefix_len", "common_attn_metadata", "fast_build"]
    assert _params(CommonAttentionMetadata.token_to_req_indices) == ["self", "buffer"]
    assert _params(compressor.CompressorStateCache.get_kv_cache_spec) == ["self", "vllm_config"]
    fields = compressor.CompressorMetadata.__dataclass_fields__
    assert {"block_table", "slot_mapping", "block_size", "token_to_req_indices"} <= set(fields)
    assert compressor.CompressorMetadataBuilder._cudagraph_support.name == "ALWAYS"
    assert _params(get_forward_context) == []
    assert dsv4_vllm.COMPRESSOR_MODULES[0] == compressor.__name__


def test_install_and_uninstall_on_the_real_classes():
    DeepseekCompressor, Builder = compressor.DeepseekCompressor, compressor.CompressorMetadataBuilder
    originals = (DeepseekCompressor.__init__, DeepseekCompressor.forward, Builder.__init__, Builder.build)
    with dsv4_vllm.install() as installation:
        assert installation.compressor_cls is DeepseekCompressor and installation.builder_cls is Builder
        assert DeepseekCompressor.forward.__wrapped__ is originals[1]
        assert Builder.build.__wrapped__ is originals[3]
    assert (DeepseekCompressor.__init__, DeepseekCompressor.forward, Builder.__init__, Builder.build) == originals


def test_the_installed_entry_point_is_inert_until_switched_on(monkeypatch):
    """This package's ``vllm.general_plugins`` entry point, loaded the way vLLM's ``load_plugins_by_group`` loads
    it (``importlib.metadata``; what it points at is tests/test_entry_points.py's), is inert unless
    ``VLLM_DSV4C=tiled``, and then installs on the real classes; ``register()`` called directly does the same."""
    from importlib.metadata import entry_points

    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    (plugin,) = [e for e in entry_points(group=DEFAULT_PLUGINS_GROUP) if e.name == "dsv4_compressor"]
    monkeypatch.delenv(dsv4_vllm.ENV_VAR, raising=False)
    monkeypatch.delenv(dsv4_vllm.ENV_VAR_ALIAS, raising=False)
    for register in (plugin.load(), dsv4_vllm.register):
        assert register() is None
        assert "_dsv4c_installation" not in vars(compressor.DeepseekCompressor)
        monkeypatch.setenv(dsv4_vllm.ENV_VAR, "tiled")
        installation = register()
        try:
            assert vars(compressor.DeepseekCompressor)["_dsv4c_installation"] is installation
        finally:
            installation.uninstall()
        monkeypatch.delenv(dsv4_vllm.ENV_VAR)


def _config() -> VllmConfig:
    scheduler = SchedulerConfig(
        max_num_batched_tokens=MAX_T, max_num_seqs=MAX_REQS, max_model_len=256, is_encoder_decoder=False
    )
    return VllmConfig(scheduler_config=scheduler, device_config=DeviceConfig(device="cpu"))


def _padded_two_request_step(builder):
    """``(positions, metadata)`` of the real builder's step of two requests (5 and 4 prefill rows, block size 4)
    whose state slot mapping is padded to 12 rows with ``-1``, as the V1 runner pads it."""
    qsl = torch.tensor([0, 5, 9], dtype=torch.int32)
    table = torch.tensor([[1, 2, 0, 0], [3, 4, 0, 0]], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0], dtype=torch.int64)
    slots = (table[[0] * 5 + [1] * 4].long().gather(1, (positions[:9] // 4)[:, None])[:, 0] * 4
             + positions[:9] % 4)  # fmt: skip
    slots = torch.cat([slots, torch.full((3,), -1, dtype=torch.int64)])
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([5, 4], dtype=torch.int32),
        num_reqs=2, num_actual_tokens=9, max_query_len=5, max_seq_len=5, block_table_tensor=table,
        slot_mapping=slots,
    )  # fmt: skip
    return positions, builder.build(0, cam)


def test_real_builder_with_a_slot_mapping_longer_than_token_to_req_indices():
    """The V1 runner's case (``forward_includes_kv_cache_update=False``): slot mappings padded to 12 rows, 9
    actual tokens. vLLM's builder returns 9 request indices; the patched builder's plan takes the 12 rows, the
    three past the request indices as padding."""
    config = _config()
    with set_current_vllm_config(config):
        state = compressor.CompressorStateCache(2 * 2 * 128, torch.float32, 4, prefix="layers.0.state")
    spec = state.get_kv_cache_spec(config)
    assert isinstance(spec, SlidingWindowMLASpec) and (spec.block_size, spec.sliding_window) == (4, 8)
    with dsv4_vllm.install():
        builder = compressor.CompressorMetadataBuilder(spec, [state.prefix], config, torch.device("cpu"))
        planner = builder._dsv4c_planner
        assert (planner.max_num_tokens, planner.max_num_reqs, planner.window, planner.block_size) == (MAX_T, 4, 8, 4)
        positions, metadata = _padded_two_request_step(builder)
        assert metadata.token_to_req_indices.tolist() == [0] * 5 + [1] * 4 and metadata.slot_mapping.shape[0] == 12
        step = getattr(metadata, dsv4_vllm.STEP_ATTR)
        assert not step.decode
        out_slot = torch.full((12,), -1, dtype=torch.int64)
        out_slot[3], out_slot[8] = 4, 8  # the two group-closing rows (position 3 of each request)
        step.build(positions, metadata.token_to_req_indices, metadata.block_table, metadata.slot_mapping, out_slot,
                   ratio=4)  # fmt: skip
        assert step.rows == 12
        assert planner.row_req[:12].tolist() == [0] * 5 + [1] * 4 + [-1] * 3


def test_real_builder_with_a_compressed_slot_mapping_shorter_than_the_state_slot_mapping(monkeypatch):
    """vLLM pads every group's ``slot_mapping`` to the padded token count but builds the compressed-KV slot
    mapping (``get_compressed_slot_mapping(cm.num_actual_tokens, ...)``, attn_metadata[k_cache_prefix]) for
    ``num_actual_tokens`` rows, which is the unpadded count unless the graph mode is FULL: the V2 runner always
    pads the slot mappings (``v1/worker/gpu/model_runner.py`` L1609-1614) and passes the unpadded count under
    piecewise / breakable graphs and eager (``model_states/default.py`` L179-186); the V1 runner pads them when
    a backend has ``forward_includes_kv_cache_update=False`` and passes the padded count only under FULL graphs
    (``gpu_model_runner.py`` L4036-4103, L2370). Here 12 state rows, 9 compressed: the plan reads the 9 through
    the planner's persistent buffer, the 3 missing rows -1 (whatever the buffer held), at one address for every
    step (CUDA graphs); a compressed slot mapping of the step's own length is passed as it is; a longer one is
    refused before anything runs."""
    config = _config()
    with set_current_vllm_config(config):
        state = compressor.CompressorStateCache(2 * 2 * 128, torch.float32, 4, prefix="layers.1.state")
    spec = state.get_kv_cache_spec(config)
    calls = []
    build_plans = dsv4_vllm.ops.build_plans

    def recording_build_plans(plans, positions, row_req, out_slots, **kwargs):  # the plan and its state rows
        calls.append((out_slots[0].data_ptr(), out_slots[0].tolist()))
        return build_plans(plans, positions, row_req, out_slots, **kwargs)

    monkeypatch.setattr(dsv4_vllm.ops, "build_plans", recording_build_plans)
    with dsv4_vllm.install():
        builder = compressor.CompressorMetadataBuilder(spec, [state.prefix], config, torch.device("cpu"))
        planner = builder._dsv4c_planner
        positions, metadata = _padded_two_request_step(builder)
        step = getattr(metadata, dsv4_vllm.STEP_ATTR)
        args = (positions, metadata.token_to_req_indices, metadata.block_table, metadata.slot_mapping)
        out_slot = torch.full((9,), -1, dtype=torch.int64)
        out_slot[3], out_slot[8] = 4, 8  # the two group-closing rows (position 3 of each request)
        planner.out_slot.fill_(7)  # whatever an earlier step left
        step.build(*args, out_slot, ratio=4)
        assert step.rows == 12
        assert calls[-1] == (planner.out_slot.data_ptr(), out_slot.tolist() + [-1] * 3)
        out_slot[3] = 5
        step.build(*args, out_slot[:8], ratio=4)  # another length, the same buffer
        assert calls[-1] == (planner.out_slot.data_ptr(), out_slot[:8].tolist() + [-1] * 4)
        full = torch.cat([out_slot, torch.full((3,), -1, dtype=torch.int64)])
        step.build(*args, full, ratio=4)
        assert calls[-1] == (full.data_ptr(), full.tolist())  # the step's own length: no copy
        before, row_req = len(calls), planner.row_req.clone()
        with pytest.raises(OpError, match="out_slot has 13 rows, slot_mapping 12"):
            step.build(*args, torch.cat([full, full[:1]]), ratio=4)
        assert len(calls) == before and torch.equal(planner.row_req, row_req)


# ---------------------------------------------------------------------------------------------------------------
# vLLM's own DeepseekCompressor.forward against the same forward after install(), byte for byte
# ---------------------------------------------------------------------------------------------------------------
FWD_T, FWD_REQS, MTP = 160, 4, 3  # max_num_batched_tokens, max_num_seqs, num_speculative_tokens
KV_BLOCK = 256  # cache_config.block_size (DeepSeek-V4's): 64 compressed entries per C4 block, 2 per C128 block
POISON_BYTE = 0xA5  # every k cache byte before the first step
POISON_STATE = 0x7FC0A5A5  # every state word before the first step: a NaN, so a stray read spoils an entry
HIDDEN = 64  # the compressor's GEMM input width (unused by forward: it takes kv_score)

#: kind -> (compress_ratio, head_dim, k cache record bytes, state blocks, k cache blocks)
FWD_KINDS = {
    "csa": (4, 512, 584, 20, 4),
    "indexer": (4, 128, 132, 12, 4),
    "hca": (128, 512, 584, 40, 4),
}

#: kind -> steps; a step is (padding, [(request, start, rows)]). Padding of the step's rows to a capture size,
#: as vLLM's runners pad: "full" (FULL CUDA graphs: slot mappings and num_actual_tokens padded, one padded
#: request), "piecewise" (breakable / piecewise graphs, the V2 runner: slot mappings padded, num_actual_tokens
#: and so the compressed slot mapping and token_to_req_indices not), None. A start below the request's length
#: is an MTP verify after rejected drafts.
FWD_PROGRAMS = {
    "csa": [
        (None, [("A", 0, 10), ("B", 0, 7)]),  # first chunks
        ("full", [("A", 10, 3), ("B", 7, 6)]),  # continuation chunks
        ("piecewise", [("A", 13, 1), ("B", 13, 1)]),  # decode
        ("piecewise", [("A", 14, 4), ("B", 14, 4), ("C", 0, 5)]),  # MTP verify, a new request's first chunk
        ("full", [("B", 16, 4), ("A", 18, 4)]),  # B rejected 2 drafts; A accepted all
        (None, [("A", 19, 4), ("B", 20, 4), ("C", 5, 4)]),  # A rejected 3 (its start is L - 3)
    ],
    "indexer": [
        (None, [("A", 0, 9), ("B", 0, 6)]),
        ("piecewise", [("A", 9, 4), ("B", 6, 3)]),  # 7 rows padded to 8
        ("full", [("B", 9, 4), ("A", 11, 3)]),  # A rejected 2 drafts; 7 rows padded to 8
        (None, [("A", 14, 1), ("B", 13, 1)]),
    ],
    "hca": [
        (None, [("A", 0, 100), ("B", 0, 30)]),
        ("piecewise", [("A", 100, 26), ("B", 30, 3)]),  # A ends at 126: its next verify crosses 127
        ("full", [("A", 126, 4), ("B", 33, 97)]),  # both close their group 0 (position 127)
        ("piecewise", [("A", 127, 4), ("B", 130, 1)]),  # A rewinds to 127: closes group 0 again, new row
    ],
}
PAD_TO = (8, 16, 32, 64, 128, 160)  # capture sizes


def _fwd_config(max_tokens: int = FWD_T, max_reqs: int = FWD_REQS, device: str = "cpu"):
    """A VllmConfig for the compressor's tests. DeepseekCompressor reads the model config only for
    ``hf_config.qk_rope_head_dim`` / ``rms_norm_eps`` and ``max_model_len`` (stood in: a real ModelConfig loads a
    checkpoint's config.json); the speculative config only for ``num_speculative_tokens``."""
    scheduler = SchedulerConfig(
        max_num_batched_tokens=max_tokens, max_num_seqs=max_reqs, max_model_len=512, is_encoder_decoder=False
    )
    config = VllmConfig(
        scheduler_config=scheduler, device_config=DeviceConfig(device=device),
        cache_config=CacheConfig(block_size=KV_BLOCK, cache_dtype="fp8_ds_mla"),
    )  # fmt: skip
    hf = SimpleNamespace(
        qk_rope_head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=65536, beta_fast=32,
                             beta_slow=1),
    )  # fmt: skip
    config.model_config = SimpleNamespace(hf_config=hf, max_model_len=512, is_moe=False)
    config.speculative_config = SimpleNamespace(num_speculative_tokens=MTP)
    return config


@pytest.fixture(scope="module")
def vllm_on_cpu():
    """vLLM's platform on this machine is ``UnspecifiedPlatform`` (no GPU, a CUDA wheel), whose ``device_type``
    is ``""``: the compressor allocates its parameters on ``current_platform.device_type``, set to ``"cpu"``
    here, and the runner's host-to-device copies pin their source (``PIN_MEMORY``, decided for a CUDA wheel),
    off here. The compressor's ``MergedColumnParallelLinear`` needs vLLM's parallel groups: one rank, gloo."""
    import vllm.v1.utils
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(current_platform, "device_type", "cpu")
        mp.setattr(vllm.v1.utils, "PIN_MEMORY", False)
        config = _fwd_config()
        with set_current_vllm_config(config), tempfile.TemporaryDirectory() as tmp:
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{tmp}/init", backend="gloo"
            )
            parallel_state.initialize_model_parallel(1, 1)
            try:
                yield
            finally:
                parallel_state.destroy_model_parallel()
                parallel_state.destroy_distributed_environment()


def _poisoned_views(spec, num_blocks: int, poison: torch.Tensor):
    """vLLM's cache of one layer: a flat int8 allocation of ``num_blocks`` padded pages, filled with
    ``poison``'s bytes, viewed as ``[B, H, N, C]`` by ``create_kv_cache_views`` (the runner's
    ``allocate_kv_cache``; one layer, one head: every layout gives these strides)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    page = spec.page_size_bytes
    pattern = poison.view(torch.uint8)
    raw = pattern.repeat(num_blocks * page // pattern.numel()).view(torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=["layer"], layer_stride=num_blocks * page, block_stride=page)
    (view,) = create_kv_cache_views(raw, spec, num_blocks, KVCacheLayout.LBNHC, tensor)
    return raw, view


class ForwardRun:
    """One compressor layer of ``kind`` as vLLM's runner holds it, scaled down: ``DeepseekCompressor`` (ours:
    built after ``install()``), its ``CompressorStateCache`` and k cache in vLLM's cache views, the state
    group's ``CompressorMetadataBuilder``, vLLM's ``BlockTable`` (slot mapping kernel) for the state group and
    the compressed-KV group, ``get_compressed_slot_mapping`` into a persistent buffer, the model's persistent
    ``positions`` and ``kv_score``. The KV-cache manager is the test's: blocks handed out in order, state
    blocks outside the sliding window replaced by the null block 0."""

    def __init__(self, kind: str, ours: bool, *, max_tokens: int = FWD_T, max_reqs: int = FWD_REQS,
                 device: str = "cpu"):  # fmt: skip
        from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
        from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope
        from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode
        from vllm.v1.worker.block_table import BlockTable

        ratio, head, record, state_blocks, kv_blocks = FWD_KINDS[kind]
        self.kind, self.ratio, self.head, self.record = kind, ratio, head, record
        self.config = config = _fwd_config(max_tokens, max_reqs, device)
        self.device = dev = torch.device(device)
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self.window = (2 if ratio == 4 else 1) * ratio
        prefix = f"model.layers.0.attn.{'indexer.' if kind == 'indexer' else ''}"
        self.k_prefix = prefix + ("k_cache" if kind == "indexer" else "mla_attn")
        with set_current_vllm_config(config), dev:  # the model's modules are built on its device
            self.module = compressor.DeepseekCompressor(
                config, ratio, HIDDEN, head, rotate=kind == "indexer", prefix=prefix + "compressor",
                k_cache_prefix=self.k_prefix,
            )  # fmt: skip
            if kind == "indexer":
                k_layer = DeepseekV4IndexerCache(head + 4, torch.uint8, self.k_prefix, config.cache_config, ratio)
                k_spec = k_layer.get_kv_cache_spec(config)
            else:  # the attention layer's spec (DeepseekV4MLAAttention.get_kv_cache_spec, fp8_ds_mla)
                k_spec = MLAAttentionSpec(
                    block_size=KV_BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=head, dtype=torch.uint8,
                    tokens_per_state=ratio, cache_dtype_str="fp8_ds_mla", alignment=576,
                    model_version="deepseek_v4", kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
                    state_content_bytes=record,
                )  # fmt: skip
                k_layer = SimpleNamespace(kv_cache=None)
                config.compilation_config.static_forward_context[self.k_prefix] = k_layer
            rope = build_deepseek_v4_rope(
                config.model_config.hf_config, head_dim=head, rope_head_dim=64, max_position_embeddings=512,
                compress_ratio=ratio,
            )  # fmt: skip
        self.rotary_emb = rope
        state = self.module.state_cache
        state_spec = state.get_kv_cache_spec(config)
        self.state_raw, view = _poisoned_views(
            state_spec, state_blocks, torch.tensor([POISON_STATE], dtype=torch.int32, device=dev)
        )
        state.bind_kv_cache(view)
        self.k_raw, view = _poisoned_views(
            k_spec, kv_blocks, torch.tensor([POISON_BYTE], dtype=torch.uint8, device=dev)
        )
        k_layer.kv_cache = view.squeeze(1)  # the layer's bind_kv_cache
        self.entries = k_spec.num_states  # compressed entries per k cache block
        self.k_page = k_spec.page_size_bytes  # a k cache block's bytes (its page, padded)
        self.builder = compressor.CompressorMetadataBuilder(state_spec, [state.prefix], config, dev)
        self.ours = ours
        gen = torch.Generator().manual_seed(7 + ratio + head)
        width = self.module.coff * head
        with torch.no_grad():
            self.module.ape.copy_(torch.randn(ratio, width, generator=gen))
            weight = (1 + 0.3 * torch.randn(head, generator=gen)).to(torch.bfloat16)  # the model's dtype
            self.module.norm.weight = torch.nn.Parameter(weight.to(dev), requires_grad=False)
        self.width = 2 * width
        self.kv_score = torch.zeros(max_tokens, self.width, device=dev)  # the fused GEMM's float32 output
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.out_buffer = torch.empty(max_tokens, dtype=torch.int64, device=dev)  # the FlashMLA builder's buffer
        kw = dict(max_num_reqs=max_reqs, max_num_batched_tokens=max_tokens, pin_memory=False,
                  device=dev, cp_kv_cache_interleave_size=1)  # fmt: skip
        self.state_table = BlockTable(state_spec.block_size, max_num_blocks_per_req=64, **kw)
        self.k_table = BlockTable(KV_BLOCK, max_num_blocks_per_req=4, **kw)
        self.state_bs = state_spec.block_size
        self.blocks: dict[str, tuple[list, list]] = {}
        self.next_block = [1, 1]  # block 0 is each group's null block
        self.closed: set[int] = set()  # the compressed slots written, over all steps

    def _schedule(self, rid: str, start: int, end: int) -> tuple[list, list]:
        state, kv = self.blocks.setdefault(rid, ([], []))
        for i in range(max(0, start - MTP - self.window + 1) // self.state_bs):  # outside the window: null
            state[i] = 0
        while len(state) * self.state_bs < end:
            state.append(self.next_block[0])
            self.next_block[0] += 1
        while len(kv) * KV_BLOCK < end:
            kv.append(self.next_block[1])
            self.next_block[1] += 1
        return state, kv

    def step(self, padding, items, rows: torch.Tensor) -> None:
        """One step of ``items`` with ``kv_score`` rows ``rows`` (padding rows included) through the builders and
        the layer's forward (``DeepseekCompressor.__call__``) under vLLM's forward context."""
        attn_metadata, padded, out_slot = self.prepare(padding, items, rows)
        self.forward(attn_metadata, padded)
        step = getattr(attn_metadata[self.module.state_cache.prefix], dsv4_vllm.STEP_ATTR, None)
        if self.ours:  # the ops ran this step (a layer the adapter leaves to vLLM would not build a plan)
            assert step is not None and step.rows == padded and step.owner is self.module
            assert step.decode == (max(n for _, _, n in items) <= MTP + 1)
        else:
            assert step is None
        self.closed |= set(out_slot[out_slot >= 0].tolist())

    def forward(self, attn_metadata, padded: int, mode=None) -> None:
        """The layer's forward (``DeepseekCompressor.__call__``) under vLLM's forward context (runtime ``mode``)."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import set_forward_context

        casts = contextlib.nullcontext() if self.ours else engine_casts_round_to_nearest_even()
        mode = CUDAGraphMode.NONE if mode is None else mode
        with set_forward_context(attn_metadata, self.config, cudagraph_runtime_mode=mode), casts:
            self.module(self.kv_score[:padded], self.positions[:padded], self.rotary_emb)

    def capture_batch(self, num_tokens: int) -> dict:
        """The metadata of the dummy batch vLLM's V2 runner captures a PIECEWISE graph of ``num_tokens`` tokens
        on (``cudagraph_utils.prepare_inputs_to_capture``, ``InputBatch.make_dummy``): ``min(T, max_num_seqs)``
        requests sharing the tokens evenly, positions 0, block-table rows zeroed, every slot ``PAD_SLOT_ID``."""
        from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping

        reqs = min(num_tokens, self.max_reqs)
        lens = [num_tokens // reqs + (i >= reqs - num_tokens % reqs) for i in range(reqs)]
        qsl_cpu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        qsl = qsl_cpu.to(self.device)
        self.positions[:num_tokens] = 0
        for table in (self.state_table, self.k_table):
            table.block_table.gpu[:reqs].zero_()
            table.slot_mapping.gpu.fill_(-1)

        def cam(table):
            return CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl_cpu,
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
                num_reqs=reqs, num_actual_tokens=num_tokens, max_query_len=max(lens), max_seq_len=max(lens),
                block_table_tensor=table.get_device_tensor(reqs), slot_mapping=table.slot_mapping.gpu[:num_tokens],
                positions=self.positions[:num_tokens],
            )  # fmt: skip

        k_cam = cam(self.k_table)
        out_slot = get_compressed_slot_mapping(
            num_tokens, k_cam.slot_mapping, k_cam.query_start_loc, k_cam.seq_lens,
            k_cam.block_table_tensor.clamp_(min=0), self.entries, self.ratio, out=self.out_buffer,
        )  # fmt: skip
        return {
            self.module.state_cache.prefix: self.builder.build(0, cam(self.state_table)),
            self.k_prefix: SimpleNamespace(slot_mapping=out_slot),
        }

    def prepare(self, padding, items, rows: torch.Tensor):
        """What the runner does before the forward of a step: schedule ``items``, fill the persistent buffers
        (block tables, slot mappings, positions, ``kv_score``), build the metadata; returns ``(attn_metadata,
        padded rows, compressed slot mapping)``."""
        from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping

        actual = sum(n for _, _, n in items)
        padded = actual if padding is None else min(s for s in PAD_TO if s >= actual)
        reqs = len(items) + (padding == "full" and padded > actual)
        qsl, seq_lens, row = [0], [], 0
        for i, (rid, start, n) in enumerate(items):
            state, kv = self._schedule(rid, start, start + n)
            self.state_table.add_row(state, i)
            self.k_table.add_row(kv, i)
            self.positions[row : row + n] = torch.arange(start, start + n)
            row += n
            qsl.append(row)
            seq_lens.append(start + n)
        for table in (self.state_table, self.k_table):
            for i in range(len(items), self.max_reqs):
                table.clear_row(i)
        if reqs > len(items):  # a padded request: no rows, the null block
            qsl.append(row)
            seq_lens.append(0)
        # a padded row's position repeats a real one (stale buffer contents look real): only its -1 slots say
        self.positions[actual:padded] = self.positions[: padded - actual] if padded - actual <= actual else 3
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        qsl_t = qsl_cpu.to(self.device)
        for table in (self.state_table, self.k_table):
            table.commit_block_table(reqs)
            table.compute_slot_mapping(len(items), qsl_t[: len(items) + 1], self.positions[:actual])
        self.kv_score[:padded] = rows
        num_actual = padded if padding == "full" else actual

        def cam(table):
            return CommonAttentionMetadata(
                query_start_loc=qsl_t, query_start_loc_cpu=qsl_cpu,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
                num_reqs=reqs, num_actual_tokens=num_actual, max_query_len=max(n for _, _, n in items),
                max_seq_len=max(seq_lens), block_table_tensor=table.get_device_tensor(reqs),
                slot_mapping=table.slot_mapping.gpu[:padded], positions=self.positions[:padded],
            )  # fmt: skip

        k_cam = cam(self.k_table)
        out_slot = get_compressed_slot_mapping(  # as vLLM's FlashMLA and indexer builders call it
            num_actual, k_cam.slot_mapping, k_cam.query_start_loc, k_cam.seq_lens,
            k_cam.block_table_tensor.clamp_(min=0), self.entries, self.ratio, out=self.out_buffer,
        )  # fmt: skip
        state_meta = self.builder.build(0, cam(self.state_table))
        attn_metadata = {
            self.module.state_cache.prefix: state_meta,
            self.k_prefix: SimpleNamespace(slot_mapping=out_slot),
        }
        return attn_metadata, padded, out_slot


def _fwd_rows(kind: str, padding, items, gen) -> torch.Tensor:
    ratio, head = FWD_KINDS[kind][:2]
    width = 2 * (2 if ratio == 4 else 1) * head
    actual = sum(n for _, _, n in items)
    padded = actual if padding is None else min(s for s in PAD_TO if s >= actual)
    rows = torch.randn(padded, width, generator=gen)
    rows[:, width // 2 :] *= 2  # score logits
    return rows


@pytest.mark.parametrize("kind", list(FWD_PROGRAMS))
def test_vllms_forward_and_ours_write_the_same_bytes(kind, vllm_on_cpu):
    """vLLM 0.33's own ``DeepseekCompressor.forward`` and the same forward after ``install()``, on two copies of
    one layer (same parameters, caches poisoned alike: k cache bytes 0xA5, state words a NaN) fed the same
    steps (:data:`FWD_PROGRAMS`: chunked prefill, decode, MTP verify with rejected drafts, the runners'
    paddings): after every step the whole state cache and k cache allocations are byte-identical, page padding,
    null blocks and never-written blocks included.

    vLLM's side is its forward as it runs off CUDA and ROCm: ``_SAVE_PARTIAL_STATES_KERNEL``, then
    ``compress_norm_rope_store_triton`` (for head 512 ``_fused_kv_compress_norm_rope_insert_sparse_attn``, for
    the indexer ``_fused_kv_compress_norm_rope_insert_indexer_attn``), its Triton kernels under the interpreter.
    On CUDA, head 512 goes to its CuTe DSL kernels instead, which cannot run here; nothing else is replaced.
    The interpreter truncates float32 -> bfloat16 and mis-rounds float32 -> float8e4nv casts: while vLLM's
    forward runs (never while ours runs) those casts round to nearest even, as the GPU's do
    (``helpers.session.engine_casts_round_to_nearest_even``).

    Real: ``DeepseekCompressor`` (its ``CompressorStateCache``), ``CompressorMetadataBuilder``,
    ``CommonAttentionMetadata`` (its ``token_to_req_indices`` kernel), ``BlockTable``'s slot mapping kernel,
    ``get_compressed_slot_mapping`` into a persistent buffer, ``create_kv_cache_views`` over padded pages,
    ``DeepseekV4IndexerCache``, ``build_deepseek_v4_rope``, ``set_forward_context``. Stood in: the model config's
    fields the compressor reads, the platform's device type and pinned memory (:func:`vllm_on_cpu`), the main
    k cache's layer (a holder of the view its spec gives) and the compressed-KV group's metadata
    (``SimpleNamespace(slot_mapping=...)``: the only field the forward reads), the KV-cache manager."""
    theirs = ForwardRun(kind, ours=False)
    with dsv4_vllm.install():
        ours = ForwardRun(kind, ours=True)
    gen = torch.Generator().manual_seed(11)
    for k, (padding, items) in enumerate(FWD_PROGRAMS[kind]):
        rows = _fwd_rows(kind, padding, items, gen)
        theirs.step(padding, items, rows)
        with dsv4_vllm.install():
            ours.step(padding, items, rows)
        for name in ("state_raw", "k_raw"):
            diff = (getattr(theirs, name) != getattr(ours, name)).nonzero()[:, 0]
            assert diff.numel() == 0, f"{kind} step {k}: {name}: {diff.numel()} bytes differ, at {diff[:4].tolist()}"
    # not two untouched caches: vLLM's forward wrote every entry, and a row for each position supplied, no more
    written = int((theirs.k_raw.view(torch.uint8) != POISON_BYTE).sum())
    assert theirs.closed and written >= 0.9 * len(theirs.closed) * theirs.record
    lengths = {}
    for _, items in FWD_PROGRAMS[kind]:
        lengths.update((rid, max(lengths.get(rid, 0), start + n)) for rid, start, n in items)
    saved = int((theirs.state_raw.view(torch.int32) != POISON_STATE).sum())
    assert saved == sum(lengths.values()) * theirs.width


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs as vLLM's V2 runner captures them: what a capture records must hold for every batch it replays
# ---------------------------------------------------------------------------------------------------------------
def test_the_recorded_path_follows_what_the_graph_replays():
    """:func:`recorded_decode` on vLLM's own runtime modes: a call run now (eager; the V1 runner's eager break at a
    piecewise replay) takes its metadata's decode claim, a FULL capture too (the V2 runner captures it under
    runtime mode NONE, on metadata built from what it replays), a PIECEWISE capture never."""
    from vllm.config import CUDAGraphMode

    assert {m.name for m in CUDAGraphMode.valid_runtime_modes()} == {"NONE", "PIECEWISE", "FULL"}
    for mode in CUDAGraphMode.valid_runtime_modes():
        assert dsv4_vllm.recorded_decode(True, graph_mode=mode.name, capturing=False)
        assert not dsv4_vllm.recorded_decode(False, graph_mode=mode.name, capturing=False)
        want = mode != CUDAGraphMode.PIECEWISE
        assert dsv4_vllm.recorded_decode(True, graph_mode=mode.name, capturing=True) == want
    assert dsv4_vllm.recorded_decode(True, graph_mode=None, capturing=True)  # a graph of one's own: FULL


class Recorder:
    """A CUDA graph capture on CPU: the adapter's device work (``VllmStepPlan.build``, ``compress_layer``) is
    recorded with its arguments, not run, as a capture records launches without running them; :meth:`replay`
    calls them again with the same arguments (the same tensors, so whatever the runner copied into them since,
    and the same host values: rows, capacity, decode flag), as a replay launches the same kernels. Both calls
    decide on the host from shapes and those values only (never from tensor contents), which is what makes
    this the graph's behaviour; the stream counts as capturing throughout (``debug`` keeps its check's result on
    the device)."""

    def __init__(self, monkeypatch):
        self.calls = []
        build, compress_layer = dsv4_vllm.VllmStepPlan.build, dsv4_vllm.layer.compress_layer
        self.build, self.compress_layer = build, compress_layer

        def recorded_build(step, *args, **kwargs):
            self.calls.append((build, (step, *args), kwargs))
            return step

        def recorded_compress(*args, **kwargs):
            self.calls.append((compress_layer, args, kwargs))

        monkeypatch.setattr(dsv4_vllm.planner, "_capturing", lambda device: True)
        monkeypatch.setattr(dsv4_vllm.VllmStepPlan, "build", recorded_build)
        monkeypatch.setattr(dsv4_vllm.layer, "compress_layer", recorded_compress)
        self.monkeypatch = monkeypatch

    def stop(self) -> None:
        self.monkeypatch.setattr(dsv4_vllm.VllmStepPlan, "build", self.build)
        self.monkeypatch.setattr(dsv4_vllm.layer, "compress_layer", self.compress_layer)

    def replay(self) -> None:
        for fn, args, kwargs in self.calls:
            fn(*args, **kwargs)


#: kind -> (first chunk, the chunk a graph captured on a decode batch replays (7 rows padded to 8), a decode step)
GRAPH_PROGRAMS = {
    "csa": ([("A", 0, 10)], [("A", 10, 7)], [("A", 17, 1)]),  # closes groups at 11, 15
    "indexer": ([("A", 0, 6)], [("A", 6, 7)], [("A", 13, 1)]),  # closes at 7, 11
    "hca": ([("A", 0, 124)], [("A", 124, 7)], [("A", 131, 1)]),  # closes group 0 at 127
}


@pytest.mark.parametrize("kind", list(GRAPH_PROGRAMS))
def test_a_piecewise_graph_captured_on_a_decode_batch_replays_a_prefill_chunk(kind, vllm_on_cpu, monkeypatch):
    """vLLM's default runner (V2, breakable CUDA graphs, FULL_AND_PIECEWISE) runs the compressors inside the
    PIECEWISE graphs, each captured on a dummy batch of ``min(T, max_num_seqs)`` requests of about one token
    (here 4 requests of 2 rows: a decode batch by its metadata) and replayed for every batch of up to ``T``
    tokens. Captured (on CPU: :class:`Recorder`) on that batch under runtime mode PIECEWISE with ``debug=True``
    and replayed on a 7-row prefill chunk padded to 8, the layer writes what vLLM's own forward writes on the
    chunk, byte for byte, and the next eager step finds no error from the replay's plan check."""
    from vllm.config import CUDAGraphMode

    first, chunk, after = GRAPH_PROGRAMS[kind]
    theirs = ForwardRun(kind, ours=False)
    with dsv4_vllm.install(debug=True):
        ours = ForwardRun(kind, ours=True)
    gen = torch.Generator().manual_seed(3)

    def same(what: str) -> None:
        for name in ("state_raw", "k_raw"):
            diff = (getattr(theirs, name) != getattr(ours, name)).nonzero()[:, 0]
            assert diff.numel() == 0, f"{kind} {what}: {name}: {diff.numel()} bytes differ, at {diff[:4].tolist()}"

    rows = _fwd_rows(kind, None, first, gen)
    theirs.step(None, first, rows)
    with dsv4_vllm.install(debug=True):
        ours.step(None, first, rows)
    same("first chunk")

    with dsv4_vllm.install(debug=True), pytest.MonkeyPatch.context() as mp:
        graph = Recorder(mp)
        capture = ours.capture_batch(8)
        step = getattr(capture[ours.module.state_cache.prefix], dsv4_vllm.STEP_ATTR)
        assert step.decode  # the capture batch is a decode batch by its metadata
        ours.forward(capture, 8, CUDAGraphMode.PIECEWISE)
        graph.stop()
        assert [fn.__name__ for fn, _, _ in graph.calls] == ["build", "compress_layer"]
        assert graph.calls[0][2]["replays_any_batch"]  # the general path is recorded

        rows = _fwd_rows(kind, "piecewise", chunk, gen)
        theirs.step("piecewise", chunk, rows)
        ours.prepare("piecewise", chunk, rows)  # the runner's buffers and (host) metadata of the chunk
        graph.replay()
        assert step.rows == 8 and not step.decode_path
    same("chunk replayed on the decode capture")

    rows = _fwd_rows(kind, None, after, gen)
    theirs.step(None, after, rows)
    with dsv4_vllm.install(debug=True):
        ours.step(None, after, rows)  # debug: raises what the replay's check found
    same("decode step after the replay")
    assert int(ours.builder._dsv4c_planner.captured_err[0]) == 0


# ---------------------------------------------------------------------------------------------------------------
# vLLM's defaults: the per-step cost follows the step's requests, not max_num_seqs
# ---------------------------------------------------------------------------------------------------------------
#: vLLM 0.33's defaults on an H100 / H200 for its API server (``EngineArgs.get_batch_defaults``: >= 70 GiB and
#: not an A100: 8,192 batched tokens, 1,024 sequences; B200-class: 16,384 and 1,024).
VLLM_DEFAULT_TOKENS, VLLM_DEFAULT_SEQS = 8192, 1024


def _record_grids(monkeypatch) -> list[tuple[str, tuple]]:
    """``(kernel, grid)`` of every Triton launch of this package's kernels from now on (under the interpreter)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches, run = [], InterpretedFunction.run

    def recorded(self, *args, grid, **kwargs):
        if self.fn.__module__.startswith("dsv4_compressor."):
            launches.append((self.fn.__name__, tuple(grid(kwargs) if callable(grid) else grid)))
        return run(self, *args, grid=grid, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    return launches


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_at_vllms_defaults_a_small_decode_batch_launches_what_the_bare_ops_do(kind, vllm_on_cpu, monkeypatch):
    """With vLLM's default sizes (8,192 tokens, 1,024 sequences) an MTP verify step of 3 requests x 4 rows runs
    the same kernels on the same grids as the bare ops sized for that batch (a plan of 3 requests, the step's
    12 rows): the plan's one-program build and its state rows, and for HCA the tiled kernel's one-launch
    decode path (at 1,024 requests it takes two launches and one program per request and channel tile)."""
    from dsv4_compressor import ops

    with dsv4_vllm.install():
        run = ForwardRun(kind, ours=True, max_tokens=VLLM_DEFAULT_TOKENS, max_reqs=VLLM_DEFAULT_SEQS)
    items = [("A", 0, 4), ("B", 0, 4), ("C", 0, 4)]
    rows = _fwd_rows(kind, None, items, torch.Generator().manual_seed(5))
    with dsv4_vllm.install():
        attn_metadata, padded, out_slot = run.prepare(None, items, rows)
        with pytest.MonkeyPatch.context() as mp:
            adapter = _record_grids(mp)
            run.forward(attn_metadata, padded)
    state_meta = attn_metadata[run.module.state_cache.prefix]
    step = getattr(state_meta, dsv4_vllm.STEP_ATTR)
    assert step.decode_path and (padded, step.requests, tuple(step.plan.shape)[0]) == (12, 3, 3)

    # the bare ops on the same step, sized for it
    plan = ops.empty_plan(padded, 3, run.ratio, torch.device("cpu"))
    row_req = state_meta.token_to_req_indices[:padded].clone().masked_fill_(state_meta.slot_mapping < 0, -1)
    read_rows = torch.full((3, run.window - 1), -1, dtype=torch.int64)
    save_rows = torch.full((padded,), -1, dtype=torch.int64)
    module = run.module
    coff = 2 if kind != "hca" else 1
    cos_sin = run.rotary_emb.cos_sin_cache
    half = cos_sin.shape[1] // 2
    state = torch.full_like(module.state_cache.kv_cache, float("nan"))
    k_cache = run.module._static_forward_context[run.k_prefix].kv_cache
    pages = torch.full_like(k_cache, POISON_BYTE).view(k_cache.shape[0], -1)
    with pytest.MonkeyPatch.context() as mp:
        bare = _record_grids(mp)
        ops.build_plans(
            [plan], run.positions[:padded], row_req, [out_slot], ratios=[run.ratio],
            num_slots=state_meta.block_table.shape[0], mtp_step=MTP, read_rows=read_rows, save_rows=save_rows,
            state_mode="block_table", block_table=state_meta.block_table, block_size=state_meta.block_size,
        )  # fmt: skip
        ops.compress(
            run.kv_score[:padded], plan, module.ape.view(run.ratio, coff, run.head), module.norm.weight,
            cos_sin[:, :half], cos_sin[:, half:], state, pages, kind=kind, page_size=k_cache.shape[1],
            eps=module.rms_norm_eps, decode=True, scratch=torch.empty(padded, run.head) if kind == "hca" else None,
            read_rows=read_rows, save_rows=save_rows,
        )  # fmt: skip
    assert adapter == bare, f"{kind}: the adapter launched {adapter}, the bare ops {bare}"
    plan_launches = ops.launches("build_plans", rows=padded, requests=3, ratio=run.ratio, tables=True)
    assert bare[0][0] == "_build_plans_one_block_kernel"  # the plan's one-program build
    assert len(bare) == plan_launches + ops.launches("compress", rows=padded, requests=3, ratio=run.ratio,
                                                     kind=kind, decode=True, scratch=kind == "hca")  # fmt: skip
    if kind == "hca":  # what max_num_seqs would have cost
        assert ops.launches("compress", rows=padded, requests=VLLM_DEFAULT_SEQS, ratio=128, kind="hca",
                            decode=True, scratch=True) == 2  # fmt: skip
