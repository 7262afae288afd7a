"""The vLLM adapter against the real vLLM 0.33.0 package (``make test-vllm``: ``.venv-vllm``, tests/engines/vllm.txt).

Skips without vLLM. Runs vLLM's own Python and Triton paths on CPU: its ``CompressorMetadataBuilder`` with the
``SlidingWindowMLASpec`` its ``CompressorStateCache`` declares, a real ``VllmConfig``, its
``CommonAttentionMetadata`` and the Triton ``token_to_req_indices`` kernel (under the interpreter). vLLM decides
at import whether Triton is usable from the active GPU drivers; with none (CPU) it swaps Triton for a
placeholder, so on a machine without CUDA this module sets ``CUDA_VISIBLE_DEVICES=""`` before importing vLLM,
the case vLLM accepts with no active driver (a Ray worker's start).
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

compressor = pytest.importorskip("vllm.models.deepseek_v4.compressor", reason="vLLM 0.33 is not installed")

from vllm.config import DeviceConfig, SchedulerConfig, VllmConfig, set_current_vllm_config  # noqa: E402
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
        metadata = builder.build(0, cam)
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
    build_plan = dsv4_vllm.ops.build_plan

    def recording_build_plan(plan, positions, row_req, out_slot, **kwargs):
        calls.append((out_slot.data_ptr(), out_slot.tolist()))
        return build_plan(plan, positions, row_req, out_slot, **kwargs)

    monkeypatch.setattr(dsv4_vllm.ops, "build_plan", recording_build_plan)
    with dsv4_vllm.install():
        builder = compressor.CompressorMetadataBuilder(spec, [state.prefix], config, torch.device("cpu"))
        planner = builder._dsv4c_planner
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
        metadata = builder.build(0, cam)
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
