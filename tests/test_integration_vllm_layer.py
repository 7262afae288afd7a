"""The vLLM adapter's planner and layer call (``integrations/vllm/planner.py``, ``layer.py``) on the stand-ins of
vLLM's classes of ``tests/test_integration_vllm.py`` (written from vLLM 0.33's code), CPU unless marked ``gpu``.

What runs here: the ``VllmCompressorPlanner`` without install() (``debug=True`` catches a false decode flag, and
reads nothing on the host while capturing; slot mappings longer than ``token_to_req_indices`` are padding); the
HCA scratch shared by every layer and allocated at model init; the online option's bank view and its memory per
request against vLLM's C128 state; and at vLLM's default sizes (8,192 batched tokens, 1,024 sequences) the
adapter's HCA layer against the bare ops sized for the batch: the same bytes on the CPU, and on a GPU (marker
``gpu``) a CUDA graph of 20 layers within 1.1x of the bare ops' graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.inputs import HCA_SMALL, make_params, random_rows
from test_integration_vllm import MAX_T, MTP, POISON, CommonAttentionMetadata, VllmWorld, make_vllm

from dsv4_compressor.errors import OpError
from dsv4_compressor.integrations import vllm as dsv4_vllm


# ---------------------------------------------------------------------------------------------------------------
# Planner and layer call without install(); the online option's memory
# ---------------------------------------------------------------------------------------------------------------
def test_debug_planner_catches_a_false_decode_flag():
    """``debug=True`` checks every plan on the device: a step that brings more than mtp + 1 rows of a request
    under ``decode=True`` (a uniform-decode claim that is false) is refused with check_plan's message."""
    planner = dsv4_vllm.VllmCompressorPlanner(
        block_size=4, window=8, max_num_tokens=16, max_num_reqs=2, device="cpu", mtp_step=MTP, debug=True
    )
    positions = torch.arange(9, dtype=torch.int64)
    req = torch.zeros(9, dtype=torch.int32)
    block_table = torch.arange(1, 4, dtype=torch.int32)[None].repeat(2, 1)
    slots = (block_table[0].long()[positions // 4] * 4 + positions % 4).contiguous()
    out_slot = torch.where(positions % 4 == 3, positions // 4, -1)
    planner.begin_step(decode=False).build(positions, req, block_table, slots, out_slot, ratio=4)
    with pytest.raises(OpError, match="9 rows"):
        planner.begin_step(decode=True).build(positions, req, block_table, slots, out_slot, ratio=4)


def _small_step(rows: int = 9):
    positions = torch.arange(rows, dtype=torch.int64)
    req = torch.zeros(rows, dtype=torch.int32)
    block_table = torch.arange(1, 4, dtype=torch.int32)[None].repeat(2, 1)
    slots = (block_table[0].long()[positions // 4] * 4 + positions % 4).contiguous()
    out_slot = torch.where(positions % 4 == 3, positions // 4, -1)
    return positions, req, block_table, slots, out_slot


def test_debug_planner_reads_nothing_on_the_host_while_capturing(monkeypatch):
    """``install(debug=True)`` under CUDA-graph capture: the check runs on the device and no host read (a sync,
    illegal in a capture) happens; the first error a replay finds is raised by the next eager build."""
    planner = dsv4_vllm.VllmCompressorPlanner(
        block_size=4, window=8, max_num_tokens=16, max_num_reqs=2, device="cpu", mtp_step=MTP, debug=True
    )
    positions, req, block_table, slots, out_slot = _small_step()
    reads = []
    real_plan_error = dsv4_vllm.ops.plan_error
    monkeypatch.setattr(dsv4_vllm.ops, "plan_error", lambda err: reads.append(1) or real_plan_error(err))
    monkeypatch.setattr(dsv4_vllm.planner, "_capturing", lambda device: True)
    planner.begin_step(decode=True).build(positions, req, block_table, slots, out_slot, ratio=4)  # a bad plan
    assert reads == [], "a host read of the check's result inside a capture"
    assert int(planner.captured_err[0]) != 0  # kept on the device
    monkeypatch.setattr(dsv4_vllm.planner, "_capturing", lambda device: False)
    with pytest.raises(OpError, match="9 rows.*CUDA graph replay"):
        planner.begin_step(decode=False).build(positions, req, block_table, slots, out_slot, ratio=4)
    planner.begin_step(decode=False).build(positions, req, block_table, slots, out_slot, ratio=4)  # cleared


def test_state_slot_mapping_longer_than_token_to_req_indices():
    """vLLM's V1 runner pads the slot mappings but not ``token_to_req_indices`` when a backend updates the KV
    cache outside forward (``forward_includes_kv_cache_update=False``): the extra rows are padding (slot -1),
    planned as such, as vLLM's kernels treat them."""
    planner = dsv4_vllm.VllmCompressorPlanner(
        block_size=4, window=8, max_num_tokens=16, max_num_reqs=2, device="cpu", mtp_step=MTP
    )
    positions, req, block_table, slots, out_slot = _small_step(9)
    padded = 12
    positions = torch.cat([positions, torch.zeros(3, dtype=torch.int64)])
    slots = torch.cat([slots, torch.full((3,), -1, dtype=torch.int64)])
    out_slot = torch.cat([out_slot, torch.full((3,), -1, dtype=torch.int64)])
    planner.row_req.fill_(7)  # whatever an earlier step left
    step = planner.begin_step(decode=False).build(positions, req, block_table, slots, out_slot, ratio=4)
    assert step.rows == padded
    assert planner.row_req[:9].tolist() == [0] * 9 and planner.row_req[9:padded].tolist() == [-1] * 3
    with pytest.raises(OpError, match="positions has 9 rows"):
        planner.begin_step(decode=False).build(positions[:9], req, block_table, slots, out_slot, ratio=4)


def test_hca_scratch_is_shared_and_allocated_at_model_init(monkeypatch):
    """Every HCA layer gets the one ``[max_num_batched_tokens, H]`` fp32 scratch when it is built (model init:
    before vLLM's profile_run sizes the KV cache), and no forward allocates one; a layer built before install()
    keeps vLLM's forward (with a warning) rather than allocating late."""
    monkeypatch.setattr(dsv4_vllm.layer, "_SHARED_SCRATCH", {})
    world = VllmWorld("hca", seed=4, layers=3)
    try:
        scratches = [dsv4_vllm.layer._scratch(layer.module) for layer in world.layers]
        assert all(t is not None for t in scratches), "no scratch at init"
        assert len({t.data_ptr() for t in scratches}) == 1, "one scratch per layer, not shared"
        assert tuple(scratches[0].shape) == (MAX_T, HCA_SMALL.head_dim) and scratches[0].dtype == torch.float32
        before = dict(dsv4_vllm.layer._SHARED_SCRATCH)
        world.begin("A")
        world.step([("A", 0, 19)])
        world.check("hca shared scratch")
        assert dsv4_vllm.layer._SHARED_SCRATCH == before
        assert all(dsv4_vllm.layer._scratch(layer.module) is scratches[0] for layer in world.layers)
        late = world.layers[0].module
        del late._dsv4c_scratch  # as if built before install()
        late.original_calls = 0
        world.begin("B")
        with pytest.warns(UserWarning, match="built before install"):
            late.forward(world.layers[0].kv_score[:8], world.positions[:8], world.layers[0].rotary_emb)
        assert late.original_calls == 1 and dsv4_vllm.layer._scratch(late) is None
    finally:
        world.installation.uninstall()


def test_online_bank_view_takes_padded_blocks():
    """vLLM's view of a request-scoped group strides its blocks by the whole packed block: the banks come back
    as a view with that stride; a block whose floats are not exactly its banks, contiguous, is refused."""
    good = torch.zeros(5, 4, 384)
    assert dsv4_vllm.online_bank_view(good, 4, 128).shape == (5, 4, 3, 128)
    padded = torch.zeros(5, 4 * 384 + 144)[:, : 4 * 384].view(5, 4, 384)  # a block padded past its banks
    view = dsv4_vllm.online_bank_view(padded, 4, 128)
    assert view.shape == (5, 4, 3, 128) and view.stride() == (4 * 384 + 144, 384, 128, 1)
    assert view.data_ptr() == padded.data_ptr()
    for wrong in (torch.zeros(5, 3, 384), torch.zeros(5, 384, 4).transpose(1, 2)):
        with pytest.raises(OpError, match="contiguous floats"):
            dsv4_vllm.online_bank_view(wrong, 4, 128)


def test_online_hca_memory_per_request():
    """The online option's state against vLLM's C128 state at V4 shapes, mtp_step 3: 131 positions in 17-18
    blocks of 8 rows of 1,024 fp32 (32,768 bytes, 32,832 padded to 576) against 4 banks x 3 x 512 fp32."""
    m = dsv4_vllm.online_hca_state_bytes()
    assert m["positions"] == 131 and m["page_bytes"] == 32832 and (m["blocks_min"], m["blocks_max"]) == (17, 18)
    assert (m["vllm_min"], m["vllm_max"], m["online"]) == (558144, 590976, 24576)
    assert (m["saved_min"], m["saved_max"]) == (533568, 566400)
    assert 22 < m["vllm_min"] / m["online"] < m["vllm_max"] / m["online"] < 25


# ---------------------------------------------------------------------------------------------------------------
# vLLM's default sizes: the adapter's layer against the bare ops at the same batch
# ---------------------------------------------------------------------------------------------------------------
#: vLLM 0.33's defaults on an H100 / H200 API server (``EngineArgs.get_batch_defaults``): 8,192 batched tokens,
#: 1,024 sequences (1,024 on B200-class too).
DEFAULT_TOKENS, DEFAULT_SEQS = 8192, 1024


class DefaultSizedHca:
    """``layers`` HCA layers at DeepSeek-V4 shapes inside the stand-in vLLM classes sized as vLLM sizes them by
    default (``max_num_batched_tokens`` 8,192, ``max_num_seqs`` 1,024, no MTP), on a decode batch of ``batch``
    requests that each close a group (position 255), and the same step on the bare ops sized for the batch (a
    plan of ``batch`` requests and ``batch`` rows). Each path has its own copy of every layer's state and pages,
    filled alike: :meth:`adapter` and :meth:`bare` run one step (every layer) and may be captured."""

    def __init__(self, batch: int, layers: int, device: str):
        from dsv4_compressor import CompressorConfig, ops

        self.ops, dev = ops, torch.device(device)
        cfg = self.cfg = CompressorConfig.hca()
        self.batch, bs, page = batch, dsv4_vllm.VLLM_STATE_BLOCK_SIZE[128], 2  # 256-token KV blocks: 2 entries
        position = 255
        per_req = (position + 1) // bs  # state blocks of positions 0..255
        gen = torch.Generator().manual_seed(batch)
        self.vllm = make_vllm()
        self.context = SimpleNamespace(attn_metadata=None)
        self.installation = dsv4_vllm.install(
            compressor_cls=self.vllm.DeepseekCompressor, builder_cls=self.vllm.CompressorMetadataBuilder,
            get_forward_context=lambda: self.context,
        )  # fmt: skip
        config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_batched_tokens=DEFAULT_TOKENS, max_num_seqs=DEFAULT_SEQS),
            speculative_config=None,
        )
        spec = SimpleNamespace(block_size=bs, sliding_window=cfg.ratio)
        self.builder = self.vllm.CompressorMetadataBuilder(spec, ["state"], config, dev)
        table = 1 + torch.arange(batch * per_req, dtype=torch.int32).view(batch, per_req)
        self.block_table = table.to(dev)
        positions = torch.full((batch,), position, dtype=torch.int64)
        slots = table[:, position // bs].long() * bs + position % bs
        out_slot = (1 + torch.arange(batch)) * page + (position // cfg.ratio) % page  # each request's own page
        self.positions, self.slot_mapping, self.out_slot = positions.to(dev), slots.to(dev), out_slot.to(dev)
        state_blocks, pages = 1 + batch * per_req, 1 + batch
        p = make_params(cfg, seed=1, max_positions=512, norm_dtype=torch.bfloat16).to(dev)
        self.p = p
        self.cos_sin = torch.cat([p.cos, p.sin], dim=1)
        self.kv_score = [random_rows(batch, cfg, gen, dev) for _ in range(layers)]
        states = [torch.randn(state_blocks, bs, cfg.row_width, generator=gen).to(dev) for _ in range(layers)]
        self.states = {"adapter": states, "bare": [s.clone() for s in states]}
        record = cfg.record_data_bytes + cfg.record_scale_bytes
        kv = [torch.full((pages, page, record), POISON, dtype=torch.uint8, device=dev) for _ in range(layers)]
        self.kv = {"adapter": kv, "bare": [k.clone() for k in kv]}
        self.modules = [
            self.vllm.DeepseekCompressor(
                prefix=f"model.layers.{i}.attn.compressor",
                compress_ratio=cfg.ratio,
                head_dim=cfg.head_dim,
                rope_head_dim=cfg.rope_dim,
                rms_norm_eps=p.eps,
                overlap=False,
                coff=1,
                ape=p.ape.clone(),
                norm=SimpleNamespace(weight=p.norm_weight),
                use_fp4_cache=False,
                state_cache=SimpleNamespace(prefix="state", kv_cache=self.states["adapter"][i]),
                k_cache_prefix="k",
                max_num_batched_tokens=DEFAULT_TOKENS,
                device=dev,
                _compress_scratch=None,
                _static_forward_context={"k": SimpleNamespace(kv_cache=self.kv["adapter"][i])},
            )  # fmt: skip
            for i in range(layers)
        ]
        self.rotary = SimpleNamespace(cos_sin_cache=self.cos_sin)
        cam = CommonAttentionMetadata(
            query_start_loc_cpu=torch.arange(batch + 1), num_reqs=batch, num_actual_tokens=batch, max_query_len=1,
            slot_mapping=self.slot_mapping, block_table_tensor=self.block_table,
            stale_tail=torch.zeros(DEFAULT_TOKENS, dtype=torch.int32, device=dev),
        )  # fmt: skip
        state_meta = self.builder.build(0, cam)
        self.context.attn_metadata = {"state": state_meta, "k": SimpleNamespace(slot_mapping=self.out_slot)}
        # the bare ops' buffers, sized for the batch
        self.plan = ops.empty_plan(batch, batch, cfg.ratio, dev)
        self.row_req = torch.arange(batch, dtype=torch.int32, device=dev)
        self.read_rows = torch.full((batch, cfg.window - 1), -1, dtype=torch.int64, device=dev)
        self.save_rows = torch.full((batch,), -1, dtype=torch.int64, device=dev)
        self.scratch = torch.empty(batch, cfg.head_dim, device=dev)

    def adapter(self) -> None:
        for module, kv_score in zip(self.modules, self.kv_score):
            module.forward(kv_score, self.positions, self.rotary)

    def bare(self) -> None:
        ops, cfg, half = self.ops, self.cfg, self.cos_sin.shape[1] // 2
        ops.build_plans(
            [self.plan], self.positions, self.row_req, [self.out_slot], ratios=[cfg.ratio], num_slots=self.batch,
            read_rows=self.read_rows, save_rows=self.save_rows, state_mode="block_table", block_table=self.block_table,
            block_size=dsv4_vllm.VLLM_STATE_BLOCK_SIZE[128],
        )  # fmt: skip
        for kv_score, state, kv in zip(self.kv_score, self.states["bare"], self.kv["bare"]):
            ops.compress(
                kv_score, self.plan, self.p.ape.view(cfg.ratio, 1, cfg.head_dim), self.p.norm_weight,
                self.cos_sin[:, :half], self.cos_sin[:, half:], state, kv.view(kv.shape[0], -1), kind="hca",
                page_size=kv.shape[1], eps=self.p.eps, decode=True, scratch=self.scratch, read_rows=self.read_rows,
                save_rows=self.save_rows,
            )  # fmt: skip

    def same_bytes(self) -> None:
        for i in range(len(self.modules)):
            for name in ("states", "kv"):
                a, b = self.getbytes(name, "adapter", i), self.getbytes(name, "bare", i)
                assert torch.equal(a, b), f"layer {i} {name}: the adapter and the bare ops wrote different bytes"
        assert (self.kv["bare"][0] != POISON).any()  # something was written

    def getbytes(self, name: str, path: str, i: int) -> torch.Tensor:
        return getattr(self, name)[path][i].contiguous().view(torch.uint8).cpu()


def test_at_vllms_default_sizes_the_adapter_writes_what_the_bare_ops_write(monkeypatch):
    """The fixture of the GPU comparison below on the CPU: at vLLM's default sizes, one decode step of 2
    requests through the adapter and through the bare ops sized for the batch writes the same bytes, and the
    adapter's plan has the batch's capacity (the tiled kernel's one-launch decode path), not ``max_num_seqs``."""
    monkeypatch.setattr(dsv4_vllm.layer, "_SHARED_SCRATCH", {})
    world = DefaultSizedHca(batch=2, layers=2, device="cpu")
    try:
        world.adapter()
        world.bare()
        step = getattr(world.context.attn_metadata["state"], dsv4_vllm.STEP_ATTR)
        assert step.decode_path and step.plan.shape[0] == 2 and step.rows == 2
        world.same_bytes()
    finally:
        world.installation.uninstall()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 8, 64, 128])
def test_at_vllms_default_sizes_the_adapters_hca_layer_costs_what_the_bare_ops_cost(batch, monkeypatch):
    """Warm, as vLLM runs decode (a FULL CUDA graph): one graph of a decode step of 20 HCA layers at V4 shapes
    through the adapter at vLLM's default sizes (8,192 tokens, 1,024 sequences), against one graph of the bare
    ops sized for the batch (one plan build, 20 compresses); replay medians over 200 replays. The adapter's
    step also copies and masks ``token_to_req_indices`` (three small torch ops). Target: at most 1.1x."""
    from benchmarks.timing import CudaTimer

    monkeypatch.setattr(dsv4_vllm.layer, "_SHARED_SCRATCH", {})
    world = DefaultSizedHca(batch=batch, layers=20, device="cuda")
    try:
        world.adapter()  # warm-up: compiles the kernels
        world.bare()
        torch.cuda.synchronize()
        world.same_bytes()
        timer = CudaTimer()
        medians = {}
        for name in ("adapter", "bare"):
            replay = timer.capture(getattr(world, name))
            samples = timer.time([replay], replays=200, warmup=20, queue_ahead=True)
            medians[name] = float(np.median(samples))
        ratio = medians["adapter"] / medians["bare"]
        print(f"\nvLLM defaults, HCA x20, B={batch}: adapter {medians['adapter']:.2f} us, bare ops "
              f"{medians['bare']:.2f} us, {ratio:.3f}x ({torch.cuda.get_device_name()})")  # fmt: skip
        assert ratio <= 1.1, f"B={batch}: the adapter's step costs {ratio:.2f}x the bare ops' ({medians})"
    finally:
        world.installation.uninstall()
