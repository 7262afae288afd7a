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
    with pytest.raises(OpError, match="sliding-window"):
        dsv4_vllm.install(hca="online")
    assert (DeepseekCompressor.__init__, DeepseekCompressor.forward, Builder.__init__, Builder.build) == originals
    with dsv4_vllm.install() as installation:
        assert installation.compressor_cls is DeepseekCompressor and installation.builder_cls is Builder
        assert DeepseekCompressor.forward.__wrapped__ is originals[1]
        assert Builder.build.__wrapped__ is originals[3]
    assert (DeepseekCompressor.__init__, DeepseekCompressor.forward, Builder.__init__, Builder.build) == originals


def test_register_is_the_entry_point_and_inert(monkeypatch):
    """This package's ``vllm.general_plugins`` entry point (the group vLLM's ``load_general_plugins`` reads) is
    installed; it is inert unless ``VLLM_DSV4C=tiled``, and then installs on the real classes."""
    from importlib.metadata import entry_points

    names = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "dsv4_compressor.integrations.vllm:register" in names
    monkeypatch.delenv(dsv4_vllm.ENV_VAR, raising=False)
    monkeypatch.delenv(dsv4_vllm.ENV_VAR_ALIAS, raising=False)
    assert dsv4_vllm.register() is None
    assert "_dsv4c_installation" not in vars(compressor.DeepseekCompressor)
    monkeypatch.setenv(dsv4_vllm.ENV_VAR, "tiled")
    installation = dsv4_vllm.register()
    try:
        assert vars(compressor.DeepseekCompressor)["_dsv4c_installation"] is installation
    finally:
        installation.uninstall()


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


def _fwd_config():
    """A VllmConfig for the compressor's tests. DeepseekCompressor reads the model config only for
    ``hf_config.qk_rope_head_dim`` / ``rms_norm_eps`` and ``max_model_len`` (stood in: a real ModelConfig loads a
    checkpoint's config.json); the speculative config only for ``num_speculative_tokens``."""
    scheduler = SchedulerConfig(
        max_num_batched_tokens=FWD_T, max_num_seqs=FWD_REQS, max_model_len=512, is_encoder_decoder=False
    )
    config = VllmConfig(
        scheduler_config=scheduler, device_config=DeviceConfig(device="cpu"),
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

    def __init__(self, kind: str, ours: bool):
        from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache
        from vllm.models.deepseek_v4.common.rope import build_deepseek_v4_rope
        from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode
        from vllm.v1.worker.block_table import BlockTable

        ratio, head, record, state_blocks, kv_blocks = FWD_KINDS[kind]
        self.kind, self.ratio, self.head, self.record = kind, ratio, head, record
        self.config = config = _fwd_config()
        self.window = (2 if ratio == 4 else 1) * ratio
        prefix = f"model.layers.0.attn.{'indexer.' if kind == 'indexer' else ''}"
        self.k_prefix = prefix + ("k_cache" if kind == "indexer" else "mla_attn")
        with set_current_vllm_config(config):
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
            state_spec, state_blocks, torch.tensor([POISON_STATE], dtype=torch.int32)
        )
        state.bind_kv_cache(view)
        self.k_raw, view = _poisoned_views(k_spec, kv_blocks, torch.tensor([POISON_BYTE], dtype=torch.uint8))
        k_layer.kv_cache = view.squeeze(1)  # the layer's bind_kv_cache
        self.entries = k_spec.num_states  # compressed entries per k cache block
        self.builder = compressor.CompressorMetadataBuilder(state_spec, [state.prefix], config, torch.device("cpu"))
        self.ours = ours
        gen = torch.Generator().manual_seed(7 + ratio + head)
        width = self.module.coff * head
        with torch.no_grad():
            self.module.ape.copy_(torch.randn(ratio, width, generator=gen))
            weight = (1 + 0.3 * torch.randn(head, generator=gen)).to(torch.bfloat16)  # the model's dtype
            self.module.norm.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.width = 2 * width
        self.kv_score = torch.zeros(FWD_T, self.width)
        self.positions = torch.zeros(FWD_T, dtype=torch.int64)
        self.out_buffer = torch.empty(FWD_T, dtype=torch.int64)  # the FlashMLA builder's persistent buffer
        kw = dict(max_num_reqs=FWD_REQS, max_num_batched_tokens=FWD_T, pin_memory=False, device=torch.device("cpu"),
                  cp_kv_cache_interleave_size=1)  # fmt: skip
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
        from vllm.forward_context import set_forward_context
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
            for i in range(len(items), FWD_REQS):
                table.clear_row(i)
        if reqs > len(items):  # a padded request: no rows, the null block
            qsl.append(row)
            seq_lens.append(0)
        # a padded row's position repeats a real one (stale buffer contents look real): only its -1 slots say
        self.positions[actual:padded] = self.positions[: padded - actual] if padded - actual <= actual else 3
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        for table in (self.state_table, self.k_table):
            table.commit_block_table(reqs)
            table.compute_slot_mapping(len(items), qsl_t[: len(items) + 1], self.positions[:actual])
        self.kv_score[:padded] = rows
        num_actual = padded if padding == "full" else actual

        def cam(table):
            return CommonAttentionMetadata(
                query_start_loc=qsl_t, query_start_loc_cpu=qsl_t, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
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
        casts = contextlib.nullcontext() if self.ours else engine_casts_round_to_nearest_even()
        with set_forward_context(attn_metadata, self.config), casts:
            self.module(self.kv_score[:padded], self.positions[:padded], self.rotary_emb)
        step = getattr(state_meta, dsv4_vllm.STEP_ATTR, None)
        if self.ours:  # the ops ran this step (a layer the adapter leaves to vLLM would not build a plan)
            assert step is not None and step.rows == padded and step.owner is self.module
            assert step.decode == (max(n for _, _, n in items) <= MTP + 1)
        else:
            assert step is None
        self.closed |= set(out_slot[out_slot >= 0].tolist())


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
