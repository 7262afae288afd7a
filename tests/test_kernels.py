"""Every Triton kernel, launched directly through its launcher, against PyTorch / the reference (small shapes).

On a machine without CUDA the kernels run under the Triton interpreter on CPU tensors. The interpreter
mis-rounds float32 -> float8e4nv casts (SPEC section 9), so the kernels encode FP8 with integer arithmetic
there (``exact_fp8``, the CPU default); these tests check that path byte for byte against PyTorch's casts and
never loosen a tolerance. The hardware path is compared with the exact path on the GPU (tests/test_gpu.py).

Inputs are poisoned before each launch (pool bytes ``0xA5``, ring and scratch NaN), so unwritten bytes and
rows read by mistake are caught; every step carries padding rows (``row_req = -1`` at a closing position with
output slot 0) and a spare plan request record, which must do nothing in every kernel. Each kernel is checked
on fresh random rows against the float64 reference (:class:`helpers.model.StreamModel`).
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers.buffers import PAD_F32, POISON_BYTE, POISON_F32, fill_bits, pack_args, poison_cache, raw, step_meta
from helpers.checks import check_outputs, check_ring
from helpers.inputs import CSA_SMALL, HCA_SMALL, INDEXER_CFG, e4m3_probe_inputs, make_cache, make_params, random_rows
from helpers.model import StreamModel
from helpers.session import kernel_device

from dsv4_compressor import layout, ops, reference, verify
from dsv4_compressor.config import CompressorConfig
from dsv4_compressor.errors import OpError
from dsv4_compressor.kernels.c128_tiled import launch_c128_tiled
from dsv4_compressor.kernels.entry_pack import entry_args, pack_values
from dsv4_compressor.kernels.fused_compress import launch_compress_single
from dsv4_compressor.kernels.indexer_pack import indexer_fp8_pack
from dsv4_compressor.kernels.numerics import bf16_rne, e4m3_byte, pow2, ue8m0_exponent
from dsv4_compressor.kernels.plan import REC as PLAN_REC
from dsv4_compressor.kernels.plan import PlanRef, closing_capacity
from dsv4_compressor.kernels.ring import ApeRef, KvRef, StateMeta, launch_ring_save

DEV = kernel_device()
KINDS = [HCA_SMALL, CSA_SMALL, INDEXER_CFG]


# ----------------------------------------------------------------------------------------------
# Numerics: the integer rounding helpers every kernel encodes with
# ----------------------------------------------------------------------------------------------
@triton.jit
def _e4m3_probe(x_ptr, out_ptr, n, EXACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, e4m3_byte(x, EXACT), mask=m)


@triton.jit
def _bf16_probe(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, bf16_rne(tl.load(x_ptr + offs, mask=m, other=0.0)), mask=m)


@triton.jit
def _ue8m0_probe(x_ptr, k_ptr, e_ptr, p_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(e_ptr + offs, ue8m0_exponent(tl.load(x_ptr + offs, mask=m, other=1.0)), mask=m)
    tl.store(p_ptr + offs, pow2(tl.load(k_ptr + offs, mask=m, other=0)), mask=m)


def _launch_1d(kernel, n, *args, block=1024, **meta):
    kernel[(triton.cdiv(n, block),)](*args, n, BLOCK=block, **meta)


def test_e4m3_exact_matches_torch_cast_byte_for_byte():
    x = e4m3_probe_inputs()
    assert bool((x == torch.tensor(-31.46)).any()), "the probe must include the interpreter's known bad case"
    out = torch.full(x.shape, 0xEE, dtype=torch.uint8, device=DEV)
    _launch_1d(_e4m3_probe, x.numel(), x.to(DEV), out, EXACT=True)
    got = out.cpu()
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero()[:, 0]
    assert len(bad) == 0, f"{len(bad)}/{x.numel()} e4m3 bytes differ from torch's cast, e.g. " + ", ".join(
        f"{x[i].item()!r}: {got[i].item():#04x} != {want[i].item():#04x}" for i in bad[:8].tolist()
    )


def test_bf16_rne_matches_torch():
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (60000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[torch.isfinite(x)]
    # ties with an even and an odd kept bit, and values that round up across an exponent
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F7FFFFF, 0x3F7F8000, 0x7F7F7FFF], dtype=torch.int64)
    ties = ties.where(ties < 2**31, ties - 2**32).to(torch.int32).view(torch.float32)
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1.0, -3.0e38])]).contiguous()
    out = torch.empty_like(x).to(DEV)
    _launch_1d(_bf16_probe, x.numel(), x.to(DEV), out)
    want = x.to(torch.bfloat16).float()
    bad = (raw(out.cpu()) != raw(want)).view(-1, 4).any(dim=1).nonzero()[:, 0]
    assert len(bad) == 0, f"bf16 rounding differs for {[x[i].item() for i in bad[:8].tolist()]}"


def test_ue8m0_exponent_and_pow2_match_layout():
    p2 = torch.tensor([448.0 * 2.0**k for k in range(-20, 21)])
    near = torch.cat([p2, torch.nextafter(p2, torch.zeros_like(p2)), torch.nextafter(p2, p2 * 2)])
    gen = torch.Generator().manual_seed(2)
    rand = torch.exp2(torch.rand(5000, generator=gen) * 60 - 30)
    amax = torch.cat([near, rand, torch.tensor([0.0, 1e-5, 1e-4, 1.0001e-4, 448.0])]).float().contiguous()
    k = torch.randint(-126, 128, (amax.numel(),), generator=gen, dtype=torch.int32)
    k[:254] = torch.arange(-126, 128, dtype=torch.int32)
    e = torch.empty(amax.shape, dtype=torch.int32, device=DEV)
    p = torch.empty(amax.shape, dtype=torch.float32, device=DEV)
    _launch_1d(_ue8m0_probe, amax.numel(), amax.to(DEV), k.to(DEV), e, p)
    want = layout.ue8m0_exponent(amax)
    bad = (e.cpu() != want).nonzero()[:, 0]
    assert len(bad) == 0, f"ue8m0 exponent differs for amax {[amax[i].item() for i in bad[:8].tolist()]}"
    assert torch.equal(p.cpu(), torch.exp2(k.double()).float()), "pow2(k) is not exactly 2**k"


# ----------------------------------------------------------------------------------------------
# The plan every kernel reads
# ----------------------------------------------------------------------------------------------
def test_plan_records_and_padding():
    """``ops.build_plan`` from engine metadata: per-row records (position, slot, start, row0, end, out_slot,
    request index), request records, the closing-row list, and padding (rows and records) marked ``-1``."""
    r, p = 4, 2
    positions = [3, 4, 6, 7, 8, 9, 3, 3, 3]  # requests of slot 2 (start 3) and slot 0 (start 6), 3 padding rows
    row_req = [2, 2, 0, 0, 0, 0, -1, 3, -1]  # padding: -1, or num_slots
    out_slot = [2 * p + 0, 0, 0, 5 * p + 1, 0, 0, 0, 0, 0]  # closing rows carry their slot, the rest the engines' 0
    plan = ops.empty_plan(9, 3, r, DEV)
    meta = torch.tensor([positions, row_req, out_slot], dtype=torch.int32, device=DEV)
    ops.build_plan(plan, *meta, ratio=r, num_slots=3)
    flat = plan.view(-1).cpu()
    T, R = 9, 3
    header = flat[:8].tolist()
    requests = flat[8 : 8 + 8 * R].view(R, 8).tolist()
    rows = flat[8 + 8 * R : 8 + 8 * (R + T)].view(T, 8)
    closing = flat[8 + 8 * (R + T) : 8 + 8 * (R + T + closing_capacity(T, R, r))].view(-1, 8).tolist()
    assert header == [T, R, r, 3, 2, 2, 6, 0]  # rows, capacity, ratio, slots, requests, closing, valid rows, flags
    assert rows[:, 0].tolist() == positions
    assert rows[:, 1].tolist() == [2, 2, 0, 0, 0, 0, -1, -1, -1]
    assert rows[:6, 2].tolist() == [3, 3, 6, 6, 6, 6]
    assert rows[:6, 3].tolist() == [0, 0, 2, 2, 2, 2]
    assert rows[:6, 4].tolist() == [5, 5, 10, 10, 10, 10]
    # position 3 closes group 0 of slot 2 (page 2, slot 0); position 7 group 1 of slot 0 (page 5, slot 1)
    assert rows[:, 5].tolist() == [2 * p, -1, -1, 5 * p + 1, -1, -1, -1, -1, -1]
    assert rows[:, 6].tolist() == [0, 0, 1, 1, 1, 1, -1, -1, -1]
    # request records: first row, slot, start, row0, end, out_slot of the first group closed in the step, index
    assert [q[:7] for q in requests] == [[0, 2, 3, 0, 5, 2 * p, 0], [2, 0, 6, 2, 10, 5 * p + 1, 1], [-1] * 7]
    # closing rows: row, position, slot, start, row0, end, out_slot, request index; then -1 records
    assert closing[:2] == [[0, 3, 2, 3, 0, 5, 2 * p, 0], [3, 7, 0, 6, 2, 10, 5 * p + 1, 1]]
    assert all(c == [-1] * 8 for c in closing[2:]) and len(closing) == T // r + R
    with pytest.raises(OpError, match=r"plan holds \d+ ints; a step of 9 rows and 1 requests"):
        ops.build_plan(ops.empty_plan(4, 1, r, DEV), *meta, ratio=r, num_slots=3)


# ----------------------------------------------------------------------------------------------
# Step set-up shared by the direct kernel tests
# ----------------------------------------------------------------------------------------------
class Direct:
    """A cache used only for its pool, ring and parameters; steps are planned and launched by hand.

    ``history`` puts requests at lengths ``L`` with their last ring rows saved (as a previous step would have
    left them: ``[kv | score + ape]``, or the bare ``[kv | score]`` with ``state_ape=False``, SGLang's rows);
    ``step`` reserves pages, builds a padded plan and updates the model; ``args`` gives the launchers' grouped
    arguments."""

    def __init__(self, cfg, *, mtp_step=2, seed=0, max_requests=4, max_seq_len=256, params_opts=None,
                 state_ape=True, **kw):  # fmt: skip
        self.cfg = cfg
        self.params = make_params(cfg, seed=seed, max_positions=512, device=DEV, **(params_opts or {}))
        self.cache = make_cache(cfg, self.params, "triton", max_requests=max_requests, max_seq_len=max_seq_len,
                                mtp_step=mtp_step, **kw)  # fmt: skip
        poison_cache(self.cache)
        self.model = StreamModel(cfg, self.params, mtp_step)
        self.state_ape = state_ape
        self.gen = torch.Generator().manual_seed(100 + seed)

    @property
    def ring(self):
        return self.cache.backend.ring

    def saved_rows(self, rid: int, pos: list[int]) -> torch.Tensor:
        """What the ring holds for positions ``pos`` of request ``rid``."""
        if self.state_ape:
            return self.model.gated(rid, pos)
        return self.model.rows[rid][torch.tensor(pos, dtype=torch.long)]

    def history(self, rid: int, length: int) -> None:
        rows = random_rows(length, self.cfg, self.gen)
        self.model.rows[rid] = rows
        self.model.retained[rid] = max(0, length - self.model.ring)
        pos = self.model.live_ring_positions(rid)
        if pos:
            self.ring[rid, torch.tensor(pos) % self.ring.shape[1]] = self.saved_rows(rid, pos).to(DEV)

    def check_ring(self, what: str) -> None:
        """Live ring rows hold what :meth:`saved_rows` says, bit for bit."""
        if self.state_ape:
            check_ring(self.cache, self.model, what)
            return
        for rid in self.model.live():
            pos = self.model.live_ring_positions(rid)
            got = self.ring[rid, torch.tensor(pos) % self.ring.shape[1]].cpu()
            assert torch.equal(raw(got), raw(self.saved_rows(rid, pos))), f"{what}: request {rid}'s ring rows"

    def step(self, items, pad: int = 3):
        """``items = [(rid, start, n)]`` -> (kv_score on DEV with ``pad`` padding rows, plan, host metadata,
        CPU rows)."""
        cfg, pool = self.cfg, self.cache.pool
        host = step_meta(self.cache, items, pad_rows=pad)
        total = sum(n for _, _, n in items)
        plan = ops.empty_plan(total + pad, len(items) + 1, cfg.ratio, DEV)
        ops.build_plan(plan, *torch.from_numpy(host).to(DEV), ratio=cfg.ratio, num_slots=self.cache.max_requests)
        rows = random_rows(total, cfg, self.gen)
        kv = fill_bits(torch.empty(total + pad, cfg.row_width), PAD_F32)
        kv[:total] = rows
        row = 0
        for rid, start, n in items:
            self.model.apply(rid, start, rows[row : row + n], pool)
            row += n
        return kv.to(DEV), plan, host, rows

    def args(self, kv, plan, *, ape="flat", state=None):
        """The launchers' grouped arguments: ``(kv, state, ape, plan, prm, out, meta, sm)``. ``ape``: ``"flat"``
        (``[r, W]``) or ``"permuted"`` (SGLang: memory ``[coff, r, H]`` seen as an ``[r, coff, H]`` view);
        ``state``: the ring (default) or a 2-D ``[rows, 2W]`` tensor addressed ``slot * ring + p % ring``."""
        cfg, p, pool = self.cfg, self.params, self.cache.pool
        coff = 2 if cfg.overlap else 1
        if ape == "flat":
            ape_ref = ApeRef(p.ape, p.ape.stride(0), cfg.head_dim * p.ape.stride(1), p.ape.stride(1))
        else:
            view = p.ape.view(cfg.ratio, coff, cfg.head_dim).permute(1, 0, 2).contiguous().permute(1, 0, 2)
            assert torch.equal(view.reshape(cfg.ratio, -1), p.ape)
            assert view.stride(0) == cfg.head_dim and (coff == 1 or view.stride(1) == cfg.ratio * cfg.head_dim)
            ape_ref = ApeRef(view, view.stride(0), view.stride(1), view.stride(2))
        # The state's grouped arguments exactly as ops.compress builds them (the kernels' StateRef / StateMeta
        # are internal and evolve; this is the one place that knows them).
        ring = self.ring
        target = ring if state is None else state
        state_ref, ring_rows, rows_per_block = ops._state(
            "test_kernels", target, None, None, None if state is None else ring.shape[1], ops.plan_info(plan),
            width=cfg.width, window=cfg.window, decode=False, device=target.device,
        )  # fmt: skip
        assert ring_rows == ring.shape[1]
        sm = StateMeta(RING=ring_rows, TABLE=False, HAS_APE=self.state_ape, RPB=rows_per_block)
        prm, out, meta = entry_args(
            head=cfg.head_dim, rope=cfg.rope_dim, latent=cfg.output == "latent", page_size=pool.page_size,
            scale_bytes=cfg.record_scale_bytes, norm_weight=p.norm_weight, cos=p.cos, sin=p.sin, eps=p.eps,
            out_pages=pool.out_pages, out_keys=pool.out_keys, exact_fp8=True,
        )  # fmt: skip
        plan_ref = PlanRef(plan, kv.shape[0], plan.shape[0])
        return KvRef(kv, kv.stride(0)), state_ref, ape_ref, plan_ref, prm, out, meta, sm


class Written:
    """A model that says exactly which values were written where (for :func:`check_outputs`)."""

    def __init__(self, written: dict):
        self.written = written

    def written_values(self):
        slots = sorted(self.written)
        assert slots, "nothing written"
        return slots, torch.stack([self.written[s] for s in slots])


# Requests of the direct kernel tests, per ratio: slot 0 continues mid-group with a chunk that closes two
# groups (the first window straddles ring and new rows), slot 1 decodes a few rows across a boundary after
# a rewind, slot 3 starts fresh with a chunk longer than the ring.
def _layout_items(r: int, ring: int):
    history = {0: r + r // 2 + 1, 1: 3 * r - 1}
    items = [(0, history[0], 2 * r), (1, history[1] - 2, 3), (3, 0, ring + r + 1)]
    return history, items


def _expected_ring(d: Direct, before: torch.Tensor, items) -> torch.Tensor:
    """The ring after saving each request's last ``min(n, ring)`` rows of the step (:meth:`Direct.saved_rows`)."""
    want = before.clone()
    ring_len = want.shape[1]
    for rid, start, n in items:
        pos = list(range(max(start, start + n - ring_len), start + n))
        want[rid, torch.tensor(pos) % ring_len] = d.saved_rows(rid, pos)
    return want


# ----------------------------------------------------------------------------------------------
# ring_save
# ----------------------------------------------------------------------------------------------
RING_SAVE = [("3d", "flat", True), ("2d_padded", "flat", True), ("3d", "permuted", True), ("3d", "flat", False)]


@pytest.mark.parametrize(
    "state_layout,ape,state_ape", RING_SAVE, ids=[f"{s}-{a}-{'ape' if h else 'bare'}" for s, a, h in RING_SAVE]
)
@pytest.mark.parametrize("cfg", KINDS, ids=lambda c: c.name)
def test_ring_save_matches_torch(cfg, state_layout, ape, state_ape):
    """``launch_ring_save``: each request's last ``min(n, ring)`` rows land in its ring, bit for bit, as
    ``[kv | score + ape]`` (a flat or a strided, permuted-memory APE) or as the bare ``[kv | score]`` of an
    APE-less state; in a 3-D ring or LightLLM's 2-D state with spare rows after the last slot (which stay
    poison). ``kv_score`` and padding rows are left alone, and no entry is written."""
    d = Direct(cfg, state_ape=state_ape)
    history, items = _layout_items(cfg.ratio, d.model.ring)
    for rid, n in history.items():
        d.history(rid, n)
    kv, plan, _, _ = d.step(items)
    slots, ring_len, width2 = d.ring.shape
    state = None
    if state_layout == "2d_padded":  # [(slots + 1) * ring + 1, 2W]: a spare slot's rows and one more row
        state = fill_bits(torch.empty((slots + 1) * ring_len + 1, width2, device=DEV), POISON_F32)
        state[: slots * ring_len] = d.ring.reshape(-1, width2)
    before = d.ring.cpu().clone()
    kv_before = kv.clone()
    k, st, a, pl, *_, sm = d.args(kv, plan, ape=ape, state=state)
    launch_ring_save(k, st, a, pl, sm, ratio=cfg.ratio, head=cfg.head_dim, width=cfg.width)
    assert torch.equal(raw(kv.cpu()), raw(kv_before.cpu())), "ring_save wrote kv_score"
    got = (d.ring if state is None else state[: slots * ring_len].view(slots, ring_len, width2)).cpu()
    want = _expected_ring(d, before, items)
    bad = (raw(got).view(-1, 4) != raw(want).view(-1, 4)).any(dim=1).nonzero()[:, 0]
    if len(bad):
        idx = np.unravel_index(bad[0].item(), got.shape)
        pytest.fail(f"{len(bad)} ring floats differ from the expected save; first at (slot, row, col) {idx}")
    if state is not None:
        spare = state[slots * ring_len :].cpu().view(torch.int32)
        assert bool((spare == POISON_F32).all()), "rows past the last slot's ring were written"
        d.ring.copy_(got)
    d.check_ring("ring_save")
    check_outputs(d.cache, StreamModel(cfg, d.params), "ring_save writes no entry")  # the pool: all poison


# ----------------------------------------------------------------------------------------------
# Entry encoding: pack_values (the encoder every compress kernel ends in) and the indexer FP8 pack
# ----------------------------------------------------------------------------------------------
def _boundary_values(cfg: CompressorConfig, n: int, gen: torch.Generator) -> torch.Tensor:
    """Entry values with nope blocks that sit on every encoding boundary: bf16 ties, FP8 ties, amax exactly at
    and one ulp around ``448 * 2^k`` (scale changes), tiny blocks below the 1e-4 amax floor, zeros, subnormal
    FP8 values, and ordinary random values."""
    v = torch.randn(n, cfg.head_dim, generator=gen) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=gen).float())
    nope = v[:, : cfg.nope_dim].view(n, -1, 64)
    q = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = ((q[1:] + q[:-1]) / 2)[torch.randperm(125, generator=gen)[:63]]
    for i in range(n):
        k = i % 6
        b = nope[i, i % nope.shape[1]]
        if k == 0:  # amax exactly 448: scale 2^0, the other values are FP8 ties
            b[:63] = ties * torch.where(torch.rand(63, generator=gen) < 0.5, -1.0, 1.0)
            b[63] = 448.0
        elif k == 1:  # amax one float32 ulp above 448 * 2^-3 (bf16 rounding brings it back down)
            b[0] = torch.nextafter(torch.tensor(56.0), torch.tensor(100.0))
        elif k == 2:  # amax one bf16 step above 448 * 2^2: the scale moves up
            b[0] = torch.tensor(1792.0).to(torch.bfloat16).float() + 8.0
        elif k == 3:  # below the amax floor: all values are FP8 subnormals or zero after scaling
            b[:] = torch.randn(64, generator=gen) * 1e-6
        elif k == 4:
            b[:] = 0.0
        else:  # bf16 ties: float32 values exactly halfway between two bf16 values
            b[:] = (torch.randn(64, generator=gen).to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(
                torch.float32
            )
    return v.contiguous()


NOPE_3_BLOCKS = CompressorConfig(ratio=8, head_dim=256, rope_dim=64, overlap=False, name="nope_3_blocks")


@pytest.mark.parametrize("cfg", [HCA_SMALL, NOPE_3_BLOCKS, CompressorConfig.hca()], ids=lambda c: c.name)
def test_pack_values_latent_bytes_equal_layout(cfg):
    """The kernels' latent encoder (integer FP8 rounding) equals ``layout.encode_latent`` byte for byte."""
    seq = 12 * cfg.ratio  # 12 entries per request
    cache = make_cache(cfg, make_params(cfg, max_positions=seq), "triton", max_requests=2, max_seq_len=seq)
    poison_cache(cache)
    pool = cache.pool
    n = 20
    assert pool.num_pages * pool.page_size >= n
    vals = _boundary_values(cfg, n, torch.Generator().manual_seed(3))
    slots = torch.randperm(pool.num_pages * pool.page_size, generator=torch.Generator().manual_seed(4))[:n]
    slots[5] = -1  # skipped
    pack_values(vals.to(DEV), slots.to(torch.int32).to(DEV), *pack_args(pool, exact_fp8=True))
    keep = slots >= 0
    got = pool.layout.read(pool.pages, slots[keep].to(DEV)).cpu()
    want = layout.encode_latent(vals[keep], cfg)
    bad = (got != want).nonzero()
    assert len(bad) == 0, f"{len(bad)} bytes differ from layout.encode_latent, first (record, byte) {bad[0].tolist()}"
    written = Written({int(s): vals[i].double() for i, s in enumerate(slots.tolist()) if s >= 0})
    rep = check_outputs(cache, written, "pack_values")  # and every other byte still poison
    assert rep.exact_fraction == 1.0, str(rep)


def test_pack_values_indexer_keys_and_fp8():
    cfg = INDEXER_CFG
    cache = make_cache(cfg, make_params(cfg, max_positions=512), "triton", max_requests=2, max_seq_len=512)
    poison_cache(cache)
    pool = cache.pool
    gen = torch.Generator().manual_seed(5)
    vals = torch.randn(20, cfg.head_dim, generator=gen) * torch.exp2(torch.randint(-6, 6, (20, 1), generator=gen))
    slots = torch.randperm(pool.num_pages * pool.page_size, generator=gen)[:20]
    slots[[0, 7]] = -1
    pack_values(vals.to(DEV), slots.to(torch.int32).to(DEV), *pack_args(pool, exact_fp8=True))
    keep = slots >= 0
    got_keys = pool.keys[slots[keep].to(DEV)].cpu()
    assert torch.equal(raw(got_keys), raw(vals[keep].to(torch.bfloat16))), "bf16 keys differ from a torch cast"
    written = Written({int(s): vals[i].double() for i, s in enumerate(slots.tolist()) if s >= 0})
    rep = check_outputs(cache, written, "pack_values indexer")  # keys, packs, and every other byte poison
    assert rep.exact_fraction >= 0.99, str(rep)


def _dyadic_keys(n: int, h: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 keys of small multiples of 1/8: their Hadamard sums are exact in float32, so the kernel's pack must
    equal ``layout.encode_indexer_fp8`` byte for byte whatever its summation order."""
    return (torch.randint(-64, 65, (n, h), generator=gen).float() / 8).to(torch.bfloat16)


@pytest.mark.parametrize("head,page_size", [(128, 64), (64, 3)])
def test_indexer_fp8_pack_standalone(head, page_size):
    gen = torch.Generator().manual_seed(6)
    num_pages = 2
    num_slots = num_pages * page_size
    keys = torch.randn(num_slots, head, generator=gen).to(torch.bfloat16)
    keys[: num_slots // 2] = _dyadic_keys(num_slots // 2, head, gen)
    slots = torch.randperm(num_slots, generator=gen)[: min(num_slots - 3, 20)].to(torch.int32)
    slots[1] = -1
    pages = torch.full((num_pages, page_size * (head + 4)), POISON_BYTE, dtype=torch.uint8)
    pages_dev = pages.to(DEV)
    indexer_fp8_pack(keys.to(DEV), slots.to(DEV), pages_dev, page_size, exact_fp8=True)
    lay = layout.PageLayout(page_size, head, 4)
    keep = slots[slots >= 0].long()
    got = lay.read(pages_dev, keep.to(DEV)).cpu()
    rep = verify.check_indexer_fp8(got, keys[keep])
    assert rep.ok, str(rep)
    dyadic = keep < num_slots // 2
    want = layout.encode_indexer_fp8(keys[keep][dyadic])
    bad = (got[dyadic] != want).nonzero()
    assert len(bad) == 0, f"exact-sum keys: {len(bad)} bytes differ from layout.encode_indexer_fp8; {rep}"
    assert rep.exact_fraction >= 0.99, str(rep)
    mask = torch.zeros(pages.numel(), dtype=torch.bool)
    for s in keep.tolist():
        base = (s // page_size) * lay.bytes_per_page
        mask[base + lay.data_offset(s % page_size) : base + lay.data_offset(s % page_size) + head] = True
        mask[base + lay.scale_offset(s % page_size) : base + lay.scale_offset(s % page_size) + 4] = True
    assert bool((raw(pages_dev.cpu())[~mask] == POISON_BYTE).all()), "bytes outside the packed slots were written"


def test_indexer_fp8_pack_rejects_bad_inputs():
    """Bad arguments are refused before the launch, naming what is wrong; nothing is written."""
    keys = torch.randn(8, 128).to(torch.bfloat16).to(DEV)
    slots = torch.tensor([3], dtype=torch.int32, device=DEV)
    pages = torch.full((2, 4 * 132), POISON_BYTE, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match=r"keys must be bf16 with a power-of-two width, got torch.float32"):
        indexer_fp8_pack(keys.float(), slots, pages, 4)
    with pytest.raises(ValueError, match=r"pages must be uint8 \[num_pages, 396\], got \[2, 528\]"):
        indexer_fp8_pack(keys, slots, pages, 3)
    assert bool((pages.cpu() == POISON_BYTE).all()), "a refused pack wrote pages"


# ----------------------------------------------------------------------------------------------
# Compress kernels
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ape, launch",
    # the defaults (few requests: the whole window in one load), and the window in row tiles merged by the
    # online softmax (as launched for plans of more than 64 requests) with the other channel tile
    [
        ("flat", {}),
        ("permuted", {}),
        ("flat", dict(block_t=64, tile=64)),
        ("permuted", dict(block_t=16, tile=32)),
        ("flat", dict(tile_major=False)),
    ],
    ids=["flat", "permuted", "flat-bt64-tile64", "permuted-bt16", "flat-record-major"],
)
@pytest.mark.parametrize("cfg", [HCA_SMALL, CompressorConfig.hca()], ids=lambda c: c.name)
def test_two_stage_matches_reference(cfg, ape, launch):
    """The tiled C128 kernel (``launch_c128_tiled``), stage by stage. Stage 1 (``window_compress``): the
    scratch row of each closing row holds its float32 pooled vector (within a few ulps of float64), every other
    scratch row keeps its poison. Stage 2 (``norm_rope_pack``): each entry is the exact finish (RMSNorm, rope,
    FP8 pack) of its scratch row, and the float64 reference's entry within rounding; the step's tail rows are
    saved into the ring."""
    real = cfg.ratio == 128
    d = Direct(cfg, mtp_step=1, max_requests=3, max_seq_len=512)
    r = cfg.ratio
    # slot 0: cached rows 0..r/2+2, a chunk that closes groups 0 (straddling) and 1; slot 2: a fresh request.
    d.history(0, r // 2 + 3)
    items = [(0, r // 2 + 3, 2 * r - r // 2 - 3), (2, 0, r)] if not real else [(0, r // 2 + 3, r // 2 - 3)]
    kv, plan, host, _ = d.step(items)
    T = kv.shape[0]
    scratch = fill_bits(torch.empty(T, cfg.head_dim, device=DEV), POISON_F32)
    k, st, a, pl, prm, out, meta, sm = d.args(kv, plan, ape=ape)
    kv_before = kv.clone()
    launch_c128_tiled(k, st, a, pl, prm, out, meta, sm, scratch, ratio=r,
                      closing=closing_capacity(T, plan.shape[0], r), **launch)  # fmt: skip
    assert torch.equal(raw(kv.cpu()), raw(kv_before.cpu())), "the two-stage kernel wrote kv_score"
    scratch = scratch.cpu()
    closing = np.nonzero(host[2] >= 0)[0].tolist()
    closing = [t for t in closing if t < T - 3]  # padding rows (the last 3) close nothing
    assert len(closing) == (3 if not real else 1)
    finished = {}
    for t in range(T):
        if t not in closing:
            assert bool((scratch[t].view(torch.int32) == POISON_F32).all()), (
                f"scratch row {t} (closes no group) was written"
            )
            continue
        rid, g = int(host[1, t]), int(host[0, t]) // r
        _, pooled = reference.compress_sequence(
            d.model.rows[rid][: (g + 1) * r], d.model.params, cfg, dtype=torch.float64, return_pooled=True
        )
        want = pooled[g]
        err = (scratch[t].double() - want).abs()
        rms = want.pow(2).mean().sqrt()
        # float32 pooling over <= 128 rows: a few ulps; a wrong or stale row, a missing APE bias: O(0.1 * rms)
        bound = 1e-5 * want.abs() + 1e-6 * rms
        assert bool((err <= bound).all()), (
            f"row {t} (request {rid}, group {g}): pooled max err {err.max().item():.3g}, "
            f"worst err/bound {(err / bound).max().item():.3g}"
        )
        # stage 2's input: the float32 scratch row, finished in float64
        finished[int(host[2, t])] = reference.finish_entries(
            scratch[t].double()[None], torch.tensor([g * r]), reference.params_as(d.model.params, torch.float64), cfg
        )[0]
    exact = check_outputs(d.cache, Written(finished), "norm_rope_pack of the scratch rows")
    assert exact.exact_fraction >= 0.999, str(exact)
    rep = check_outputs(d.cache, d.model, "two-stage vs float64")
    assert rep.total_bytes > 0
    d.check_ring("norm_rope_pack ring save")


@pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "two_launches"])
@pytest.mark.parametrize("cfg", [HCA_SMALL, CompressorConfig.hca()], ids=lambda c: c.name)
def test_tiled_decode_matches_reference(cfg, one_launch):
    """The tiled C128 kernel's decode step. In one launch: each closing row's tile programs store their pooled
    channels into its scratch row and count their arrival in the row's plan record, and the last to arrive
    finishes the entry; row programs save the rows. Two steps, the second closing a group at a row index the
    first closed at too, so an arrival count left non-zero would leave that entry unwritten. After each step
    the entries and ring match the reference, the counts are back at zero, and the scratch rows of rows that
    close nothing keep their poison. The same steps in two launches (plans of more requests) leave the same."""
    r, mtp = cfg.ratio, 2
    d = Direct(cfg, mtp_step=mtp, max_requests=4, max_seq_len=512)
    for rid, n in ((0, 2 * r - 2), (1, 3 * r - 1), (2, r + 2), (3, 2 * r - 2)):
        d.history(rid, n)
    steps = [
        # request 0 closes at its middle row (its last row is saved past the window), request 1 at its first
        [(0, 2 * r - 2, mtp + 1), (1, 3 * r - 1, mtp + 1), (2, r + 2, 1)],
        # request 3 closes at row 1 again; the others close nothing
        [(3, 2 * r - 2, 2), (0, 2 * r + 1, 1), (2, r + 3, 1)],
    ]
    for i, items in enumerate(steps):
        kv, plan, host, _ = d.step(items)
        T = kv.shape[0]
        scratch = fill_bits(torch.empty(T, cfg.head_dim, device=DEV), POISON_F32)
        k, st, a, pl, prm, out, meta, sm = d.args(kv, plan)
        launch_c128_tiled(k, st, a, pl, prm, out, meta, sm, scratch, ratio=r, decode=True, one_launch=one_launch,
                          closing=closing_capacity(T, plan.shape[0], r))  # fmt: skip
        closing = [t for t in np.nonzero(host[2] >= 0)[0].tolist() if t < T - 3]
        assert closing == ([1, 3] if i == 0 else [1]), closing
        rep = check_outputs(d.cache, d.model, f"one-launch decode step {i}")
        assert rep.total_bytes > 0 and rep.exact_fraction >= 0.99, str(rep)
        d.check_ring(f"one-launch decode step {i} ring save")
        rec = int(PLAN_REC)
        arrivals = plan.cpu().flatten()[rec * (1 + plan.shape[0]) :][: rec * T].view(T, rec)[:, 7]
        assert not bool(arrivals.any()), f"step {i}: arrival counts left {arrivals.tolist()}"
        untouched = scratch.cpu()[[t for t in range(T) if t not in closing]]
        assert bool((untouched.view(torch.int32) == POISON_F32).all()), f"step {i}: a scratch row closing nothing"


SINGLE_CASES = [(cfg, decode, True) for cfg in KINDS for decode in (False, True)]
SINGLE_CASES += [(CompressorConfig.hca(), True, True), (CSA_SMALL, True, False), (HCA_SMALL, False, False)]


@pytest.mark.parametrize(
    "cfg,decode,state_ape",
    SINGLE_CASES,
    ids=[f"{c.name}-{'decode' if d else 'prefill'}{'' if h else '-bare_state'}" for c, d, h in SINGLE_CASES],
)
def test_compress_single_matches_reference(cfg, decode, state_ape):
    """The single-stage kernel for every kind (and DeepSeek-V4's HCA window of 128 x 512 on a decode step):
    entries of the closing rows, and the in-kernel ring save of decode steps (each request brings at most
    mtp_step + 1 rows); without it the ring is untouched until ``launch_ring_save``. With an APE-less state
    (SGLang's rows) the bias is added to the saved rows on read and not saved."""
    r, mtp = cfg.ratio, 2
    real = cfg.ratio == 128
    d = Direct(cfg, mtp_step=mtp, max_requests=4, max_seq_len=512, state_ape=state_ape)
    if decode:  # three requests decode S rows each: across a boundary, after a rewind, and not closing
        for rid, n in ((0, 2 * r - 2), (1, 3 * r + 1), (2, r + 2)):
            d.history(rid, n)
        items = [(0, 2 * r - 2, mtp + 1), (1, 3 * r - 1, mtp + 1), (2, r + 2, 1)]
        if real:
            items = items[:1]
    else:
        history, items = _layout_items(r, d.model.ring)
        for rid, n in history.items():
            d.history(rid, n)
    kv, plan, _, _ = d.step(items)
    ring_before = d.ring.clone()
    kv_before = kv.clone()
    k, st, a, pl, prm, out, meta, sm = d.args(kv, plan)
    launch_compress_single(k, st, a, pl, prm, out, meta, sm, ratio=r, overlap=cfg.overlap, save_rows=decode)
    assert torch.equal(raw(kv.cpu()), raw(kv_before.cpu())), "the single-stage kernel wrote kv_score"
    rep = check_outputs(d.cache, d.model, f"compress_single {cfg.name}")
    assert rep.total_bytes > 0 and rep.exact_fraction >= 0.99, str(rep)
    if decode:
        d.check_ring("compress_single in-kernel save")
    else:
        assert torch.equal(raw(d.ring.cpu()), raw(ring_before.cpu())), "save_rows=False wrote the ring"
        launch_ring_save(k, st, a, pl, sm, ratio=r, head=cfg.head_dim, width=cfg.width)
        d.check_ring("compress_single + ring_save")


PREFILL_KINDS = [c for c, decode, ape in SINGLE_CASES if not decode and ape]


@pytest.mark.parametrize("closing_grid", [True, False], ids=["closing_grid", "row_grid"])
@pytest.mark.parametrize("cfg", PREFILL_KINDS, ids=[c.name for c in PREFILL_KINDS])
def test_compress_single_prefill_grids_match_reference(cfg, closing_grid):
    """A prefill step of the single-stage kernel launched over the plan's closing list (one program per
    group-closing record, padding records included; the default) and over every row: the same entries, nothing
    else written, the ring untouched. Runs on the GPU too (``kernel_device``):
    ``pytest tests/test_kernels.py -k prefill_grids``."""
    d = Direct(cfg, mtp_step=2, max_requests=4, max_seq_len=512)
    history, items = _layout_items(cfg.ratio, d.model.ring)
    for rid, n in history.items():
        d.history(rid, n)
    kv, plan, host, _ = d.step(items)
    assert int((host[2] >= 0).sum()) >= 3, "the step should close several groups"
    ring_before = d.ring.clone()
    k, st, a, pl, prm, out, meta, sm = d.args(kv, plan)
    launch_compress_single(k, st, a, pl, prm, out, meta, sm, ratio=cfg.ratio, overlap=cfg.overlap, save_rows=False,
                           closing_grid=closing_grid)  # fmt: skip
    rep = check_outputs(d.cache, d.model, f"compress_single closing_grid={closing_grid} {cfg.name}")
    assert rep.total_bytes > 0 and rep.exact_fraction >= 0.99, str(rep)
    assert torch.equal(raw(d.ring.cpu()), raw(ring_before.cpu())), "the closing grid wrote the ring"
    with pytest.raises(ValueError, match="closing_grid"):
        launch_compress_single(k, st, a, pl, prm, out, meta, sm, ratio=cfg.ratio, overlap=cfg.overlap,
                               save_rows=True, closing_grid=True)  # fmt: skip


REQUEST_SAVE_CASES = [(cfg, state_ape) for cfg in PREFILL_KINDS for state_ape in (True, False)]


@pytest.mark.parametrize("closing_grid", [True, False], ids=["closing_grid", "row_grid"])
@pytest.mark.parametrize(
    "cfg,state_ape", REQUEST_SAVE_CASES, ids=[f"{c.name}-{'ape' if h else 'bare'}" for c, h in REQUEST_SAVE_CASES]
)
def test_compress_single_request_saves_match_reference(cfg, state_ape, closing_grid):
    """A prefill step whose ring is saved by one program per request in the same launch (``request_saves``):
    a request resuming mid-group with a long chunk (its saves overwrite ring rows its first windows read), an
    MTP rewind of a few rows, and a fresh request longer than the ring. The same entries and ring as the
    reference; the interpreter runs the request programs first, so a window left to a closing program would
    read rows already overwritten. Runs on the GPU too: ``pytest tests/test_kernels.py -k request_saves``."""
    d = Direct(cfg, mtp_step=2, max_requests=4, max_seq_len=512, state_ape=state_ape)
    history, items = _layout_items(cfg.ratio, d.model.ring)
    for rid, n in history.items():
        d.history(rid, n)
    kv, plan, host, _ = d.step(items)
    reads_ring = [s for _, s, _ in items if s > 0]
    assert len(reads_ring) == 2 and int((host[2] >= 0).sum()) >= 3, "the step should read rings and close groups"
    k, st, a, pl, prm, out, meta, sm = d.args(kv, plan)
    launch_compress_single(k, st, a, pl, prm, out, meta, sm, ratio=cfg.ratio, overlap=cfg.overlap, save_rows=False,
                           request_saves=True, closing_grid=closing_grid)  # fmt: skip
    rep = check_outputs(d.cache, d.model, f"compress_single request_saves {cfg.name}")
    assert rep.total_bytes > 0 and rep.exact_fraction >= 0.99, str(rep)
    d.check_ring("compress_single request_saves")
    for bad in (dict(save_rows=True), dict(save_rows=False, sm=sm._replace(TABLE=True))):
        with pytest.raises(ValueError, match="request_saves"):
            launch_compress_single(k, st, a, pl, prm, out, meta, bad.get("sm", sm), ratio=cfg.ratio,
                                   overlap=cfg.overlap, save_rows=bad["save_rows"], request_saves=True)  # fmt: skip


def test_compress_single_bf16_norm_weight():
    """A bfloat16 RMSNorm weight is read as bf16 and widened (math in float32); here with a strided APE."""
    cfg = CSA_SMALL
    d = Direct(cfg, params_opts=dict(norm_dtype=torch.bfloat16))
    assert d.params.norm_weight.dtype == torch.bfloat16
    d.history(0, 5)
    kv, plan, _, _ = d.step([(0, 5, 7)])
    k, st, a, pl, prm, out, meta, sm = d.args(kv, plan, ape="permuted")
    launch_compress_single(k, st, a, pl, prm, out, meta, sm, ratio=cfg.ratio, overlap=True, save_rows=False)
    rep = check_outputs(d.cache, d.model, "bf16 norm weight")
    assert rep.total_bytes > 0 and rep.exact_fraction >= 0.99, str(rep)
