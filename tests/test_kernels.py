"""Every Triton kernel of the ring backend, launched directly, against PyTorch / the reference (small shapes).

On a machine without CUDA the kernels run under the Triton interpreter on CPU tensors. The interpreter
mis-rounds float32 -> float8e4nv casts (SPEC section 9), so the kernels encode FP8 with integer arithmetic
there (``exact_fp8``, the CPU default); these tests check that path byte for byte against PyTorch's casts and
never loosen a tolerance. The hardware path is compared with the exact path on the GPU (tests/test_gpu.py).

Inputs are poisoned before each launch (pool bytes ``0xA5``, ring and scratch NaN), so unwritten bytes and
rows read by mistake are caught; descriptors carry padding rows (``req_slot = out_slot = -1``), which must
do nothing in every kernel.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _kernel_helpers import (  # noqa: E402
    CSA_SMALL,
    HCA_SMALL,
    IDX,
    PAD_F32,
    POISON_BYTE,
    POISON_F32,
    Tracker,
    build_desc,
    check_outputs,
    check_ring,
    e4m3_probe_inputs,
    fill_bits,
    kernel_device,
    make_cache,
    make_params,
    make_rows,
    poison_outputs,
    raw,
)

import dsv4_compressor as dc  # noqa: E402
from dsv4_compressor import layout, reference, verify  # noqa: E402
from dsv4_compressor.config import CompressorConfig  # noqa: E402
from dsv4_compressor.kernels.ape import ape_add  # noqa: E402
from dsv4_compressor.kernels.c128_two_stage import norm_rope_pack, window_compress  # noqa: E402
from dsv4_compressor.kernels.entry_pack import pack_values  # noqa: E402
from dsv4_compressor.kernels.fused_compress import compress_single  # noqa: E402
from dsv4_compressor.kernels.indexer_pack import indexer_fp8_pack  # noqa: E402
from dsv4_compressor.kernels.numerics import bf16_rne, e4m3_byte, pow2, ue8m0_exponent  # noqa: E402
from dsv4_compressor.kernels.ring_save import ring_save  # noqa: E402
from dsv4_compressor.step import FIELDS  # noqa: E402

DEV = kernel_device()
KINDS = [HCA_SMALL, CSA_SMALL, IDX]


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
# The step descriptor
# ----------------------------------------------------------------------------------------------
def test_descriptor_fields_and_padding():
    r, p = 4, 2
    page_table = np.full((3, 8), -1, dtype=np.int64)
    page_table[0, :3] = [5, 1, 7]
    page_table[2, :2] = [2, 0]
    desc = dc.build_step_descriptor([2, 0], [3, 6], [2, 4], ratio=r, page_table=page_table, page_size=p, pad_to=9)
    assert desc.packed.dtype == torch.int32
    assert desc.num_rows == 9 and desc.valid_rows == 6
    assert desc.requests == [(2, 3, 2, 0), (0, 6, 4, 2)]
    fields = {name: getattr(desc, name) for name in FIELDS}
    assert all(f.dtype == torch.int32 and f.shape == (9,) for f in fields.values())
    assert fields["positions"][:6].tolist() == [3, 4, 6, 7, 8, 9]
    assert fields["req_slot"].tolist() == [2, 2, 0, 0, 0, 0, -1, -1, -1]
    assert fields["req_start"][:6].tolist() == [3, 3, 6, 6, 6, 6]
    assert fields["req_row0"][:6].tolist() == [0, 0, 2, 2, 2, 2]
    assert fields["req_end"][:6].tolist() == [5, 5, 10, 10, 10, 10]
    # position 3 closes group 0 of request 2 (page 2, slot 0); position 7 group 1 of request 0 (page 5, slot 1)
    assert fields["out_slot"].tolist() == [2 * p + 0, -1, -1, 5 * p + 1, -1, -1, -1, -1, -1]
    if hasattr(desc, "closing_rows"):  # compacted lists of newer descriptors: -1 padded
        closing = desc.closing_rows.tolist()
        assert [c for c in closing if c >= 0] == [0, 3] and all(c == -1 for c in closing[2:])
        assert [f for f in desc.first_rows.tolist() if f >= 0] == [0, 2]
        # request records: first row, slot, start, row0, end, out_slot of the first group closed in the step
        assert desc.request_records.tolist() == [[0, 2, 3, 0, 5, 2 * p], [2, 0, 6, 2, 10, 5 * p + 1]]
        short = dc.build_step_descriptor([0], [4], [3], ratio=r, page_table=page_table, page_size=p, pad_requests_to=2)
        assert short.request_records.tolist() == [[0, 0, 4, 0, 7, -1], [-1] * 6]  # closes nothing: -1

    # copy_ into a larger descriptor: the tail becomes padding
    big = build_desc([1], [0], [12], ratio=r, page_table=None, page_size=p, pad_requests_to=3)
    assert big.out_slot.tolist() == [-1] * 12
    big.copy_(desc)
    assert big.num_rows == 12 and big.valid_rows == 6 and big.requests == desc.requests
    for name in FIELDS:
        assert getattr(big, name)[:6].tolist() == getattr(desc, name)[:6].tolist(), name
    assert big.req_slot[6:].tolist() == [-1] * 6 and big.out_slot[6:].tolist() == [-1] * 6
    if hasattr(desc, "request_records"):
        assert big.request_records.tolist() == desc.request_records.tolist() + [[-1] * 6]
    with pytest.raises(ValueError, match="cannot hold"):
        desc.copy_(big)
    with pytest.raises(ValueError, match="pad_to"):
        dc.build_step_descriptor([0], [0], [5], ratio=r, page_table=None, page_size=p, pad_to=4)
    with pytest.raises(ValueError, match="no page"):
        dc.build_step_descriptor([1], [0], [4], ratio=r, page_table=page_table, page_size=p)


# ----------------------------------------------------------------------------------------------
# Step set-up shared by the direct kernel tests
# ----------------------------------------------------------------------------------------------
class Direct:
    """A cache used only for its pool, ring and parameters; steps are built and launched by hand.

    ``history`` puts requests at lengths ``L`` with their last ring rows saved (gated, as a previous step
    would have left them); ``desc_for`` builds a padded descriptor for new rows and updates the model."""

    def __init__(self, cfg, *, mtp_step=2, seed=0, max_requests=4, **kw):
        self.cfg = cfg
        self.params = make_params(cfg, seed=seed, device=DEV)
        self.cache = make_cache(cfg, self.params, "triton", max_requests=max_requests, mtp_step=mtp_step, **kw)
        poison_outputs(self.cache)
        self.tracker = Tracker(cfg, self.params, mtp_step)
        self.gen = torch.Generator().manual_seed(100 + seed)

    @property
    def ring(self):
        return self.cache.backend.ring

    def history(self, rid: int, length: int) -> None:
        rows = make_rows(length, self.cfg, self.gen)
        self.tracker.rows[rid] = rows
        self.tracker.retained[rid] = max(0, length - self.tracker.ring)
        pos = self.tracker.live_ring_positions(rid)
        if pos:
            self.ring[rid, torch.tensor(pos) % self.ring.shape[1]] = self.tracker.gated(rid, pos).to(DEV)

    def step(self, items, pad: int = 3):
        """``items = [(rid, start, n)]`` -> (kv_score on DEV with ``pad`` padding rows, descriptor, CPU rows)."""
        cfg, pool = self.cfg, self.cache.pool
        for rid, start, n in items:
            pool.ensure(rid, (start + n) // cfg.ratio)
        total = sum(n for _, _, n in items)
        desc = dc.build_step_descriptor(
            [i[0] for i in items],
            [i[1] for i in items],
            [i[2] for i in items],
            ratio=cfg.ratio,
            page_table=pool.page_table,
            page_size=pool.page_size,
            device=DEV,
            pad_to=total + pad,
        )
        rows = make_rows(total, cfg, self.gen)
        kv = torch.empty(total + pad, cfg.row_width)
        fill_bits(kv, PAD_F32)
        kv[:total] = rows
        row = 0
        for rid, start, n in items:
            self.tracker.apply(rid, start, rows[row : row + n], pool.page_table, pool.page_size)
            row += n
        return kv.to(DEV), desc, rows

    def with_ape(self, kv: torch.Tensor, desc) -> torch.Tensor:
        """``kv`` with ``ape[p % r]`` added to the gate logits of the non-padding rows (as ``ape_add`` would)."""
        out = kv.clone()
        valid = desc.valid_rows
        pos = desc.positions[:valid].long()
        w = self.cfg.width
        out[:valid, w:] = out[:valid, w:] + self.params.ape[pos % self.cfg.ratio]
        return out


def _closing_rows(desc) -> list[int]:
    return (desc.out_slot >= 0).nonzero()[:, 0].tolist()


# Requests of the direct kernel tests, per ratio: slot 0 continues mid-group with a chunk that closes two
# groups (the first window straddles ring and new rows), slot 1 decodes a few rows across a boundary after
# a rewind, slot 3 starts fresh with a chunk longer than the ring.
def _layout_items(r: int, ring: int):
    history = {0: r + r // 2 + 1, 1: 3 * r - 1}
    items = [(0, history[0], 2 * r), (1, history[1] - 2, 3), (3, 0, ring + r + 1)]
    return history, items


# ----------------------------------------------------------------------------------------------
# ape_add, ring_save
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", KINDS, ids=lambda c: c.name)
def test_ape_add_matches_torch(cfg):
    d = Direct(cfg)
    history, items = _layout_items(cfg.ratio, d.tracker.ring)
    for rid, n in history.items():
        d.history(rid, n)
    kv, desc, _ = d.step(items)
    want = d.with_ape(kv, desc)
    ape_add(kv, d.params.ape, desc)
    assert torch.equal(raw(kv.cpu()), raw(want.cpu())), "ape_add differs from kv + ape[p % r] (or touched padding)"


@pytest.mark.parametrize("add_ape", [True, False], ids=["add_ape", "pre_added"])
@pytest.mark.parametrize("cfg", KINDS, ids=lambda c: c.name)
def test_ring_save_matches_torch(cfg, add_ape):
    d = Direct(cfg)
    history, items = _layout_items(cfg.ratio, d.tracker.ring)
    for rid, n in history.items():
        d.history(rid, n)
    kv, desc, _ = d.step(items)
    if not add_ape:
        kv = d.with_ape(kv, desc)
    before = d.ring.clone()
    kv_before = kv.clone()
    ring_save(kv, d.ring, d.params.ape, desc, add_ape=add_ape)
    assert torch.equal(raw(kv.cpu()), raw(kv_before.cpu())), "ring_save wrote kv_score"
    ring_len = d.ring.shape[1]
    want = before.clone()
    for rid, start, n in items:  # only each request's last min(n, ring) rows land in its ring
        pos = list(range(max(start, start + n - ring_len), start + n))
        want[rid, torch.tensor(pos) % ring_len] = d.tracker.gated(rid, pos).to(DEV)
    bad = (raw(d.ring.cpu()).view(-1, 4) != raw(want.cpu()).view(-1, 4)).any(dim=1).nonzero()[:, 0]
    if len(bad):
        idx = np.unravel_index(bad[0].item(), d.ring.shape)
        pytest.fail(f"{len(bad)} ring floats differ from the expected save; first at (slot, row, col) {idx}")
    check_ring(d.cache, d.tracker, "ring_save")


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
    poison_outputs(cache)
    pool = cache.pool
    n = 20
    assert pool.num_pages * pool.page_size >= n
    vals = _boundary_values(cfg, n, torch.Generator().manual_seed(3))
    slots = torch.randperm(pool.num_pages * pool.page_size, generator=torch.Generator().manual_seed(4))[:n]
    slots[5] = -1  # skipped
    pack_values(vals.to(DEV), slots.to(torch.int32).to(DEV), pool, exact_fp8=True)
    keep = slots >= 0
    got = pool.layout.read(pool.pages, slots[keep].to(DEV)).cpu()
    want = layout.encode_latent(vals[keep], cfg)
    bad = (got != want).nonzero()
    assert len(bad) == 0, f"{len(bad)} bytes differ from layout.encode_latent, first (record, byte) {bad[0].tolist()}"
    written = Tracker(cfg, cache.params, 0)
    written.written = {int(s): vals[i].double() for i, s in enumerate(slots.tolist()) if s >= 0}
    rep = check_outputs(cache, written, "pack_values")  # and every other byte still poison
    assert rep.exact_fraction == 1.0, str(rep)


def test_pack_values_indexer_keys_and_fp8():
    cfg = IDX
    cache = make_cache(cfg, make_params(cfg), "triton", max_requests=2, max_seq_len=512)
    poison_outputs(cache)
    pool = cache.pool
    gen = torch.Generator().manual_seed(5)
    vals = torch.randn(20, cfg.head_dim, generator=gen) * torch.exp2(torch.randint(-6, 6, (20, 1), generator=gen))
    slots = torch.randperm(pool.num_pages * pool.page_size, generator=gen)[:20]
    slots[[0, 7]] = -1
    pack_values(vals.to(DEV), slots.to(torch.int32).to(DEV), pool, exact_fp8=True)
    keep = slots >= 0
    got_keys = pool.keys[slots[keep].to(DEV)].cpu()
    assert torch.equal(raw(got_keys), raw(vals[keep].to(torch.bfloat16))), "bf16 keys differ from a torch cast"
    written = Tracker(cfg, cache.params, 0)
    written.written = {int(s): vals[i].double() for i, s in enumerate(slots.tolist()) if s >= 0}
    rep = check_outputs(cache, written, "pack_values indexer")
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
    keys = torch.zeros(8, 128, dtype=torch.bfloat16, device=DEV)
    slots = torch.zeros(1, dtype=torch.int32, device=DEV)
    pages = torch.zeros(2, 4 * 132, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="bf16"):
        indexer_fp8_pack(keys.float(), slots, pages, 4)
    with pytest.raises(ValueError, match="pages"):
        indexer_fp8_pack(keys, slots, pages, 3)


# ----------------------------------------------------------------------------------------------
# Compress kernels
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [HCA_SMALL, CompressorConfig.hca()], ids=lambda c: c.name)
@pytest.mark.parametrize("add_ape", [True, False], ids=["fused_ape", "pre_added"])
def test_window_compress_matches_reference_pooling(cfg, add_ape):
    """Stage 1 of the tiled C128 kernel: the float32 pooled vector of each closing row, nothing else."""
    real = cfg.ratio == 128
    d = Direct(cfg, mtp_step=1, max_requests=3, max_seq_len=512)
    r = cfg.ratio
    # slot 0: cached rows 0..r/2+2, a chunk that closes groups 0 (straddling) and 1; slot 2: a fresh request.
    d.history(0, r // 2 + 3)
    items = [(0, r // 2 + 3, 2 * r - r // 2 - 3), (2, 0, r)] if not real else [(0, r // 2 + 3, r // 2 - 3)]
    kv, desc, _ = d.step(items)
    if not add_ape:
        kv = d.with_ape(kv, desc)
    scratch = fill_bits(torch.empty(desc.num_rows, cfg.head_dim, device=DEV), POISON_F32)
    window_compress(kv, d.ring, desc, d.params, scratch, add_ape=add_ape)
    scratch = scratch.cpu()
    closing = _closing_rows(desc)
    assert len(closing) == (3 if not real else 1)
    for t in range(desc.num_rows):
        if t not in closing:
            assert bool((scratch[t].view(torch.int32) == POISON_F32).all()), (
                f"scratch row {t} (closes no group) was written"
            )
            continue
        rid = int(desc.req_slot[t])
        g = int(desc.positions[t]) // r
        _, pooled = reference.compress_sequence(
            d.tracker.rows[rid][: (g + 1) * r], d.params.to("cpu"), cfg, dtype=torch.float64, return_pooled=True
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


@pytest.mark.parametrize("save_rows", [True, False], ids=["save", "no_save"])
def test_norm_rope_pack_from_scratch(save_rows):
    """Stage 2 of the tiled kernel: RMSNorm, rope and FP8 pack of the scratch row; with ``save_rows`` it also
    saves the step's tail rows into the ring."""
    cfg = HCA_SMALL
    d = Direct(cfg, mtp_step=2)
    r = cfg.ratio
    d.history(0, r + 3)
    d.history(1, 2 * r - 2)
    items = [(0, r + 3, 2 * r), (1, 2 * r - 3, 3)]
    kv, desc, _ = d.step(items)
    scratch = fill_bits(torch.empty(desc.num_rows, cfg.head_dim), POISON_F32)
    pooled = {}
    for t in _closing_rows(desc):
        rid, g = int(desc.req_slot[t]), int(desc.positions[t]) // r
        _, p = reference.compress_sequence(
            d.tracker.rows[rid][: (g + 1) * r], d.tracker.params, cfg, dtype=torch.float64, return_pooled=True
        )
        scratch[t] = p[g].float()
        pooled[t] = p[g]
    ring_before = d.ring.clone()
    norm_rope_pack(
        scratch.to(DEV), kv, d.ring, desc, d.params, d.cache.pool, add_ape=True, save_rows=save_rows, exact_fp8=True
    )
    # the expected entries are the float64 finish of the float32 scratch values the kernel was given
    starts = torch.tensor([int(desc.positions[t]) // r * r for t in pooled])
    finished = reference.finish_entries(
        torch.stack([scratch[t].double() for t in pooled]),
        starts,
        reference.params_as(d.tracker.params, torch.float64),
        cfg,
    )
    d.tracker.written = {int(desc.out_slot[t]): finished[i] for i, t in enumerate(pooled)}
    check_outputs(d.cache, d.tracker, "norm_rope_pack")
    if save_rows:
        check_ring(d.cache, d.tracker, "norm_rope_pack save")
    else:
        assert torch.equal(raw(d.ring.cpu()), raw(ring_before.cpu())), "save_rows=False wrote the ring"


SINGLE_CASES = [(cfg, decode) for cfg in KINDS for decode in (False, True)] + [(CompressorConfig.hca(), True)]


@pytest.mark.parametrize(
    "cfg,decode", SINGLE_CASES, ids=[f"{c.name}-{'decode' if d else 'prefill'}" for c, d in SINGLE_CASES]
)
def test_compress_single_matches_reference(cfg, decode):
    """The single-stage kernel for every kind (and DeepSeek-V4's HCA window of 128 x 512 on a decode step):
    entries of the closing rows, and the in-kernel ring save of decode steps (each request brings at most
    mtp_step + 1 rows)."""
    r, mtp = cfg.ratio, 2
    real = cfg.ratio == 128
    d = Direct(cfg, mtp_step=mtp, max_requests=4, max_seq_len=512)
    if decode:  # three requests decode S rows each: across a boundary, after a rewind, and not closing
        for rid, n in ((0, 2 * r - 2), (1, 3 * r + 1), (2, r + 2)):
            d.history(rid, n)
        items = [(0, 2 * r - 2, mtp + 1), (1, 3 * r - 1, mtp + 1), (2, r + 2, 1)]
        if real:
            items = items[:1]
    else:
        history, items = _layout_items(r, d.tracker.ring)
        for rid, n in history.items():
            d.history(rid, n)
    kv, desc, _ = d.step(items)
    ring_before = d.ring.clone()
    compress_single(kv, d.ring, desc, d.params, d.cache.pool, add_ape=True, save_rows=decode, exact_fp8=True)
    rep = check_outputs(d.cache, d.tracker, f"compress_single {cfg.name}")
    assert rep.total_bytes > 0
    if decode:
        check_ring(d.cache, d.tracker, "compress_single in-kernel save")
    else:
        assert torch.equal(raw(d.ring.cpu()), raw(ring_before.cpu())), "save_rows=False wrote the ring"
        ring_save(kv, d.ring, d.params.ape, desc, add_ape=True)
        check_ring(d.cache, d.tracker, "compress_single + ring_save")


def test_compress_single_bf16_norm_weight():
    """A bfloat16 RMSNorm weight is read as bf16 and widened (math in float32)."""
    cfg = CSA_SMALL
    d = Direct(cfg)
    params = dc.CompressorParams.random(cfg, max_positions=512, seed=9, norm_dtype=torch.bfloat16)
    d.cache.backend.params = params = params.to(DEV)
    d.tracker.params = params.to("cpu")
    d.history(0, 5)
    kv, desc, _ = d.step([(0, 5, 7)])
    compress_single(kv, d.ring, desc, params, d.cache.pool, add_ape=True, save_rows=False, exact_fp8=True)
    check_outputs(d.cache, d.tracker, "bf16 norm weight")
